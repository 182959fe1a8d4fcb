"""Router replicas in front of one simulated cluster (issue 32).

Users run several router replicas; clients reach one of them at random. Each replica is its
own Rust `Router` with its own in-flight counts and, under the locality balancer, its own view
of which experts each decode worker's batch is using. Two ways a replica learns of the others'
requests:

- `own_view`: today's service. Each replica reads every decode worker's /v1/loads count each
  load-monitor interval (`report_load`: the fresh count, minus this replica's share at poll
  time, plus its own requests since), but its expert view holds only its own requests.
- `leases`: the first study's model of worker reports (issue 32's proposal, before the
  service had them). At each poll every replica replaces its picture of the other replicas' requests
  on that worker with the worker's current set: it holds one lease per such request, with the
  request's expert profile, until the next poll. Between polls the picture goes stale exactly
  as a report would (finished requests linger, new ones are missing).
- `no_polls`: the service with `--load-monitor-interval 0`: no replica reads the workers'
  loads, so each bounds and balances its own share of the traffic alone.
- `leases_projected`: `leases`, plus a projection of the other replicas'
  arrivals between polls. Each request a replica routes to a worker also counts R - 1
  load-only leases there (no expert profile: the others' requests' experts are unknown), as if
  every other replica sent its share where this one did; the next poll of that worker drops
  them (its report then shows the others' real requests). With R = 1 it is `leases`.
- `leases_mirrored`: as `leases_projected`, but the R - 1 load-only leases also
  end when the request that brought them finishes (before the next poll if it comes first): the
  others' requests are assumed to leave as this replica's own do, not only to arrive.

- `own_view_replicas`: the service with `--router-replicas R` on every replica: `own_view`,
  and each replica's Rust tracker projects R - 1 requests of the others per request it sends,
  until that worker's next report or the request's end (rust/core/src/queue.rs,
  `set_replicas`), and the locality state counts R - 1 mirror images of its experts
  (policies/locality.rs), without worker reports.
- `worker_reports_no_replicas_flag`: the service as built (issue 32), without
  `--router-replicas`: `own_view`'s load polls, and at each poll every worker's occupancy
  report from its requests' profiles (all replicas', summed as the worker does:
  sglang_ext/profile_occupancy.py), blended by each replica's core as the service blends it
  (`Router.report_occupancy`: the report, never below the replica's own use, plus its
  requests since).
- `worker_reports`: the service as built and documented for R replicas: the same reports, and
  `--router-replicas R` on every replica (load projection and expert mirror images until the
  worker's next report).

The wrapper speaks the simulator's policy protocol (sim/policies.py): `route`, `acquire`
(right after `route`, for the same request), `report_load`, `loads`.
"""

from __future__ import annotations

import json
import math
from typing import Callable

import numpy as np

from eldr_sglang.sglang_ext.profile_occupancy import ProfileOccupancy

MODES = ("own_view", "leases", "no_polls", "leases_projected",
         "leases_mirrored", "leases_own_cap", "own_view_replicas",
         "worker_reports_no_replicas_flag", "worker_reports")
SERVICE = ("worker_reports_no_replicas_flag", "worker_reports")  # modes with the service's occupancy reports
PROJECTED = ("leases_projected", "leases_mirrored")  # modes with load-only leases


class _Lease:
    """One request's lease on the replica that routed it, known to the wrapper until release."""

    __slots__ = ("owner", "replica", "worker", "tokens", "trace_r", "inner", "mirrors")

    def __init__(self, owner: Replicas, replica: int, worker: int, tokens: int, trace_r: int, inner):
        self.owner, self.replica, self.worker, self.tokens, self.trace_r, self.inner = owner, replica, worker, tokens, trace_r, inner
        self.mirrors: list = []  # leases_mirrored: the load-only leases that end with this one

    def release(self) -> None:
        if self.inner is not None:
            self.inner.release()
            self.inner = None
            for m in self.mirrors:
                m.release()  # a no-op for one the poll already dropped
            self.mirrors = []
            self.owner.held[self.worker].pop(self, None)
            self.owner.own[self.replica][self.worker] -= 1


