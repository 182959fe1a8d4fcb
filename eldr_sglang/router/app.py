"""The aiohttp application of the PD router and its runner."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from eldr_sglang.router.config import COUNTS_POLICIES, RouterConfig
from eldr_sglang.router.loads import (
    check_health,
    poll_loads,
    probe_prefill_signature,
    reload_centroids,
    wait_for_workers,
)
from eldr_sglang.router.passthrough import WorkerPassthrough
from eldr_sglang.router.pd import ENDPOINTS, PDRouter

logger = logging.getLogger("eldr.router")
PD_KEY = web.AppKey("pd", PDRouter)


def build_app(cfg: RouterConfig, pd: PDRouter | None = None) -> web.Application:
    pd = pd or PDRouter(cfg)
    app = web.Application(client_max_size=cfg.max_payload_size)
    app[PD_KEY] = pd
    for path in ENDPOINTS:
        app.router.add_post(path, pd.handle)

    async def health(_):
        return web.Response(text="ok")

    async def metrics(_):
        return web.Response(body=pd.metrics.render(), content_type="text/plain", charset="utf-8")

    async def status(_):
        return web.json_response(pd.state())

    if cfg.policy in COUNTS_POLICIES and cfg.centroids:
        # drift monitor + online refits (eldr_sglang.drift): GET /eldr/drift, POST /eldr/refit
        from eldr_sglang.drift.router_hook import install as install_drift

        install_drift(app, pd, admin_token=cfg.admin_token)

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/eldr/status", status)
    WorkerPassthrough(pd).add_routes(app, cfg.admin_token)
    app.cleanup_ctx.append(lambda _app: _lifecycle(pd, cfg))
    return app


async def _lifecycle(pd: PDRouter, cfg: RouterConfig):
    """Start-up (upstream session, waiting for workers, probing which prefills stream a
    signature) and the background loops (loads, health, hot reload); their teardown."""
    await pd.start()
    if cfg.worker_startup_timeout_s > 0:
        await wait_for_workers(pd, cfg.worker_startup_timeout_s)
    if cfg.late_binding:
        await asyncio.gather(*(probe_prefill_signature(pd, i) for i in range(len(cfg.prefill))))
    loops = []
    if cfg.load_monitor_interval_s > 0:
        loops.append(poll_loads(pd, cfg.load_monitor_interval_s))
    if cfg.health_check_interval_s > 0:
        loops.append(check_health(pd, cfg.health_check_interval_s, cfg.health_failure_threshold))
    if cfg.centroids and cfg.reload_interval_ms > 0:
        loops.append(reload_centroids(pd, cfg.reload_interval_ms / 1000.0))
    tasks = [asyncio.ensure_future(c) for c in loops]
    yield
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await pd.close()


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set (or forever): the request path in the Rust data plane, this
    process keeps the control plane."""
    from eldr_sglang.router.dataplane import serve as serve_rust

    return await serve_rust(cfg, ready, stop)
