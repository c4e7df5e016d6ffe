"""/docs and /redoc work without internet: every asset is the service's own (from the
fastapi-offline package), and a real headless Chromium renders every operation."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from bertserve.runtime.tasks import TASKS
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow
ASSET = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|(?:url|Url)\s*:\s*["']([^"']+)["']""")


@pytest.fixture(scope="module")
def server(bundle_dir):
    with live_server(bundles=bundle_dir) as live:
        yield live


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_pages_reference_only_their_own_assets(server, page):
    with server.client() as c:
        html = c.get(page)
        assert html.status_code == 200
        assert "://" not in html.text, re.findall(r"\S*://\S*", html.text)
        assets = [a or b for a, b in ASSET.findall(html.text)]
        assert len(assets) >= 2, assets
        for asset in assets:
            assert asset.startswith("/"), asset
            assert c.get(asset).status_code == 200, asset


def test_chromium_renders_every_operation_offline(server):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    dom = subprocess.run(
        [
            browser,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--proxy-server=http://127.0.0.1:9",  # anything off this machine fails at once
            "--virtual-time-budget=15000",
            "--dump-dom",
            f"{server.url}/docs",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rendered = re.findall(r'data-path="([^"]+)"', dom)
    for path in TASKS:
        assert path in rendered, (path, rendered)
    assert "/health/ready" in rendered and "/models" in rendered
