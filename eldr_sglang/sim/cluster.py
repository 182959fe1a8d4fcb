"""Discrete-event simulation of a PD-disaggregated cluster (the scheduler part).

- Requests arrive (open loop) or are sent by closed-loop clients (workload.py).
- P prefill workers, FIFO, each prefill timed by the execution model's compute roofline;
  a request goes to the prefill worker that frees up first.
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
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from eldr_sglang.sim.cost_model import ExecutionModel, ExpertCache
from eldr_sglang.sim.replay import TraceReplay, distinct_counter, touched_mask
from eldr_sglang.sim.workload import Workload

_ARRIVE, _PREFILL_DONE, _STEP_END, _WAKE = 0, 1, 2, 3


@dataclass
class ClusterConfig:
    num_decode: int = 8
    num_prefill: int = 0  # 0: same as num_decode
    max_running: int = 256  # per decode worker
    kv_capacity_tokens: int = 0  # per decode worker; 0: from the execution model
    # Bound, not a policy: every MoE layer of every step touches only top_k experts (as if all
    # of a batch's tokens chose the same experts). No routing can do better.
    perfect_overlap: bool = False


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


class _Worker:
    __slots__ = ("req", "pos", "need", "ds", "dl", "ctx", "pending", "busy", "kv", "reserved", "leases", "cache", "wake_at", "reserve")

    def __init__(self):
        self.req = np.zeros(0, np.int64)
        self.pos = np.zeros(0, np.int64)
        self.need = np.zeros(0, np.int64)
        self.ds = np.zeros(0, np.int64)
        self.dl = np.zeros(0, np.int64)
        self.ctx = np.zeros(0, np.int64)
        self.reserve = np.zeros(0, np.int64)
        self.pending: list = []  # heap of (ready_time, seq, sim request)
        self.busy = False
        self.kv = 0  # KV tokens read by the next step
        self.reserved = 0
        self.leases: dict = {}
        self.cache = None
        self.wake_at = float("inf")


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
    K = int(cfg.num_decode)
    P = int(cfg.num_prefill) or K
    if K < 1 or P < 1 or cfg.max_running < 1:
        raise ValueError("need at least one prefill worker, one decode worker and max_running >= 1")
    m = model.model
    if replay.num_layers != m.num_moe_layers or replay.num_experts != m.num_experts:
        raise ValueError(
            f"the trace has {replay.num_layers} MoE layers x {replay.num_experts} experts but model "
            f"profile {m.name} has {m.num_moe_layers} x {m.num_experts}; pass the matching --model"
        )
    kv_cap = int(cfg.kv_capacity_tokens) or model.kv_capacity_tokens()
    N = workload.num_requests
    t_idx = workload.trace_idx
    prompt = workload.prompt_len
    out = workload.output_len
    biggest = int((prompt + out).max())
    if biggest > kv_cap:
        raise ValueError(f"a request needs {biggest} KV tokens but a decode worker holds only {kv_cap}")

    E = replay.num_experts
    L = replay.num_layers
    ids_all = replay.expert_ids
    dec_start = replay.dec_start[t_idx]
    dec_len = replay.dec_len[t_idx]
    count = distinct_counter()
    offload = model.offload_cache_experts > 0
    ep = model.ep
    step_time = model.decode_step_time
    perfect = np.full(L, replay.top_k, np.int64) if cfg.perfect_overlap else None

    workers = [_Worker() for _ in range(K)]
    if offload:
        for w in workers:
            w.cache = ExpertCache(L, E, model.offload_cache_experts)
    prefill_free = [0.0] * P
    peak_reserved = [0] * K
    prefill_cache: dict[int, float] = {}
    transfer_cache: dict[int, float] = {}

    arrival = np.full(N, np.nan)
    prefill_done = np.full(N, np.nan)
    first_token = np.full(N, np.nan)
    finish = np.full(N, np.nan)
    assigned = np.full(N, -1, np.int64)
    completions = np.zeros(N, np.int64)

    s_worker: list[int] = []
    s_start: list[float] = []
    s_dt: list[float] = []
    s_batch: list[int] = []
    s_distinct: list[float] = []
    layer_sum = np.zeros(L, np.float64)
    misses_total = 0

    heap: list = []
    seq = 0
    if workload.arrival == "closed":
        n0 = min(workload.concurrency, N)
        for i in range(n0):
            heap.append((0.0, seq, _ARRIVE, i))
            seq += 1
        next_issue = n0
    else:
        for i in range(N):
            heap.append((float(workload.arrival_s[i]), seq, _ARRIVE, i))
            seq += 1
        next_issue = N
    heapq.heapify(heap)

    bar = None
    if progress:
        from eldr_sglang.progress import progress as progress_bar

        bar = progress_bar(N, desc=progress_desc or policy.name, unit="req", leave=False)
    done_count = 0
    bar_pending = 0
    t_wall = time.perf_counter()

    def finish_request(w: _Worker, r: int, now: float) -> None:
        nonlocal next_issue, seq, done_count, bar_pending
        finish[r] = now
        completions[r] += 1
        w.leases.pop(r).release()
        done_count += 1
        bar_pending += 1
        if next_issue < N and workload.arrival == "closed":
            heapq.heappush(heap, (now, seq, _ARRIVE, next_issue))
            seq += 1
            next_issue += 1

    def try_start(wi: int, now: float) -> None:
        nonlocal seq, misses_total
        w = workers[wi]
        # admit ready requests, FIFO by readiness
        if w.pending and w.pending[0][0] <= now and len(w.req) < cfg.max_running:
            adm: list[int] = []
            room = cfg.max_running - len(w.req)
            while w.pending and w.pending[0][0] <= now and room > 0:
                r = w.pending[0][2]
                need_kv = int(prompt[r] + out[r])
                if w.reserved + need_kv > kv_cap:
                    break
                heapq.heappop(w.pending)
                w.reserved += need_kv
                first_token[r] = now
                if out[r] <= 1:  # the only token came from prefill
                    w.reserved -= need_kv
                    finish_request(w, r, now)
                    continue
                adm.append(r)
                room -= 1
            if adm:
                a = np.asarray(adm, np.int64)
                w.req = np.concatenate([w.req, a])
                w.pos = np.concatenate([w.pos, np.zeros(len(a), np.int64)])
                w.need = np.concatenate([w.need, out[a] - 1])
                w.ds = np.concatenate([w.ds, dec_start[a]])
                w.dl = np.concatenate([w.dl, dec_len[a]])
                w.ctx = np.concatenate([w.ctx, prompt[a] + 1])
                w.reserve = np.concatenate([w.reserve, prompt[a] + out[a]])
                w.kv += int(prompt[a].sum()) + len(a)
                if w.reserved > peak_reserved[wi]:
                    peak_reserved[wi] = w.reserved
        B = len(w.req)
        if B == 0:
            w.busy = False
            if w.pending:
                ready = w.pending[0][0]
                if ready > now and ready < w.wake_at:
                    w.wake_at = ready
                    heapq.heappush(heap, (ready, seq, _WAKE, wi))
                    seq += 1
            return
        rows = w.ds + w.pos % w.dl
        ids = ids_all[rows]
        if perfect is not None:
            d = perfect
            dt = step_time(B, w.kv, d if ep == 1 else np.full((L, ep), -(-replay.top_k // ep), np.int64))
        elif ep > 1:
            d_rank = touched_mask(ids, E).reshape(L, ep, E // ep).sum(axis=2)
            d = d_rank.sum(axis=1)
            dt = step_time(B, w.kv, d_rank)
        elif offload:
            touched = touched_mask(ids, E)
            d = touched.sum(axis=1)
            miss = w.cache.access(touched)
            misses_total += int(miss.sum())
            dt = step_time(B, w.kv, d, miss)
        else:
            d = count(ids, E)
            dt = step_time(B, w.kv, d)
        np.add(layer_sum, d, out=layer_sum)
        s_worker.append(wi)
        s_start.append(now)
        s_dt.append(dt)
        s_batch.append(B)
        s_distinct.append(float(d.mean()))
        w.busy = True
        heapq.heappush(heap, (now + dt, seq, _STEP_END, wi))
        seq += 1

    while heap:
        now, _, kind, a = heapq.heappop(heap)
        if kind == _STEP_END:
            w = workers[a]
            B = len(w.req)
            w.pos += 1
            w.kv += B
            w.ctx += 1
            fin = w.pos >= w.need
            if fin.any():
                for r in w.req[fin].tolist():
                    finish_request(w, r, now)
                w.kv -= int(w.ctx[fin].sum())
                w.reserved -= int(w.reserve[fin].sum())
                keep = ~fin
                w.req, w.pos, w.need = w.req[keep], w.pos[keep], w.need[keep]
                w.ds, w.dl, w.ctx, w.reserve = w.ds[keep], w.dl[keep], w.ctx[keep], w.reserve[keep]
                if bar is not None and bar_pending >= 64:
                    bar.update(bar_pending)
                    bar_pending = 0
            try_start(a, now)
        elif kind == _ARRIVE:
            r = a
            arrival[r] = now
            p = min(range(P), key=prefill_free.__getitem__)
            n = int(prompt[r])
            pt = prefill_cache.get(n)
            if pt is None:
                pt = prefill_cache[n] = model.prefill_time(n)
            done = max(now, prefill_free[p]) + pt
            prefill_free[p] = done
            heapq.heappush(heap, (done, seq, _PREFILL_DONE, r))
            seq += 1
        elif kind == _PREFILL_DONE:
            r = a
            prefill_done[r] = now
            wi = policy.route(int(t_idx[r]))
            if not 0 <= wi < K:
                raise RuntimeError(f"policy {policy.name} returned worker {wi} outside 0..{K - 1}")
            assigned[r] = wi
            w = workers[wi]
            w.leases[r] = policy.acquire(wi, int(prompt[r] + out[r]))  # right after route: the same request
            n = int(prompt[r])
            tt = transfer_cache.get(n)
            if tt is None:
                tt = transfer_cache[n] = model.kv_transfer_time(n)
            ready = now + tt
            heapq.heappush(w.pending, (ready, seq, r))
            seq += 1
            if not w.busy:
                if ready <= now:
                    try_start(wi, now)
                elif ready < w.wake_at:
                    w.wake_at = ready
                    heapq.heappush(heap, (ready, seq, _WAKE, wi))
                    seq += 1
        else:  # _WAKE
            w = workers[a]
            if now >= w.wake_at:
                w.wake_at = float("inf")
            if not w.busy:
                try_start(a, now)
    if bar is not None:
        bar.update(bar_pending)
        bar.close()

    sb = np.asarray(s_batch, np.int64)
    null = random_mix_distinct(replay, sb)
    return SimResult(
        policy=policy.name,
        config=cfg,
        workload=workload.describe(),
        model=model.describe(),
        worker=assigned,
        arrival=arrival,
        prefill_done=prefill_done,
        first_token=first_token,
        finish=finish,
        output_len=out.copy(),
        completions=completions,
        step_worker=np.asarray(s_worker, np.int32),
        step_start=np.asarray(s_start),
        step_dt=np.asarray(s_dt),
        step_batch=np.asarray(s_batch, np.int32),
        step_distinct=np.asarray(s_distinct, np.float32),
        step_null_distinct=null,
        distinct_layer_sum=layer_sum,
        offload_misses=misses_total,
        wall_s=time.perf_counter() - t_wall,
        extra={"top_k": replay.top_k, "num_experts": E, "kv_capacity_tokens": kv_cap, "peak_kv_reserved": peak_reserved},
    )