class Replicas:
    def __init__(self, make: Callable[[int], object], replicas: int, num_workers: int, *, mode: str = "own_view",
                 seed: int = 0):
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.reps = [make(k) for k in range(replicas)]
        self.name = self.reps[0].name
        self.mode = mode
        self.rng = np.random.default_rng(seed)
        self.held: list[dict] = [{} for _ in range(num_workers)]  # every replica's leases, per worker
        self.pictures: list[list[list]] = [[[] for _ in range(num_workers)] for _ in range(replicas)]
        self.projected: list[list[list]] = [[[] for _ in range(num_workers)] for _ in range(replicas)]
        self.own = [[0] * num_workers for _ in range(replicas)]  # each replica's own in-flight requests
        self._last = (0, 0)
        # leases_own_cap: the bounded policies' load factors, their Routers' caps off
        self.own_cap: list = [None] * replicas
        if mode in ("own_view_replicas", "worker_reports"):
            for rep in self.reps:
                rep.router.replicas = replicas
        self._wire: dict[int, tuple] = {}  # a request's profile as sent to its worker, parsed once
        if mode == "leases_own_cap":
            for k, rep in enumerate(self.reps):
                self.own_cap[k], rep.router.load_factor = rep.router.load_factor, None

    def route(self, trace_r: int) -> int:
        k = int(self.rng.integers(len(self.reps)))  # the client's replica
        self._last = (k, trace_r)
        f = self.own_cap[k]
        if f is None:
            return self.reps[k].route(trace_r)
        own, router = self.own[k], self.reps[k].router
        cap = math.ceil((1.0 + f) * (sum(own) + 1) / len(own))  # the core's load_cap, on own loads
        over = [w for w, n in enumerate(own) if n >= cap]  # never all: the least loaded is under
        for w in over:
            router.set_healthy(w, False)
        try:
            return self.reps[k].route(trace_r)
        finally:
            for w in over:
                router.set_healthy(w, True)

    def acquire(self, worker: int, tokens: int) -> _Lease:
        k, trace_r = self._last
        lease = _Lease(self, k, worker, tokens, trace_r, self.reps[k].acquire(worker, tokens, trace_r=trace_r))
        self.held[worker][lease] = None
        self.own[k][worker] += 1
        if self.mode in PROJECTED:
            router = self.reps[k].router  # a load-only lease: Router.acquire without a profile
            extra = [router.acquire(worker, tokens) for _ in range(len(self.reps) - 1)]
            self.projected[k][worker] += extra
            if self.mode == "leases_mirrored":
                lease.mirrors = extra
        return lease

    def report_load(self, worker: int, running: int) -> None:
        """A poll of decode worker `worker`: its load, and in `leases` its occupancy."""
        if self.mode == "no_polls":
            return
        if self.mode in ("own_view", "own_view_replicas", *SERVICE):
            for rep in self.reps:
                rep.report_load(worker, running)
            if self.mode in SERVICE:
                self._report_occupancy(worker)
            return
        for k, rep in enumerate(self.reps):
            for old in self.pictures[k][worker] + self.projected[k][worker]:
                old.release()
            self.projected[k][worker] = []
            self.pictures[k][worker] = [rep.acquire(worker, x.tokens, trace_r=x.trace_r)
                                        for x in self.held[worker] if x.replica != k]

    def _report_occupancy(self, worker: int) -> None:
        """Worker `worker`'s occupancy report, from every replica's requests held there."""
        rep0 = self.reps[0]
        layout = rep0.router.occupancy_layout()
        if layout is None or getattr(rep0, "profiles", None) is None:
            return
        occ = ProfileOccupancy()
        for x in self.held[worker]:
            wire = self._wire.get(x.trace_r)
            if wire is None:
                wire = self._wire[x.trace_r] = json.loads(rep0.profiles[x.trace_r].to_wire_json())
            occ.add(wire)
        layers, experts = layout
        rep = occ.report(",".join(map(str, layers)))["eldr_occupancy"]
        idle = np.ones(len(layers) * experts) if rep["idle"] is None else np.asarray(rep["idle"], dtype=np.float64).ravel()
        for r in self.reps:
            snap = r.router.occupancy_snapshot(worker)
            if snap is not None:
                r.router.report_occupancy(snap, idle)

    def loads(self) -> list[int]:
        return self.reps[0].loads()
