"""The Rust data plane's settings and its drift feed.

The request path runs in the extension's tokio/hyper server (`eldr_sglang._core.DataPlane`,
crate rust/dataplane): it listens on the public port and serves /generate, /v1/completions
and /v1/chat/completions itself: request validation, late binding, failover, timeouts,
outlier ejection, queue slots, the X-ELDR-* headers. It routes on the core Router the control
plane holds (`router.control`), so hot reload, load reports and the tracker's in-flight counts
are shared, not copied. Every other path (/health, /metrics, /eldr/*, /v1/models, ...) it
forwards to the control plane's aiohttp app (`router.app`) on an internal loopback port.

The drift monitor (eldr_sglang.drift) gets every counts-policy decision, with its distances,
from a bounded queue in the data plane that a background task drains a few times a second
(`feed_drift`): off the request path, batched. The refit reservoir's keep/slot draw is the
data plane's (rust/dataplane/src/reservoir.rs), made before each request is routed, so a
decision carries its unit signature only when the reservoir stores it (`DriftView.offer`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import TYPE_CHECKING

from eldr_sglang import _core

if TYPE_CHECKING:  # router.config checks its settings with plane_config: no import back
    from eldr_sglang.router.config import RouterConfig

logger = logging.getLogger("eldr.router")

# the control URL of a data plane that is built but never started (an in-process app in tests,
# the config check)
UNSTARTED_CONTROL_URL = "http://127.0.0.1:9"

# Tokio worker threads of the data plane: the machine this was measured on has 2 cores.
DATA_PLANE_THREADS = 2


# Decisions the data plane queues for the drift monitor between two drains (the oldest are
# dropped past it, and counted); drained every DRIFT_DRAIN_S.
DRIFT_QUEUE = 8192
DRIFT_DRAIN_S = 0.25


def drift_on(cfg: RouterConfig) -> bool:
    return bool(cfg.policy in _core.COUNTS_POLICIES and cfg.centroids and (cfg.drift or {}).get("enabled", True))


def reservoir_config(cfg: RouterConfig) -> dict | None:
    """The refit reservoir's shape for the data plane's draw, from the same drift options
    the drift hook builds its reservoir from; None when drift is off or the options are
    not a reservoir (the hook then refuses them and says why)."""
    from eldr_sglang.drift.reservoir import DEFAULT_CAPACITY, DEFAULT_HORIZON, reservoir_shape

    if not drift_on(cfg):
        return None
    conf = cfg.drift or {}
    try:
        per_bucket, span = reservoir_shape(conf.get("reservoir_capacity", DEFAULT_CAPACITY),
                                           conf.get("reservoir_horizon", DEFAULT_HORIZON))
    except (TypeError, ValueError):
        return None
    return {"per_bucket": per_bucket, "span": span}


def plane_config(cfg: RouterConfig, control_url: str) -> str:
    """The data plane's settings (rust/dataplane/src/config.rs, which checks them), as JSON;
    a NaN or infinite float as the string "nan", "inf" or "-inf" (JSON has none)."""
    return json.dumps(_finite_or_named({
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
        "signature_reservoir": DRIFT_QUEUE if reservoir_config(cfg) else 0,
        "reservoir": reservoir_config(cfg),
        "max_concurrent_requests": cfg.max_concurrent_requests, "queue_size": cfg.queue_size,
        "queue_timeout_s": cfg.queue_timeout_s,
        "experiment": experiment_config(cfg),
    }))


def _finite_or_named(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # 'nan', 'inf', '-inf'
    if isinstance(v, dict):
        return {k: _finite_or_named(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite_or_named(x) for x in v]
    return v


def experiment_config(cfg: RouterConfig) -> dict | None:
    """The switchback experiment for the data plane (rust/dataplane/src/experiment.rs): each
    arm with its binding (late for the counts policies under --eldr-bind auto)."""
    x = cfg.experiment
    if x is None:
        return None
    return {"arms": [{"label": a.label, "policy": a.policy, "load_factor": a.load_factor, "late_binding": cfg.binds_late(a.policy)}
                     for a in x.arms],
            "switch_every_s": x.switch_every_s, "seed": x.seed}


class DriftView:
    """One data-plane decision as DriftHook.on_route reads it. `offer`: the refit
    reservoir's draw for it, (offer index, slot or None: not stored), or None when the
    decision is not an offer (no distances: a fallback)."""

    __slots__ = ("generation", "reason", "distances", "_sig", "_dim", "offer")

    def __init__(self, generation: int, reason: str, distances, sig, dim: int, offer=None):
        self.generation, self.reason, self.distances, self._sig, self._dim = generation, reason, distances, sig, dim
        self.offer = offer

    def unit_signature(self):
        if self._sig is None:
            return None
        import numpy as np

        index, value, norm = self._sig
        out = np.zeros(self._dim, dtype=np.float32)
        out[index] = (value.astype(np.float64) / norm).astype(np.float32)  # as SparseSignature::write_unit: f64, then rounded
        return out


async def feed_drift(pd) -> None:
    """Drain the data plane's decision queue into the drift monitor (`pd`: the
    ControlPlane), a batch at a time."""
    while True:
        await asyncio.sleep(DRIFT_DRAIN_S)
        try:
            pd.sync_drift()
        except Exception as exc:  # never let the feed die
            logger.error("drift feed failed: %s", exc)
