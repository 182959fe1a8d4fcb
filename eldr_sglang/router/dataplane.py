"""The Rust data plane and its drift feed (its settings: `router.config.plane_config`).

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
import logging

logger = logging.getLogger("eldr.router")

# the drift feed's drain period (the queue's length is config.DRIFT_QUEUE)
DRIFT_DRAIN_S = 0.25


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
