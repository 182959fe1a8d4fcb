"""Decode-routing policies of the simulator.

Every non-oracle policy is the Rust `Router` the real router runs (random, round_robin,
shortest_queue, power_of_two, eldr, locality, and `paged`: locality with --eldr-paged-experts C); the simulator only feeds it prefill signatures and
keeps its in-flight counts with `acquire`/`release`. The oracle routes by domain label and
exists for reference only: it is the one place labels enter the simulator, and they are
handed to it explicitly (see `make_policy`).

The simulator accepts any policy object with this protocol: `name`, `route(trace_request)
-> worker` (called when the request's prefill completes), `acquire(worker, tokens) -> lease`
(a lease with `release()`, called once when the request finishes) and `loads()`; and, if it
has one, `report_load(worker, running)` (the router service's /v1/loads poll, sim/cluster.py).
"""

from __future__ import annotations

import numpy as np



def _core():
    try:
        from eldr_sglang import _core
    except ImportError as exc:
        raise RuntimeError(
            "the Rust extension eldr_sglang._core is not built; run `maturin develop --release`"
        ) from exc
    return _core


# The Rust Router's policies (the one list, _core.POLICIES), plus the simulator's oracle; the
# baselines are the load balancers, the policies that do not route on counts. `paged` is the
# locality policy with the cache-aware cost (the router's --eldr-paged-experts C), C taken from
# the simulated workers' paged experts (ExecutionModel.offload_cache_experts).
BASELINES = tuple(p for p in _core().POLICIES if p not in _core().COUNTS_POLICIES)
POLICY_NAMES = BASELINES + _core().COUNTS_POLICIES + ("paged", "oracle")
# policies that take a bounded-load factor (name/F)
BOUNDED = ("eldr", "locality", "paged")
# policies with the locality cost, which takes a per-request term (name:rc=R)
LOCALITY = ("locality", "paged")


class RouterPolicy:
    """A Rust Router policy. For eldr, `signatures[r]` is trace request r's prefill signature."""

    uses_labels = False

    def __init__(
        self,
        name: str,
        num_workers: int,
        *,
        centroids: str | None = None,
        tau: float | None = None,
        seed: int = 0,
        signatures: np.ndarray | None = None,
        valid: np.ndarray | None = None,
        load_factor: float | None = None,
        profiles: list | None = None,
        paged_experts: int | None = None,
        request_cost: float | None = None,
    ):
        core = _core()
        self.name = name
        if name == "paged" and not paged_experts:
            raise ValueError("policy paged needs workers that page experts (--offload-experts C)")
        if name in ("locality", "paged") and profiles is None:
            raise ValueError(f"policy {name} needs the requests' expert profiles")
        self.profiles = profiles
        if name == "eldr":
            if centroids is None:
                raise ValueError("policy eldr needs a centroid file (--centroids)")
            if signatures is None:
                raise ValueError("policy eldr needs the requests' prefill signatures")
        self.router = core.Router(
            policy="locality" if name == "paged" else name,
            num_workers=num_workers,
            centroids=centroids if name == "eldr" else None,
            tau=tau if name == "eldr" else None,
            seed=seed,
            load_factor=load_factor if name in BOUNDED else None,
            paged_experts=paged_experts if name == "paged" else None,
            request_cost=request_cost,
        )
        if self.router.num_workers != num_workers:
            raise ValueError(
                f"centroid file has {self.router.num_workers} workers but the simulation has {num_workers}"
            )
        self.signatures = signatures
        self.valid = valid
        self.reasons: dict[str, int] = {}

    def route(self, trace_r: int) -> int:
        if self.name == "eldr":
            sig = self.signatures[trace_r] if self.valid is None or self.valid[trace_r] else None
            return int(self.router.route_signature(sig))
        if self.profiles is not None:
            self._last = trace_r
            return int(self.router.route_profile(self.profiles[trace_r]))
        return int(self.router.route_signature(None))

    def acquire(self, worker: int, tokens: int, trace_r: int | None = None):
        if self.profiles is not None:
            r = self._last if trace_r is None else trace_r
            return self.router.acquire(worker, tokens, profile=self.profiles[r])
        return self.router.acquire(worker, tokens)

    def report_load(self, worker: int, running: int) -> None:
        """A decode worker's /v1/loads answer, into the router's tracker as the service's poll does."""
        self.router.report_load(worker, running)

    def loads(self) -> list[int]:
        return list(self.router.loads())


