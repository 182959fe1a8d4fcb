"""The router service: the control plane's aiohttp app, and the runner that starts it on an
internal loopback port with the Rust data plane on the public one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import AsyncIterator

from aiohttp import web

from eldr_sglang.router.config import COUNTS_POLICIES, RouterConfig
from eldr_sglang.router.control import ControlPlane
from eldr_sglang.router.dataplane import feed_drift
from eldr_sglang.router.loads import WorkerPollers, probe_prefill_signature, reload_centroids, wait_for_workers
from eldr_sglang.router.passthrough import WorkerPassthrough

logger = logging.getLogger("eldr.router")
PD_KEY = web.AppKey("pd", ControlPlane)


def build_app(cfg: RouterConfig, pd: ControlPlane | None = None) -> web.Application:
    """The control plane's app: every path the data plane does not serve itself."""
    pd = pd or ControlPlane(cfg)
    app = web.Application(client_max_size=cfg.max_payload_size)
    app[PD_KEY] = pd

    async def health(_):
        return web.Response(text="ok")

    async def metrics(_):
        return web.Response(body=pd.metrics.render(), content_type="text/plain", charset="utf-8")

    async def status(_):
        return web.json_response(pd.state())

    if cfg.policy in COUNTS_POLICIES and cfg.centroids:
        # drift monitor + online refits (eldr_sglang.drift): GET /eldr/drift, POST /eldr/refit
        from eldr_sglang.router.drift_hook import install as install_drift

        install_drift(app, pd, admin_token=cfg.admin_token)

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/eldr/status", status)
    if cfg.experiment is not None:
        add_experiment_routes(app, pd, cfg.admin_token)
    applier = None
    if pd.membership is not None:  # live membership: the applier and POST/DELETE /eldr/workers
        from eldr_sglang.router.discovery.apply import MembershipApplier
        from eldr_sglang.router.discovery.endpoints import add_worker_routes

        applier = MembershipApplier(pd.membership, pd)
        add_worker_routes(app, pd, applier, cfg.admin_token)
    WorkerPassthrough(pd).add_routes(app, cfg.admin_token)
    app.cleanup_ctx.append(lambda _app: _lifecycle(pd, cfg, applier))
    return app


def add_experiment_routes(app: web.Application, pd: ControlPlane, admin_token: str | None) -> None:
    """GET /eldr/experiment: every block's statistics (read by `eldr experiment report
    --url`); POST /eldr/experiment/switch: end the block now, optionally {"arm": LABEL}
    (a control endpoint: the admin token guards it)."""
    from eldr_sglang.router.admin import guarded

    async def experiment(_):
        return web.json_response(pd.experiment(blocks=True))

    async def switch(request: web.Request):
        arm = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return web.json_response({"error": {"message": "the body must be JSON: {} or {\"arm\": LABEL}"}}, status=400)
            except RecursionError:
                return web.json_response({"error": {"message": "the body is nested too deeply: {} or {\"arm\": LABEL}"}},
                                         status=400)
            if not isinstance(body, dict) or not isinstance(body.get("arm", ""), (str, type(None))):
                return web.json_response({"error": {"message": "the body must be {} or {\"arm\": LABEL}"}}, status=400)
            arm = body.get("arm")
        try:
            block, label = pd.dataplane.experiment_switch(arm)
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        logger.info("experiment: switched to block %d, arm %s (admin call)", block, label)
        return web.json_response({"block": block, "arm": label})

    app.router.add_get("/eldr/experiment", experiment)
    app.router.add_post("/eldr/experiment/switch", guarded(switch, admin_token))


