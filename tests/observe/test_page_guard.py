"""The live page's server answers only its own names and pages (issue 31): /api/run carries decoded prompts
and responses, so a page of another name rebound to its address by DNS, or another site's page, gets 403."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from milestream.observe.page import serve_http


def _get(url: str, headers: dict[str, str]) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as refused:
        return refused.code


@pytest.fixture
def page_url():
    server = serve_http(0, "127.0.0.1", {"/api/run": lambda: ("application/json", b"{}")})
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_page_refuses_a_rebound_name_and_another_sites_origin(page_url: str) -> None:
    port = page_url.rsplit(":", 1)[1]
    assert _get(page_url + "/api/run", {}) == 200
    assert _get(page_url + "/api/run", {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}) == 200
    assert _get(page_url + "/api/run", {"Host": f"rebound.example:{port}"}) == 403
    assert _get(page_url + "/api/run", {"Origin": "http://evil.example"}) == 403
