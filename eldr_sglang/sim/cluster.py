"""Discrete-event simulation of a PD-disaggregated cluster: the event loop.

The parts are kept apart as in Vidur: the prefill scheduler (prefill.py), the decode
replicas' schedulers and step timing (decode.py), the execution-time model (cost_model.py)
and the workload (workload.py); this module only moves requests between them in time.

- Requests arrive (open loop) or are sent by closed-loop clients (workload.py).
- P prefill workers, FIFO, each prefill timed by the execution model's compute roofline;
  `ClusterConfig.prefill_policy` places a request as the router service would (round
  robin by default; `earliest_free` is the worker that frees up first).
- Late binding: when prefill completes, the routing policy (the Rust Router) picks the
  decode worker from the request's prefill signature; the router's in-flight count is
  acquired then and released when the request's last token is out. The KV cache then
  travels to the decode worker (kv_transfer_time).
- K decode workers with continuous batching: between steps a worker admits ready requests
  in FIFO order while it has fewer than `max_running` running and the KV reservation
  (prompt + output tokens) fits its KV capacity. Each step emits one token per running
  request and lasts `decode_step_time(batch, kv_tokens, distinct experts per MoE layer)`,
  the distinct experts counted from the real decode-token routing of the batch.
- The first output token is produced by prefill and streamed once the request joins a
  decode batch (TTFT); an n-token request then takes n-1 decode steps.
- Load reports: every `load_report_interval_s` (the router service's --load-monitor-interval)
  each decode worker's count of the requests it holds (running + waiting for their KV), its
  /v1/loads answer, goes into the router's tracker as the service's poll puts it there. The
  simulated answer is exact at its instant and every request is this router's, so under the
  tracker's rule (only a report's share that is not this router's counts, rust/core/src/
  queue.rs) it adds nothing; a rule that re-counted this router's own finished requests from
  a stale report would show here as it did on the emulated cluster.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from eldr_sglang.router.config import DEFAULT_LOAD_MONITOR_INTERVAL_S
from eldr_sglang.sim.cost_model import ExecutionModel
from eldr_sglang.sim.decode import DecodeStep, Replica, Requests
from eldr_sglang.sim.host import HostClock, SharedHost
from eldr_sglang.sim.paged_experts import PagedExperts
from eldr_sglang.sim.prefill import DEFAULT_PREFILL_POLICY, PrefillScheduler
from eldr_sglang.sim.replay import TraceReplay
from eldr_sglang.workload import Workload

_ARRIVE, _PREFILL_DONE, _STEP_END, _WAKE, _REPORT = 0, 1, 2, 3, 4


@dataclass
class ClusterConfig:
    num_decode: int = 8
    num_prefill: int = 0  # 0: same as num_decode
    max_running: int = 256  # per decode worker
    kv_capacity_tokens: int = 0  # per decode worker; 0: from the execution model
    # Bound, not a policy: every MoE layer of every step touches only top_k experts (as if all
    # of a batch's tokens chose the same experts). No routing can do better.
    perfect_overlap: bool = False
    prefill_policy: str = DEFAULT_PREFILL_POLICY  # see sim/prefill.py: round_robin, random, shortest_queue, earliest_free
    prefill_seed: int = 0  # for prefill_policy="random"
    load_report_interval_s: float = DEFAULT_LOAD_MONITOR_INTERVAL_S  # the decode workers' /v1/loads polls; 0: none
    # decode workers sharing host CPU (sim/host.py; a CPU engine's calibration); None: steps are the line
    host: SharedHost | None = None
    host_seed: int = 0


@dataclass
class SimResult:
    policy: str
    config: ClusterConfig
    workload: dict
    model: dict
    # per simulated request
    worker: np.ndarray
    arrival: np.ndarray
    prefill_done: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    output_len: np.ndarray
    completions: np.ndarray  # times each request finished (must be exactly 1)
    # per decode step
    step_worker: np.ndarray
    step_start: np.ndarray
    step_dt: np.ndarray
    step_batch: np.ndarray
    step_distinct: np.ndarray  # mean over MoE layers of distinct experts in the step
    distinct_layer_sum: np.ndarray  # [L] sum over steps of distinct experts
    step_null_distinct: np.ndarray  # expected step_distinct if the batch's tokens were random trace tokens
    offload_misses: int = 0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


def routing_marginals(replay: TraceReplay) -> np.ndarray:
    """[L, E]: probability that one replayed decode token selects expert e at layer l."""
    cached = getattr(replay, "_marginals", None)
    if cached is not None:
        return cached
    L, E = replay.num_layers, replay.num_experts
    try:
        from eldr_sglang._core import count_topk
    except ImportError:  # pragma: no cover
        def count_topk(ids, e):
            return np.stack([np.bincount(ids[:, l].ravel(), minlength=e) for l in range(ids.shape[1])])
    counts = np.zeros((L, E), dtype=np.float64)
    ids = replay.expert_ids
    for s, n in zip(replay.dec_start.tolist(), replay.dec_len.tolist()):
        counts += np.asarray(count_topk(ids[s : s + n], E))
    p = counts / max(int(replay.dec_len.sum()), 1)
    replay._marginals = p
    return p


def random_mix_distinct(replay: TraceReplay, batch: np.ndarray) -> np.ndarray:
    """Expected distinct experts per MoE layer of a step of `batch[i]` tokens drawn
    independently from the trace's routing marginals (no locality at all): the yardstick
    that separates locality from mere batch-size effects."""
    if len(batch) == 0:
        return np.zeros(0, np.float32)
    p = routing_marginals(replay)
    ub, inv = np.unique(batch, return_inverse=True)
    log1m = np.log1p(-np.clip(p, 0.0, 1.0 - 1e-12))  # [L, E]
    vals = np.array([(1.0 - np.exp(b * log1m)).sum(axis=1).mean() for b in ub])
    return vals[inv].astype(np.float32)


def _check(replay: TraceReplay, workload: Workload, model: ExecutionModel, cfg: ClusterConfig) -> int:
    """The decode workers' KV capacity, after checking that the run can be simulated at all."""
    if int(cfg.num_decode) < 1 or int(cfg.num_prefill) < 0 or cfg.max_running < 1:
        raise ValueError("need at least one prefill worker, one decode worker and max_running >= 1")
    m = model.model
    if replay.num_layers != m.num_moe_layers or replay.num_experts != m.num_experts:
        raise ValueError(
            f"the trace has {replay.num_layers} MoE layers x {replay.num_experts} experts but model "
            f"profile {m.name} has {m.num_moe_layers} x {m.num_experts}; pass the matching --model"
        )
    kv_cap = int(cfg.kv_capacity_tokens) or model.kv_capacity_tokens()
    biggest = int((workload.prompt_len + workload.output_len).max())
    if biggest > kv_cap:
        raise ValueError(f"a request needs {biggest} KV tokens but a decode worker holds only {kv_cap}")
    return kv_cap


