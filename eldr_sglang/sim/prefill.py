"""The prefill scheduler of the simulated cluster: which prefill worker takes a request, and
when its prefill is done (each worker runs its prefills one at a time, FIFO).

The placement policies are the router service's (`--prefill-policy`, round robin by default;
both from the Rust core: _core.PREFILL_POLICIES, _core.DEFAULT_PREFILL_POLICY) plus
`earliest_free`, which the simulator used before: the worker that frees up first, which a
router cannot know exactly.
"""

from __future__ import annotations

import heapq

import numpy as np

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
        self._inflight: list[list[float]] = [[] for _ in range(num_prefill)]  # done times not yet passed
        self._next = 0
        self._rng = np.random.default_rng(seed)
        self._prefill_time = prefill_time
        self._times: dict[int, float] = {}  # prompt length -> prefill time (the model is pure)

    def _pick(self, now: float) -> int:
        P = len(self.free_at)
        if self.policy == "earliest_free":
            return min(range(P), key=self.free_at.__getitem__)
        if self.policy == "round_robin":
            p, self._next = self._next, (self._next + 1) % P
            return p
        if self.policy == "random":
            return int(self._rng.integers(P))
        for q in self._inflight:  # shortest_queue: fewest unfinished prefills, ties to the lower index
            while q and q[0] <= now:
                heapq.heappop(q)
        return min(range(P), key=lambda i: (len(self._inflight[i]), i))

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
        if self.policy == "shortest_queue":
            heapq.heappush(self._inflight[p], done)
        return p, done