class OraclePolicy:
    """Reference only: routes by the request's domain label.

    Workers are shared out among domains in proportion to their request counts (largest
    remainder, at least one each) when K >= D; with fewer workers than domains, domains are
    packed onto workers largest first (each to the least-loaded worker so far). A request
    goes to the shortest queue among its domain's workers (lowest index on ties). Queue
    counts live in a Rust shortest_queue Router like every other policy's."""

    uses_labels = True
    name = "oracle"

    def __init__(self, labels: np.ndarray, num_workers: int, seed: int = 0):
        core = _core()
        labels = np.asarray(labels).astype(str)
        names, codes = np.unique(labels, return_inverse=True)
        self.codes = codes
        D, K = len(names), num_workers
        freq = np.bincount(codes, minlength=D).astype(np.float64)
        order = np.argsort(-freq, kind="stable")
        cand: list[list[int]] = [[] for _ in range(D)]
        if K >= D:
            share = freq / freq.sum() * K
            n = np.maximum(1, np.floor(share).astype(int))
            while n.sum() > K:  # minimum-one rule overshot: take from the largest
                n[int(np.argmax(np.where(n > 1, n - share, -np.inf)))] -= 1
            rem = share - n
            while n.sum() < K:
                j = int(np.argmax(rem))
                n[j] += 1
                rem[j] -= 1
            w = 0
            for d in order:
                cand[d] = list(range(w, w + n[d]))
                w += n[d]
        else:
            load = np.zeros(K)
            for d in order:
                k = int(np.argmin(load))
                cand[d] = [k]
                load[k] += freq[d]
        self.candidates = [np.asarray(c, dtype=np.int64) for c in cand]
        self.router = core.Router(policy="shortest_queue", num_workers=K, seed=seed)

    def route(self, trace_r: int) -> int:
        cand = self.candidates[self.codes[trace_r]]
        if len(cand) == 1:
            return int(cand[0])
        loads = np.asarray(self.router.loads())[cand]
        return int(cand[int(np.argmin(loads))])

    def acquire(self, worker: int, tokens: int):
        return self.router.acquire(worker, tokens)

    def report_load(self, worker: int, running: int) -> None:
        self.router.report_load(worker, running)

    def loads(self) -> list[int]:
        return list(self.router.loads())


def make_policy(
    name: str,
    num_workers: int,
    *,
    replay=None,
    centroids: str | None = None,
    tau: float | None = None,
    seed: int = 0,
    labels: np.ndarray | None = None,
    signatures: tuple[np.ndarray, np.ndarray] | None = None,
    load_factor: float | None = None,
    profiles: list | None = None,
    paged_experts: int | None = None,
    request_cost: float | None = None,
):
    """Build a policy. Only 'oracle' takes `labels`; passing labels to any other policy is
    an error, so no baseline or ELDR can read them."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    if name == "oracle":
        if labels is None:
            raise ValueError("the oracle policy needs domain labels in the trace")
        return OraclePolicy(labels, num_workers, seed=seed)
    if labels is not None:
        raise ValueError(f"policy {name} must not be given labels")
    sig = valid = None
    if name == "eldr":
        if centroids is None:
            raise ValueError("policy eldr needs a centroid file (--centroids)")
        if signatures is None:
            signatures = eldr_signatures(replay, centroids)
        sig, valid = signatures
    if name in ("locality", "paged") and profiles is None:
        if replay is None:
            raise ValueError(f"policy {name} needs the trace (for its prompts' expert counts)")
        profiles = replay.expert_profiles()
    return RouterPolicy(name, num_workers, centroids=centroids, tau=tau if name == "eldr" else None, seed=seed,
                        signatures=sig, valid=valid, load_factor=load_factor,
                        profiles=profiles if name in LOCALITY else None, paged_experts=paged_experts,
                        request_cost=request_cost)


def eldr_signatures(replay, centroids: str) -> tuple[np.ndarray, np.ndarray]:
    """Prefill signatures of every trace request under the centroid file's SignatureSpec."""
    core = _core()
    cs = core.CentroidSet.open(str(centroids))
    if cs.num_layers != replay.num_layers or cs.num_experts != replay.num_experts:
        raise ValueError(
            f"centroid file {centroids} is for {cs.num_layers} layers x {cs.num_experts} experts, "
            f"the trace has {replay.num_layers} x {replay.num_experts}"
        )
    return replay.signatures(cs.spec())