class _Steps:
    """The log of every decode step (worker, start, length, batch, mean distinct experts)."""

    def __init__(self, num_layers: int):
        self.worker: list[int] = []
        self.start: list[float] = []
        self.dt: list[float] = []
        self.batch: list[int] = []
        self.distinct: list[float] = []
        self.layer_sum = np.zeros(num_layers, np.float64)

    def add(self, wi: int, now: float, dt: float, batch: int, d: np.ndarray) -> None:
        np.add(self.layer_sum, d, out=self.layer_sum)
        self.worker.append(wi)
        self.start.append(now)
        self.dt.append(dt)
        self.batch.append(batch)
        self.distinct.append(float(d.mean()))


class _Run:
    """One simulation: the event heap and the handlers of its four kinds of event."""

    def __init__(self, replay, workload, policy, model, cfg, kv_cap, bar):
        self.workload, self.policy, self.model, self.bar = workload, policy, model, bar
        N, K = workload.num_requests, int(cfg.num_decode)
        self.N, self.K = N, K
        t_idx = workload.trace_idx
        self.rq = Requests(workload.prompt_len, workload.output_len, replay.dec_start[t_idx], replay.dec_len[t_idx])
        cache = model.offload_cache_experts
        self.replicas = [Replica(self.rq, kv_cap, cfg.max_running,
                                 PagedExperts(replay.num_layers, replay.num_experts, cache) if cache > 0 else None)
                         for _ in range(K)]
        self.prefill = PrefillScheduler(int(cfg.num_prefill) or K, model.prefill_time, cfg.prefill_policy,
                                        cfg.prefill_seed)
        # a measured (calibrated) step times each prefill from its prompt's recorded routing
        self.prefill_pt = None
        if getattr(model, "measured_step", False):
            dist = replay.prompt_distinct()[t_idx]
            self.prefill_pt = np.array([model.prefill_time(int(n), d) for n, d in zip(workload.prompt_len, dist)])
        self.step = DecodeStep(replay, model, cfg.perfect_overlap)
        self.host = HostClock(cfg.host, K, cfg.host_seed) if cfg.host is not None else None
        self.steps = _Steps(replay.num_layers)
        self.transfer_cache: dict[int, float] = {}
        self.arrival = np.full(N, np.nan)
        self.prefill_done = np.full(N, np.nan)
        self.finish = np.full(N, np.nan)
        self.assigned = np.full(N, -1, np.int64)
        self.completions = np.zeros(N, np.int64)
        self.heap: list = []
        self.seq = itertools.count()  # ties in time break in the order events were made
        self.done_count = 0
        self.bar_pending = 0
        if workload.arrival == "closed":  # each client sends its first request at time 0
            self.next_issue = min(workload.concurrency, N)
            first = [(0.0, next(self.seq), _ARRIVE, i) for i in range(self.next_issue)]
        else:
            self.next_issue = N
            first = [(float(workload.arrival_s[i]), next(self.seq), _ARRIVE, i) for i in range(N)]
        self.heap = first
        self.report_every = float(cfg.load_report_interval_s)
        if self.report_every > 0 and hasattr(policy, "report_load"):
            self.heap.append((self.report_every, next(self.seq), _REPORT, 0))
        heapq.heapify(self.heap)

    def push(self, t: float, kind: int, a: int) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, a))

    def run(self) -> None:
        handlers = {_ARRIVE: self.on_arrive, _PREFILL_DONE: self.on_prefill_done, _STEP_END: self.on_step_end,
                    _WAKE: self.on_wake, _REPORT: self.on_report}
        while self.heap:
            now, _, kind, a = heapq.heappop(self.heap)
            handlers[kind](a, now)

    def finish_request(self, w: Replica, r: int, now: float) -> None:
        self.finish[r] = now
        self.completions[r] += 1
        w.leases.pop(r).release()
        self.done_count += 1
        self.bar_pending += 1
        if self.next_issue < self.N and self.workload.arrival == "closed":  # the client sends its next one
            self.push(now, _ARRIVE, self.next_issue)
            self.next_issue += 1

    def try_start(self, wi: int, now: float) -> None:
        """Between steps: admit what is ready, then start the next step or sleep until a
        request's KV arrives."""
        w = self.replicas[wi]
        for r in w.admit(now):
            self.finish_request(w, r, now)
        if len(w.req) == 0:
            w.busy = False
            ready = w.wake_time(now)
            if ready is not None:
                self.push(ready, _WAKE, wi)
            return
        dt, d = self.step.time(w)
        if self.host is not None:
            dt = self.host.step(wi, now, dt)
        self.steps.add(wi, now, dt, len(w.req), d)
        w.busy = True
        self.push(now + dt, _STEP_END, wi)

    def on_arrive(self, r: int, now: float) -> None:
        self.arrival[r] = now
        _, done = self.prefill.place(now, int(self.rq.prompt[r]), None if self.prefill_pt is None else float(self.prefill_pt[r]))
        self.push(done, _PREFILL_DONE, r)

    def on_prefill_done(self, r: int, now: float) -> None:
        """Late binding: the policy picks the decode worker now, from the prefill signature."""
        self.prefill_done[r] = now
        wi = self.policy.route(int(self.workload.trace_idx[r]))
        if not 0 <= wi < self.K:
            raise RuntimeError(f"policy {self.policy.name} returned worker {wi} outside 0..{self.K - 1}")
        self.assigned[r] = wi
        w = self.replicas[wi]
        prompt = self.rq.prompt
        w.leases[r] = self.policy.acquire(wi, int(prompt[r] + self.rq.out[r]))  # right after route: the same request
        n = int(prompt[r])
        tt = self.transfer_cache.get(n)
        if tt is None:
            tt = self.transfer_cache[n] = self.model.kv_transfer_time(n)
        ready = now + tt
        w.enqueue(ready, next(self.seq), r)
        if not w.busy:
            if ready <= now:
                self.try_start(wi, now)
            elif ready < w.wake_at:
                w.wake_at = ready
                self.push(ready, _WAKE, wi)

    def on_step_end(self, wi: int, now: float) -> None:
        w = self.replicas[wi]
        finished = w.end_step()
        for r in finished:
            self.finish_request(w, r, now)
        if finished and self.bar is not None and self.bar_pending >= 64:
            self.bar.update(self.bar_pending)
            self.bar_pending = 0
        self.try_start(wi, now)

    def on_report(self, _: int, now: float) -> None:
        """The router's /v1/loads poll: each worker's running + waiting requests."""
        for wi, w in enumerate(self.replicas):
            self.policy.report_load(wi, len(w.req) + len(w.pending))
        if self.done_count < self.N:
            self.push(now + self.report_every, _REPORT, 0)

    def on_wake(self, wi: int, now: float) -> None:
        w = self.replicas[wi]
        if now >= w.wake_at:
            w.wake_at = float("inf")
        if not w.busy:
            self.try_start(wi, now)


