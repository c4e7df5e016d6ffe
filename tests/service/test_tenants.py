"""Tenants of one deployment (service.tenants, BERTSERVE_KEYS_FILE), over real HTTP: each key's
tenant is served and counted by name, its requests take its default priority, and its share
of the in-flight and receiving places is its own: past it, it is refused while the other
tenant is admitted. A keys file that cannot be used stops the start with its table named."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
from pydantic import ValidationError

from bertserve.service.settings import Settings
from tests.helpers.server import live_server
from tests.service.test_behaviour import metric, until, wrap

SEARCH, INDEXER = "search-key-0123456789abcdef", "indexer-key-0123456789abcdef"
KEYS = f"""
[search]
key = "{SEARCH}"
weight = 3

[indexer]
keys = ["{INDEXER}"]
priority = 7
"""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    return path


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[a]\nkey = "short"\n', "[a]: every key needs 16 characters"),
        (f'[a]\nkey = "{SEARCH}"\nweight = 0\n', "[a]: weight must be a number above 0"),
        (f'[a]\nkey = "{SEARCH}"\npriority = 1000\n', "[a]: priority must be an integer"),
        (f'[a]\nkey = "{SEARCH}"\nwieght = 2\n', "[a]: unknown fields ['wieght']"),
        (f'[a]\nkey = "{SEARCH}"\n[b]\nkey = "{SEARCH}"\n', "a key is given twice"),
        (f'[default]\nkey = "{SEARCH}"\n', "not 'anonymous' or 'default'"),
        ("[a]\nweight = 2\n", '[a]: give its key as key = "..."'),
        ("[a\n", "keys file"),
    ],
)
def test_a_keys_file_that_cannot_be_used_names_what_is_wrong(tmp_path, text, says):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ValidationError, match="BERTSERVE_KEYS_FILE") as failed:
        Settings(keys_file=path)
    assert says in str(failed.value)


def test_a_missing_keys_file_and_a_key_in_both_places_are_refused(tmp_path, keys_file):
    with pytest.raises(ValidationError, match="No such file"):
        Settings(keys_file=tmp_path / "absent.toml")
    with pytest.raises(ValidationError, match="also in BERTSERVE_KEYS_FILE"):
        Settings(keys_file=keys_file, api_keys=SEARCH)


def test_each_tenant_is_served_counted_and_logged_by_name(bundle_dir, keys_file, caplog):
    other = "a-default-key-0123456789"
    with (
        live_server(bundles=bundle_dir, keys_file=keys_file, api_keys=other) as live,
        caplog.at_level(logging.INFO, logger="bertserve.access"),
    ):
        with live.client() as c:
            for key in (SEARCH, INDEXER, other):
                answer = c.post("/classify", json={"inputs": "a fine film"}, headers=auth(key))
                assert answer.status_code == 200, answer.text
            assert (
                c.post("/classify", json={"inputs": "x"}, headers=auth("n" * 20)).status_code == 401
            )
        for tenant in ("search", "indexer", "default"):
            assert metric(live, "bertserve_tenant_rows_total", tenant=tenant) == 1
        deadline = time.monotonic() + 5  # the access line is written just after the answer
        while len(served(caplog)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    # The access log names each request's tenant, never its key.
    assert sorted(r.fields.get("tenant") for r in served(caplog)) == [
        "default",
        "indexer",
        "search",
    ]
    assert not any(SEARCH in r.getMessage() or SEARCH in str(r.fields) for r in caplog.records)


def served(caplog) -> list:
    fields = [getattr(r, "fields", {}) for r in caplog.records]
    return [
        r
        for r, f in zip(caplog.records, fields, strict=True)
        if f.get("endpoint") == "/classify" and f.get("status") == 200
    ]


def test_a_tenants_requests_take_its_default_priority(bundle_dir, keys_file):
    """Behind a busy call, the indexer's request (its priority 7) waits for the requests sent
    after it at priority 0: its own with X-Request-Priority: 0 (a header wins over the
    tenant's default) and search's (the server's default), which goes first of those two:
    search's weight is three times the indexer's."""
    with live_server(bundles=bundle_dir, keys_file=keys_file, max_batch_rows=1) as live:
        gate = threading.Event()
        backend = wrap(live, "sentiment", gate=gate)
        done: list[str] = []

        async def run():
            async with httpx.AsyncClient(base_url=live.url, timeout=20) as c:

                async def send(name, key, **headers):
                    body = {"inputs": f"the {name} one"}
                    r = await c.post("/classify", json=body, headers={**auth(key), **headers})
                    assert r.status_code == 200, r.text
                    done.append(name)

                first = asyncio.create_task(send("first", SEARCH))
                await until(lambda: backend.calls == 1)
                batcher = live.state.models["sentiment"].batcher
                indexer = asyncio.create_task(send("indexer", INDEXER))
                await until(lambda: batcher.depth == 1)
                urgent = asyncio.create_task(send("urgent", INDEXER, **{"X-Request-Priority": "0"}))
                await until(lambda: batcher.depth == 2)
                search = asyncio.create_task(send("search", SEARCH))
                await until(lambda: batcher.depth == 3)
                gate.set()
                await asyncio.gather(first, indexer, urgent, search)

        asyncio.run(run())
        assert done == ["first", "search", "urgent", "indexer"]


def test_a_tenant_past_its_share_of_in_flight_is_refused_and_the_other_is_not(
    bundle_dir, keys_file
):
    """max_in_flight 8 between weights 3 and 1: the indexer holds 2 requests at most, the
    third is a 503 naming its share, while search's requests are still admitted."""
    with live_server(bundles=bundle_dir, keys_file=keys_file, max_in_flight=8) as live:
        gate = threading.Event()
        backend = wrap(live, "sentiment", gate=gate)

        async def run():
            async with httpx.AsyncClient(base_url=live.url, timeout=20) as c:

                def send(key, text):
                    return asyncio.create_task(
                        c.post("/classify", json={"inputs": text}, headers=auth(key))
                    )

                held = [send(INDEXER, "one"), send(INDEXER, "two")]
                await until(lambda: live.state.in_flight == 2 and backend.calls >= 1)
                refused = await c.post("/classify", json={"inputs": "3"}, headers=auth(INDEXER))
                searches = [send(SEARCH, f"s {i}") for i in range(5)]
                await until(lambda: live.state.in_flight == 7)
                gate.set()
                return refused, await asyncio.gather(*held, *searches)

        refused, answered = asyncio.run(run())
        assert refused.status_code == 503, refused.text
        assert (
            "tenant indexer has 2 requests in flight (its share of max_in_flight)"
            in (refused.json()["error"])
        )
        assert [r.status_code for r in answered] == [200] * 7


def test_a_tenants_slow_bodies_take_only_its_share_of_receiving(bundle_dir, keys_file):
    """max_receiving 4 between weights 3 and 1: one indexer body that never arrives holds
    the indexer's one place, its next is a 503, and search's request is served."""
    with live_server(bundles=bundle_dir, keys_file=keys_file, max_receiving=4) as live:
        host, port = live.url.removeprefix("http://").split(":")
        head = (
            "POST /classify HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {INDEXER}\r\ncontent-length: 100\r\n\r\n"
        ).encode()
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(head + b'{"inputs"')  # the rest never comes
            with live.client() as c:
                asyncio.run(until(lambda: live.state.receiving == 1))
                second = c.post("/classify", json={"inputs": "x"}, headers=auth(INDEXER))
                assert second.status_code == 503
                assert "its share of max_receiving" in second.json()["error"]
                served = c.post("/classify", json={"inputs": "x"}, headers=auth(SEARCH))
                assert served.status_code == 200


def test_a_grpc_call_is_its_keys_tenants(bundle_dir, keys_file):
    import grpc

    from bertserve.service.grpc import tei_pb2 as pb
    from bertserve.service.grpc import tei_pb2_grpc as pb_grpc
    from tests.helpers.server import free_port

    with (
        live_server(bundles=bundle_dir, keys_file=keys_file, grpc_port=free_port()) as live,
        grpc.insecure_channel(f"127.0.0.1:{live.state.grpc_port}") as channel,
    ):
        stub = pb_grpc.PredictStub(channel)
        metadata = [("authorization", f"Bearer {INDEXER}"), ("model", "sentiment")]
        assert stub.Predict(pb.PredictRequest(inputs="a fine film"), metadata=metadata)
        assert metric(live, "bertserve_tenant_rows_total", tenant="indexer") == 1
