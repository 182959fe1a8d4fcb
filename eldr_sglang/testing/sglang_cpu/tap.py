"""A recording HTTP pass-through in front of a server, for tests: what reached it, and when.

The router is given the tap's URL instead of the server's, so a test can observe the
router's traffic from outside the router: when each request (keyed by its bootstrap room)
reached a worker, and when a prefill's streamed expert signature passed through. Times are
this process's time.monotonic(), comparable across every tap of one test process.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp
from aiohttp import web

HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host", "content-encoding"}


class Tap:
    """Forward every request on 127.0.0.1:<port> to `upstream`, streaming the answer back.

    `events` gets {"t", "event", "path", "room", ...} dicts: "request" when a request arrives
    (room: its bootstrap_room, None without one; prompt: its text), "signature" (with the raw payload) for the
    first streamed event that carries meta_info.eldr_signature, "response" (status; the body
    of POSTs) for a non-streamed answer, "stream_end" (the last data line) for a streamed
    one, "closed" when a POST's answer ended."""

    def __init__(self, name: str, upstream: str):
        self.name, self.upstream = name, upstream.rstrip("/")
        self.events: list[dict] = []
        self._lock = threading.Lock()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tap-{name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"tap {name} did not start")

    def log(self, **event) -> None:
        with self._lock:
            self.events.append({"t": time.monotonic(), **event})

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.events)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600, sock_connect=10))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{path:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        room = prompt = None
        if body:
            try:
                req = json.loads(body)
                room = req.get("bootstrap_room")
                prompt = req.get("text", req.get("prompt", req.get("messages")))
            except (ValueError, AttributeError):
                pass
        self.log(event="request", method=request.method, path=request.path, room=room, prompt=prompt)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            up = await self._session.request(request.method, self.upstream + request.path_qs, data=body or None,
                                             headers=headers)
        except aiohttp.ClientError as exc:
            self.log(event="upstream_error", path=request.path, room=room, error=str(exc))
            return web.Response(status=502, text=f"tap {self.name}: upstream unreachable: {exc}")
        out = None
        try:
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
            if "text/event-stream" not in up.headers.get("Content-Type", ""):
                data = await up.read()
                self.log(event="response", path=request.path, room=room, status=up.status, body=data if body else None)
                return web.Response(status=up.status, body=data, headers=out_headers)
            out = web.StreamResponse(status=up.status, headers=out_headers)
            await out.prepare(request)
            seen_sig, last = False, None
            async for line in up.content:
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    last = line
                if not seen_sig and b"eldr_signature" in line and line.startswith(b"data:"):
                    try:
                        meta = json.loads(line[5:].strip()).get("meta_info") or {}
                    except ValueError:
                        meta = {}
                    if "eldr_signature" in meta:
                        seen_sig = True
                        self.log(event="signature", path=request.path, room=room, payload=meta["eldr_signature"],
                                 meta={k: v for k, v in meta.items() if k != "eldr_signature"})
                await out.write(line)
            await out.write_eof()
            self.log(event="stream_end", path=request.path, room=room, status=up.status, last=last)
            return out
        except (aiohttp.ClientError, ConnectionResetError) as exc:
            # the upstream ended the answer early (aborted, killed): cut the client off too
            self.log(event="stream_error", path=request.path, room=room, error=str(exc))
            if out is None:
                return web.Response(status=502, text=f"tap {self.name}: upstream failed: {exc}")
            if request.transport is not None:
                request.transport.close()
            return out
        finally:
            if body:
                self.log(event="closed", path=request.path, room=room)
            up.release()

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()
            await self._session.close()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
