"""The Rust data plane (`--data-plane rust`): the request path in the extension's tokio/hyper
server, Python as the control plane.

The Rust server (`eldr_sglang._core.DataPlane`, crate rust/dataplane) listens on the public
port and serves /generate, /v1/completions and /v1/chat/completions itself: late binding,
failover, timeouts, outlier ejection, queue slots, the X-ELDR-* headers, as `router.pd` does.
It routes on the same core Router instance this process holds, so hot reload (the reload
thread's `maybe_reload`), load reports (/v1/loads polling) and the tracker's in-flight counts
are shared, not copied. Every other path (/health, /metrics, /eldr/*, /v1/models, ...) it
forwards to the aiohttp app of `router.app`, which runs here on an internal loopback port
and keeps the control plane: health checks (fed to the data plane with `set_healthy`), the
prefill signature probe, load polling, centroid hot reload and the admin endpoints. /metrics
reads the data plane's counters at scrape time (RustRequestMetrics): nothing runs in Python
per request.

The drift monitor (eldr_sglang.drift) gets every counts-policy decision, with its distances
and unit signature, from a bounded queue in the data plane that a background task here drains
a few times a second (`feed_drift`): off the request path, batched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from aiohttp import web

from eldr_sglang.router.config import COUNTS_POLICIES, ConfigError, RouterConfig
from eldr_sglang.router.metrics import RouterMetrics, RustRequestMetrics
from eldr_sglang.router.pd import PDRouter

logger = logging.getLogger("eldr.router")

# Tokio worker threads of the data plane: the machine this was measured on has 2 cores.
DATA_PLANE_THREADS = 2


def unsupported(cfg: RouterConfig) -> str | None:
    """Why the Rust data plane cannot serve this configuration (None: it can)."""
    for url in [w.url for w in cfg.prefill] + list(cfg.decode):
        if not url.startswith("http://"):
            return f"--data-plane rust speaks plain http:// to workers only, got {url}"
    return None


# Decisions the data plane queues for the drift monitor between two drains (the oldest are
# dropped past it, and counted); drained every DRIFT_DRAIN_S.
DRIFT_QUEUE = 8192
DRIFT_DRAIN_S = 0.25


def _drift_on(cfg: RouterConfig) -> bool:
    return bool(cfg.policy in COUNTS_POLICIES and cfg.centroids and (cfg.drift or {}).get("enabled", True))


def plane_config(cfg: RouterConfig, control_url: str) -> str:
    """The data plane's settings (rust/dataplane/src/config.rs), as JSON."""
    return json.dumps({
        "host": cfg.host, "port": cfg.port,
        "prefill": [{"url": w.url, "host": w.host, "bootstrap_port": w.bootstrap_port} for w in cfg.prefill],
        "decode": list(cfg.decode),
        "control_url": control_url,
        "policy": cfg.policy, "prefill_policy": cfg.prefill_policy, "late_binding": cfg.late_binding, "seed": cfg.seed,
        "signature_timeout_s": cfg.signature_timeout_s, "request_timeout_s": cfg.request_timeout_s,
        "connect_timeout_s": cfg.connect_timeout_s, "first_byte_timeout_s": cfg.first_byte_timeout_s,
        "stall_timeout_s": cfg.stall_timeout_s, "retries": cfg.retries,
        "eject_after_failures": cfg.eject_after_failures, "eject_base_s": cfg.eject_base_s, "eject_max_s": cfg.eject_max_s,
        "client_header_timeout_s": cfg.client_header_timeout_s, "client_body_timeout_s": cfg.client_body_timeout_s,
        "max_payload_size": cfg.max_payload_size, "explain_headers": cfg.explain_headers,
        "threads": DATA_PLANE_THREADS,
        "signature_reservoir": DRIFT_QUEUE if _drift_on(cfg) else 0,
        "max_concurrent_requests": cfg.max_concurrent_requests, "queue_size": cfg.queue_size,
        "queue_timeout_s": cfg.queue_timeout_s,
    })


class _DriftView:
    """One data-plane decision as DriftHook.on_route reads it."""

    __slots__ = ("generation", "reason", "distances", "_sig", "_dim")

    def __init__(self, generation: int, reason: str, distances, sig, dim: int):
        self.generation, self.reason, self.distances, self._sig, self._dim = generation, reason, distances, sig, dim

    def unit_signature(self):
        if self._sig is None:
            return None
        import numpy as np

        index, value, norm = self._sig
        out = np.zeros(self._dim, dtype=np.float32)
        out[index] = value / np.float32(norm)
        return out


