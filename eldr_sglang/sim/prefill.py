"""The prefill scheduler of the simulated cluster: which prefill worker takes a request, and
when its prefill is done (each worker runs its prefills one at a time, FIFO).

The placement policies are the router service's (`--prefill-policy`, round robin by default),
run by the Rust core as the data plane runs them: a core Router over the prefill workers, each
placement held (a lease) until its prefill completes, so shortest_queue counts unfinished
prefills (_core.PREFILL_POLICIES, _core.DEFAULT_PREFILL_POLICY). Plus `earliest_free`, which
the simulator used before: the worker that frees up first, which a router cannot know exactly.
"""

from __future__ import annotations

import heapq

from eldr_sglang import _core

PREFILL_POLICIES = _core.PREFILL_POLICIES + ("earliest_free",)
DEFAULT_PREFILL_POLICY = _core.DEFAULT_PREFILL_POLICY  # what the router service does by default


class PrefillScheduler:
    def __init__(self, num_prefill: int, prefill_time, policy: str = DEFAULT_PREFILL_POLICY, seed: int = 0):
        if policy not in PREFILL_POLICIES:
            raise ValueError(f"unknown prefill policy {policy!r}; choose from {', '.join(PREFILL_POLICIES)}")
        if num_prefill < 1:
            raise ValueError("need at least one prefill worker")
        self.policy = policy
        self.free_at = [0.0] * num_prefill  # when each worker's queue drains
        # the core's placement (None: earliest_free, the simulator's own); its in-flight counts
        # are the placements whose prefill has not completed: (done time, order, lease)
        self._router = None if policy == "earliest_free" else _core.Router(
            policy=policy, num_workers=num_prefill, seed=seed, reload_interval_ms=0)
        self._held: list[tuple[float, int, _core.Lease]] = []
        self._placed = 0
        self._prefill_time = prefill_time
        self._times: dict[int, float] = {}  # prompt length -> prefill time (the model is pure)

    def _pick(self, now: float) -> int:
        if self._router is None:
            return min(range(len(self.free_at)), key=self.free_at.__getitem__)
        while self._held and self._held[0][0] <= now:  # prefills done by now leave the counts
            heapq.heappop(self._held)[2].release()
        return self._router.route_signature(None)

    def place(self, now: float, prompt_len: int, pt: float | None = None) -> tuple[int, float]:
        """(worker, time the prefill completes) for a request arriving at `now`; `pt` is its
        prefill time when the caller knows it per request (else the model's, by length)."""
        p = self._pick(now)
        if pt is None:
            pt = self._times.get(prompt_len)
        if pt is None:
            pt = self._times[prompt_len] = self._prefill_time(prompt_len)
        done = max(now, self.free_at[p]) + pt
        self.free_at[p] = done
        if self._router is not None:
            self._placed += 1
            heapq.heappush(self._held, (done, self._placed, self._router.acquire(p)))
        return p, done
