"""The router's control endpoints (eldr_sglang/router/admin.py and the experiment switch in
router/app.py) on odd input, in process: the control app on a loopback test server, its data
plane built but not started, no workers."""

from __future__ import annotations

import asyncio
import socket

import pytest

pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from eldr_sglang.router.app import build_app  # noqa: E402
from eldr_sglang.router.config import ConfigError, parse_config  # noqa: E402

TOKEN = "admin-test-token-0123456789"
BASE = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10",
        "--decode", "http://127.0.0.1:11", "--health-check-interval-secs", "0", "--load-monitor-interval", "0",
        "--worker-startup-timeout-secs", "0"]
RANDOM = BASE + ["--disagg-router", "random"]


def _app():
    return build_app(parse_config(BASE + ["--experiment", "round_robin,random", "--admin-token", TOKEN]))


def _raw(port: int, head: bytes, body: bytes = b"{}") -> tuple[int, bytes]:
    """(status, whole answer) of a request sent as these exact bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                  + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return int(out.split(b" ", 2)[1]), out


@pytest.mark.parametrize("path", ["/flush_cache", "/eldr/experiment/switch"])
@pytest.mark.parametrize("auth", [b"Bearer \xff\xfe\xfd-not-utf8", b"\xc3\x28 " + TOKEN.encode(), b"Bearer " + b"\x80" * 40])
def test_non_utf8_authorization_is_a_401(path, auth):
    """Bytes no UTF-8 decoder reads, in the scheme or the token: a 401 like any wrong token,
    not a 500 from encoding the header back."""
    async def main():
        async with TestClient(TestServer(_app())) as c:
            port = c.server.port
            status, out = await asyncio.to_thread(
                _raw, port, f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + b"Authorization: " + auth + b"\r\n")
            assert status == 401, out
            assert b"wrong bearer token" in out
            # the right token still passes (the switch answers; /flush_cache has no workers to reach)
            r = await c.post("/eldr/experiment/switch", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status == 200, await r.text()

    asyncio.run(main())


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"arm": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"])
def test_deeply_nested_switch_body_is_a_400(body):
    async def main():
        async with TestClient(TestServer(_app())) as c:
            r = await c.post("/eldr/experiment/switch", data=body, headers={
                "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
            assert r.status == 400, await r.text()
            assert "nested too deeply" in (await r.json())["error"]["message"]

    asyncio.run(main())


@pytest.mark.parametrize("token, match", [
    ("admin-token-0123456789\n", "a header cannot carry"),
    ("admin-token\r\n0123456789", "a header cannot carry"),
    ("admin-token-\x000123456789", "a header cannot carry"),
    (" " * 20, "a header cannot carry"),
    ("  admin-token-0123456789", "a header cannot carry"),
    ("admin-token-0123456789 ", "a header cannot carry"),
    ("admin-token-é-0123456789", "a header cannot carry"),
])
def test_admin_token_a_header_cannot_carry_is_refused(token, match, monkeypatch):
    with pytest.raises(ConfigError, match=match) as e:
        parse_config(RANDOM + ["--admin-token", token])
    assert "\n" not in str(e.value)
    if "\x00" not in token:  # no environment can hold a NUL
        monkeypatch.setenv("ELDR_ADMIN_TOKEN", token)
        with pytest.raises(ConfigError, match=match):
            parse_config(RANDOM)
        monkeypatch.delenv("ELDR_ADMIN_TOKEN")
    # an inner space is carried (the header's value after "Bearer " is compared whole)
    assert parse_config(RANDOM + ["--admin-token", "admin token 0123456789"]).admin_token == "admin token 0123456789"


def test_launch_router_refuses_a_newline_token_in_one_line():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "eldr_sglang.launch_router", *RANDOM, "--admin-token", "admin-token-0123456789\n"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "--admin-token" in p.stderr, p.stderr