async def feed_drift(pd: "RustPDRouter") -> None:
    """Drain the data plane's decision queue into the drift monitor, a batch at a time."""
    while True:
        await asyncio.sleep(DRIFT_DRAIN_S)
        try:
            pd.sync_drift()
        except Exception as exc:  # never let the feed die
            logger.error("drift feed failed: %s", exc)


class _SignsList(list):
    """PDRouter.prefill_signs whose writes (the /server_info probe) reach the data plane."""

    def __init__(self, pd: "RustPDRouter", items):
        super().__init__(items)
        self._pd = pd

    def __setitem__(self, i, v):
        super().__setitem__(i, v)
        if self._pd.dataplane is not None:
            self._pd.dataplane.set_prefill_signature(i, v)


class RustPDRouter(PDRouter):
    """The control plane's PDRouter when the Rust data plane serves requests: worker
    availability and the request-path metrics are the data plane's; the rest (the core
    Router, reload, load reports, drift state) is shared as it is."""

    def __init__(self, cfg: RouterConfig):
        why = unsupported(cfg)
        if why is not None:
            raise ConfigError(why)
        super().__init__(cfg)
        self.dataplane = None
        self._early_health: dict[tuple[str, int], bool] = {}
        self._drift_dims: dict[int, int] = {}  # centroid generation -> signature dim
        self.metrics = RouterMetrics(self.state, request_path=RustRequestMetrics(self._counters))
        self.prefill_signs = _SignsList(self, self.prefill_signs)

    def _counters(self) -> dict | None:
        return None if self.dataplane is None else self.dataplane.counters()

    def attach(self, control_url: str):
        """Build the data plane (not started), with what the control plane learnt so far."""
        from eldr_sglang import _core

        dp = _core.DataPlane(plane_config(self.cfg, control_url), self.router)
        for (role, i), ok in self._early_health.items():
            dp.set_healthy(role, i, ok)
        for i, signs in enumerate(self.prefill_signs):
            dp.set_prefill_signature(i, signs)
        self.dataplane = dp
        return dp

    def sync_drift(self) -> None:
        """Hand the drift monitor every decision the data plane made so far (the feed calls
        it periodically, the drift hook before it reports)."""
        hook, dp = self.drift, self.dataplane
        if hook is None or dp is None:
            return
        for gen, reason, distances, sig in dp.take_drift(DRIFT_QUEUE):
            dim = self._drift_dims.get(gen)
            if dim is None:
                cs = self.router.centroid_set()
                dim = self._drift_dims[gen] = cs.dim if cs is not None else 0
            hook.on_route(_DriftView(gen, reason, distances, sig, dim), None)

    def set_healthy(self, role: str, i: int, ok: bool) -> None:
        if self.dataplane is None:
            self._early_health[(role, i)] = ok
        else:
            self.dataplane.set_healthy(role, i, ok)

    def state(self) -> dict:
        s = super().state()
        dp = self.dataplane
        if dp is not None:
            pre, dec = dp.workers("prefill"), dp.workers("decode")
            s.update(prefill_inflight=[w["inflight"] for w in pre], prefill_workers=pre, decode_workers=dec,
                     prefill_healthy=dp.routable("prefill"), decode_healthy=dp.routable("decode"),
                     admission=dp.admission())
        s["data_plane"] = "rust"
        return s


async def serve(cfg: RouterConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Run the control plane on an internal loopback port and the Rust data plane on the
    public one, until `stop` is set (or SIGTERM/SIGINT)."""
    from eldr_sglang.router.app import PD_KEY, build_app

    pd = RustPDRouter(cfg)
    app = build_app(cfg, pd)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=cfg.client_header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    control_port = runner.addresses[0][1]
    dp = prom = drift_task = None
    try:
        dp = pd.attach(f"http://127.0.0.1:{control_port}")
        port = await asyncio.get_running_loop().run_in_executor(None, dp.start)
        if cfg.prometheus_port is not None:
            from prometheus_client import start_http_server

            prom = start_http_server(cfg.prometheus_port, cfg.prometheus_host or "127.0.0.1", registry=app[PD_KEY].metrics.registry)
        logger.info(
            "ELDR PD router on http://%s:%d (Rust data plane; control plane on 127.0.0.1:%d): %d prefill, %d decode, "
            "policy %s, %s binding", cfg.host, port, control_port, len(cfg.prefill), len(cfg.decode), cfg.policy,
            "late" if cfg.late_binding else "early",
        )
        drift_task = asyncio.ensure_future(feed_drift(pd)) if _drift_on(cfg) else None
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
    finally:
        if drift_task is not None:
            drift_task.cancel()
        if prom is not None:
            prom[0].shutdown()
        if dp is not None:
            await asyncio.get_running_loop().run_in_executor(None, dp.stop)
        await runner.cleanup()
