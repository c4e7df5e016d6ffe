"""A worker's side of the engine process (`BERTSERVE_ENGINE_PROCESS`; its side is
service/process/engine_server.py): `RemoteBackend`, the batcher's `Backend` for a model that runs
there, over a Unix socket and service/process/wire.py's messages."""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.connection import Client, Connection

import numpy as np

from bertserve.runtime.bundle import BundleSpec
from bertserve.service.http.errors import BackendError
from bertserve.service.process.wire import WireError, pack, unpack

log = logging.getLogger("bertserve.engine_client")
CONNECT_WAIT_S = 30.0  # a worker waits this long for a (re)starting engine before failing a batch


class RemoteBackend:
    """A worker's handle on one model of the engine process: the batcher's `Backend`. One call at
    a time (the batcher's thread, or the warm-up's before it), over one connection; a lost
    connection is reopened on the next call, waiting up to CONNECT_WAIT_S for a restarting
    engine."""

    serial = True  # one call at a time: the batcher forms no second lane (runtime.batching)

    def __init__(self, address: str, spec: BundleSpec) -> None:
        self.address, self.spec = address, spec
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self.provider = self.requested = "unknown"
        # the engine process's models are on ONNX Runtime (OpenVINO is a CPU engine, chosen
        # in the workers' own Engine)
        self.engine_name = "onnxruntime"
        self.engine_choice: dict[str, object] = {}
        with self._lock:
            self._connect()

    def _connect(self) -> Connection:
        """Connect and greet, retrying while the engine is not listening or hangs up (it is
        starting, or dying: a killed engine's queue may still take a connection)."""
        deadline = time.monotonic() + CONNECT_WAIT_S
        while True:
            try:
                conn = Client(self.address, family="AF_UNIX")
                try:
                    conn.send_bytes(
                        pack("hello", model=self.spec.name, sha256=self.spec.graphs_sha256)
                    )
                    answer, _ = unpack(conn.recv_bytes())
                except BaseException:
                    conn.close()
                    raise
                break
            except WireError as exc:
                raise BackendError(f"the engine process greeted out of format: {exc}") from exc
            except (EOFError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise BackendError(f"the engine process at {self.address}: {exc!r}") from exc
                time.sleep(0.05)
        if answer["kind"] != "ok":
            conn.close()
            raise BackendError(str(answer.get("message")))
        self.provider, self.requested = answer["provider"], answer["requested"]
        self._conn = conn
        return conn

    def run(
        self, feeds: dict[str, np.ndarray], extra: tuple[str, ...] = ()
    ) -> dict[str, np.ndarray]:
        """The outputs of one padded batch; `extra`: outputs computed only on demand
        (runtime.capabilities.ON_DEMAND) that its rows want."""
        with self._lock:
            for attempt in (1, 2):
                conn = self._conn or self._connect()
                try:
                    conn.send_bytes(pack("run", feeds, extra=list(extra)))
                    answer, outputs = unpack(conn.recv_bytes())
                    break
                except (EOFError, OSError, WireError) as exc:
                    conn.close()
                    self._conn = None
                    if isinstance(exc, WireError):  # an answer out of format: nothing to resend
                        raise BackendError(f"the engine process answered {exc}") from exc
                    # The engine process went away (it is restarted by the supervisor). A model
                    # call changes nothing, so it is safe to send again, once, to the new one.
                    if attempt == 2:
                        raise BackendError(f"the engine process went away twice: {exc}") from exc
                    log.warning("the engine process went away during a call (%s): resending", exc)
        if answer["kind"] != "ok":
            raise BackendError(f"the engine process failed the call: {answer.get('message')}")
        return outputs

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