async def _lifecycle(pd: ControlPlane, cfg: RouterConfig, applier=None):
    """Start-up (the control plane's upstream session, waiting for workers, probing which
    prefills stream a signature) and the background loops (per worker: loads and health, which
    follow membership; hot reload, the drift feed, the membership applier); their teardown."""
    await pd.start()
    if cfg.worker_startup_timeout_s > 0:
        await wait_for_workers(pd, cfg.worker_startup_timeout_s)
    if cfg.late_binding:
        await asyncio.gather(*(probe_prefill_signature(pd, i, u) for i, u in pd.members("prefill")))
    pd.pollers = WorkerPollers(pd)
    for role in ("prefill", "decode"):
        for slot, url in pd.members(role):
            pd.pollers.start(role, slot, url, probe=False)
    if applier is not None:  # after the pollers: it starts and stops theirs
        applier.hook.apply_cb = applier.request
        applier.start()
    loops = []
    if cfg.centroids and cfg.reload_interval_ms > 0:
        loops.append(reload_centroids(pd, cfg.reload_interval_ms / 1000.0))
    if pd.drift is not None:
        loops.append(feed_drift(pd))
    tasks = [asyncio.ensure_future(c) for c in loops]
    yield
    if applier is not None:
        await applier.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await pd.pollers.close()
    await pd.close()


@contextlib.asynccontextmanager
async def running(cfg: RouterConfig) -> AsyncIterator[tuple[web.Application, str]]:
    """The router, serving in this process until the block ends: (the control app, the
    public base URL). It is built with the first membership (the command line's workers, with
    a discovery source's: --workers-file, --service-discovery), and the sources keep running
    beside it: each later membership is applied live (discovery/apply.py), and so are the
    admin's POST/DELETE /eldr/workers."""
    from eldr_sglang.router.discovery.hook import discovered

    async with discovered(cfg) as (cfg, hook):
        async with _serving(cfg, hook) as (app, url):
            yield app, url


@contextlib.asynccontextmanager
async def _serving(cfg: RouterConfig, hook=None) -> AsyncIterator[tuple[web.Application, str]]:
    """The router on its workers. The control plane's socket is bound first, so the data plane
    is built knowing where to forward, and the start-up checks report straight into it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    control_port = sock.getsockname()[1]
    try:
        pd = ControlPlane(cfg, f"http://127.0.0.1:{control_port}")
        pd.membership = hook
        app = build_app(cfg, pd)
    except BaseException:
        sock.close()
        raise
    # keepalive_timeout doubles as the request-head timeout: aiohttp arms it when a
    # connection opens and closes one that has no complete request head by then.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=cfg.client_header_timeout_s)
    prom = None
    started = False
    try:
        await runner.setup()  # the lifecycle's start-up runs here
        await web.SockSite(runner, sock, backlog=1024).start()
        loop = asyncio.get_running_loop()
        port = await loop.run_in_executor(None, pd.dataplane.start)
        started = True
        if cfg.prometheus_port is not None:
            from prometheus_client import start_http_server

            prom = start_http_server(cfg.prometheus_port, cfg.prometheus_host or "127.0.0.1", registry=pd.metrics.registry)
        logger.info(
            "ELDR PD router on http://%s:%d (Rust data plane; control plane on 127.0.0.1:%d): %d prefill, %d decode, "
            "policy %s, %s binding", cfg.host, port, control_port, len(cfg.prefill), len(cfg.decode),
            _policy_line(cfg), "late" if cfg.late_binding else "early",
        )
        yield app, f"http://{cfg.host}:{port}"
    finally:
        if prom is not None:
            prom[0].shutdown()
        if started:
            await asyncio.get_running_loop().run_in_executor(None, pd.dataplane.stop)
        await runner.cleanup()
        sock.close()


def _policy_line(cfg: RouterConfig) -> str:
    x = cfg.experiment
    if x is None:
        return cfg.policy
    return f"switchback experiment over {', '.join(a.label for a in x.arms)} every {x.switch_every_s:g} s (seed {x.seed})"


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set (or SIGTERM/SIGINT: a clean shut-down)."""
    async with running(cfg):
        if ready is not None:
            ready.set()
        if stop is None:
            import signal

            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, stop.set)
        await stop.wait()