def simulate(
    replay: TraceReplay,
    workload: Workload,
    policy,
    model: ExecutionModel,
    config: ClusterConfig | None = None,
    *,
    progress: bool = False,
    progress_desc: str | None = None,
) -> SimResult:
    """Run one policy over one workload. Deterministic for fixed inputs and router seed."""
    cfg = config or ClusterConfig()
    kv_cap = _check(replay, workload, model, cfg)
    bar = None
    if progress:
        from eldr_sglang.progress import progress as progress_bar

        bar = progress_bar(workload.num_requests, desc=progress_desc or policy.name, unit="req", leave=False)
    t_wall = time.perf_counter()
    run = _Run(replay, workload, policy, model, cfg, kv_cap, bar)
    run.run()
    if bar is not None:
        bar.update(run.bar_pending)
        bar.close()
    st = run.steps
    return SimResult(
        policy=policy.name,
        config=cfg,
        workload=workload.describe(),
        model=model.describe(),
        worker=run.assigned,
        arrival=run.arrival,
        prefill_done=run.prefill_done,
        first_token=run.rq.first_token,
        finish=run.finish,
        output_len=workload.output_len.copy(),
        completions=run.completions,
        step_worker=np.asarray(st.worker, np.int32),
        step_start=np.asarray(st.start),
        step_dt=np.asarray(st.dt),
        step_batch=np.asarray(st.batch, np.int32),
        step_distinct=np.asarray(st.distinct, np.float32),
        step_null_distinct=random_mix_distinct(replay, np.asarray(st.batch, np.int64)),
        distinct_layer_sum=st.layer_sum,
        offload_misses=run.step.misses,
        wall_s=time.perf_counter() - t_wall,
        extra={"top_k": replay.top_k, "num_experts": replay.num_experts, "kv_capacity_tokens": kv_cap,
               "peak_kv_reserved": [w.peak_reserved for w in run.replicas],
               # expert-offload mode: per decode worker, SGLang paged-experts counters
               **({"paged": [w.cache.stats() for w in run.replicas]} if model.offload_cache_experts else {})},
    )
