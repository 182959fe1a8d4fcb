"""Endpoints the router answers by asking its workers: /v1/models, /server_info (and
/get_server_info, its older name) and /flush_cache. Each upstream call has its own timeout, and a
worker that fails is skipped or reported, never waited on past that."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web

from eldr_sglang.router.admin import guarded

MODELS_TIMEOUT_S = 5.0
SERVER_INFO_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 30.0  # a flush waits for the worker's running batch


class WorkerPassthrough:
    def __init__(self, pd):
        self.pd = pd

    def _urls(self) -> tuple[list[str], list[str]]:
        return [u for _, u in self.pd.members("prefill")], [u for _, u in self.pd.members("decode")]

    async def models(self, _request: web.Request) -> web.Response:
        """The first worker's answer (decode workers first: they serve the model's name too)."""
        prefill, decode = self._urls()
        for url in decode + prefill:
            try:
                async with self.pd.session.get(f"{url}/v1/models",
                                               timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as r:
                    if r.status == 200:
                        return web.Response(body=await r.read(), content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        return web.json_response({"error": {"message": "no worker answered /v1/models"}}, status=503)

    async def _server_info_of(self, url: str) -> dict:
        try:
            async with self.pd.session.get(f"{url}/server_info",
                                           timeout=aiohttp.ClientTimeout(total=SERVER_INFO_TIMEOUT_S)) as r:
                return await r.json(content_type=None) if r.status == 200 else {"error": f"HTTP {r.status}"}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return {"error": str(exc)}

    async def server_info(self, _request: web.Request) -> web.Response:
        prefill_urls, decode_urls = self._urls()
        prefill = await asyncio.gather(*(self._server_info_of(u) for u in prefill_urls))
        decode = await asyncio.gather(*(self._server_info_of(u) for u in decode_urls))
        states = [s for d in decode if isinstance(d, dict) for s in d.get("internal_states", []) or []]
        return web.json_response({"prefill": prefill, "decode": decode, "internal_states": states,
                                  "router": self.pd.state()})

    async def _flush(self, url: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with self.pd.session.post(f"{url}/flush_cache",
                                            timeout=aiohttp.ClientTimeout(total=FLUSH_TIMEOUT_S)) as r:
                await r.content.read(1 << 16)

    async def flush_cache(self, _request: web.Request) -> web.Response:
        prefill, decode = self._urls()
        await asyncio.gather(*(self._flush(u) for u in prefill + decode))
        return web.Response(text="ok")

    def add_routes(self, app: web.Application, admin_token: str | None) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_post("/flush_cache", guarded(self.flush_cache, admin_token))
