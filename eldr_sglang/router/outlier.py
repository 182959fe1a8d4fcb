"""Per-worker availability: health checks plus outlier ejection, for prefill and decode alike.

A worker is routable while its health check passes and its circuit is not open. The health
check alone is not enough: a hung worker's /health may still answer. So every request's
outcome also counts (Envoy's outlier detection, the SGLang gateway's circuit breaker):

- closed: routable; `consecutive` counts failures (5xx, timeouts, connect and stream errors)
  since the last success;
- open (ejected): after `threshold` failures in a row; for `base_s * 2**(n-1)` seconds
  (n = ejections since the last full recovery, capped at `max_s`);
- half-open (probation): when the ejection ends the worker gets exactly one trial request;
  success closes the circuit (and resets the back-off), failure opens it again for longer.

At most half the workers of a role (rounded up) are ejected at a time, and never the last
routable one (Envoy's max_ejection_percent): when failures are everywhere (an overload, a
shared dependency down) ejecting more would only pile the load onto fewer workers, and
clients get the failures' errors rather than a blanket 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger("eldr.router")

CLOSED, OPEN, HALF_OPEN, TRIAL = "closed", "open", "half_open", "trial"


@dataclass
class WorkerState:
    url: str
    health_ok: bool = True
    circuit: str = CLOSED
    consecutive: int = 0
    ejections: int = 0  # since the last full recovery: the back-off exponent
    ejected_total: int = 0
    ejected_until: float = 0.0
    inflight: int = 0
    last_failure: str | None = None
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class WorkerPool:
    """Availability of one role's workers. `on_change(i, routable)` mirrors it (decode: into
    the Rust router's health flags); `metrics` gets ejection and trial counts."""

    def __init__(self, role: str, urls: list[str], *, threshold: int, base_s: float, max_s: float,
                 on_change: Callable[[int, bool], None] | None = None, metrics=None):
        self.role = role
        self.workers = [WorkerState(u) for u in urls]
        self.threshold, self.base_s, self.max_s = threshold, base_s, max_s
        self._on_change = on_change
        self._metrics = metrics
        self._routable = [True] * len(urls)

    def __len__(self) -> int:
        return len(self.workers)

    # ---------------------------------------------------------------- queries
    def routable(self, i: int) -> bool:
        w = self.workers[i]
        return w.health_ok and w.circuit in (CLOSED, HALF_OPEN)

    def candidates(self) -> list[int]:
        return [i for i in range(len(self.workers)) if self.routable(i)]

    def state(self) -> list[dict]:
        now = time.monotonic()
        return [{"url": w.url, "health_ok": w.health_ok, "circuit": w.circuit, "consecutive_failures": w.consecutive,
                 "ejections": w.ejected_total, "ejected_for_s": round(max(0.0, w.ejected_until - now), 3)
                 if w.circuit == OPEN else 0.0, "last_failure": w.last_failure, "inflight": w.inflight}
                for w in self.workers]

    # ---------------------------------------------------------------- outcomes
    def dispatched(self, i: int) -> None:
        """A request is sent to worker i: a half-open worker's one trial is now out."""
        w = self.workers[i]
        w.inflight += 1
        if w.circuit == HALF_OPEN:
            w.circuit = TRIAL
            if self._metrics is not None:
                self._metrics.probation_trials.labels(self.role, str(i)).inc()
            self._sync(i)

    def finished(self, i: int) -> None:
        self.workers[i].inflight -= 1

    def success(self, i: int) -> None:
        w = self.workers[i]
        w.consecutive = 0
        if w.circuit in (TRIAL, HALF_OPEN):
            logger.warning("%s worker %d (%s) passed its probation: back in rotation", self.role, i, w.url)
            w.circuit, w.ejections = CLOSED, 0
            self._sync(i)

    def failure(self, i: int, kind: str) -> None:
        w = self.workers[i]
        w.consecutive += 1
        w.last_failure = kind
        if w.circuit in (TRIAL, HALF_OPEN):
            self._eject(i, f"probation request failed ({kind})")
        elif w.circuit == CLOSED and w.consecutive >= self.threshold:
            if sum(self.routable(j) for j in range(len(self.workers)) if j != i) == 0:
                return  # never eject the last routable worker
            if sum(x.circuit != CLOSED for x in self.workers) >= (len(self.workers) + 1) // 2:
                return  # at most half of them (rounded up) out at once
            self._eject(i, f"{w.consecutive} consecutive failures, last: {kind}")

    def abandoned(self, i: int) -> None:
        """The request ended without a verdict on the worker (client gone): free a trial slot."""
        w = self.workers[i]
        if w.circuit == TRIAL:
            w.circuit = HALF_OPEN
            self._sync(i)

    def set_health(self, i: int, ok: bool) -> None:
        w = self.workers[i]
        if w.health_ok != ok:
            logger.warning("%s worker %d (%s) health check: %s", self.role, i, w.url, "passing" if ok else "FAILING")
        w.health_ok = ok
        self._sync(i)

    # ---------------------------------------------------------------- internals
    def _eject(self, i: int, why: str) -> None:
        w = self.workers[i]
        w.ejections += 1
        w.ejected_total += 1
        secs = min(self.max_s, self.base_s * 2 ** (w.ejections - 1))
        w.circuit = OPEN
        w.ejected_until = time.monotonic() + secs
        logger.warning("%s worker %d (%s) ejected for %.1f s: %s", self.role, i, w.url, secs, why)
        if self._metrics is not None:
            self._metrics.ejections.labels(self.role, str(i)).inc()
        if w._timer is not None:
            w._timer.cancel()
        try:
            w._timer = asyncio.get_running_loop().call_later(secs, self._probation, i)
        except RuntimeError:  # no loop (unit use): probation starts on the next query
            w._timer = None
        self._sync(i)

    def _probation(self, i: int) -> None:
        w = self.workers[i]
        w._timer = None
        if w.circuit == OPEN:
            w.circuit = HALF_OPEN
            logger.info("%s worker %d (%s) on probation: one trial request", self.role, i, w.url)
            self._sync(i)

    def _sync(self, i: int) -> None:
        ok = self.routable(i)
        if ok != self._routable[i]:
            self._routable[i] = ok
            if self._on_change is not None:
                self._on_change(i, ok)

    def close(self) -> None:
        for w in self.workers:
            if w._timer is not None:
                w._timer.cancel()
                w._timer = None


class RetryBudget:
    """Re-sends allowed only while few are under way, as Envoy's retry budget (20% of active
    requests there too): when a whole role is slow (an overload) retries would multiply the
    load instead of routing around a fault. The floor is 10 concurrent re-sends, not Envoy's
    3: a hung worker's requests all time out together, and each of them deserves its retry."""

    def __init__(self, fraction: float = 0.2, minimum: int = 10):
        self.fraction, self.minimum = fraction, minimum
        self.active = 0  # client requests being served
        self.retrying = 0  # re-sends under way

    def allows(self) -> bool:
        return self.retrying < max(self.minimum, self.fraction * self.active)
