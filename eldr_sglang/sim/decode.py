"""The decode side of the simulated cluster: one `Replica` per decode worker (its continuous
batching scheduler) and `DecodeStep`, which times one step of a batch from the experts its
tokens select.

A replica admits ready requests between steps, in FIFO order of readiness, while it has
fewer than `max_running` running and the request's KV reservation (prompt + output tokens)
fits its KV capacity. Each step emits one token per running request; an n-token request
takes n-1 decode steps (its first token came from prefill).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from eldr_sglang.sim.cost_model import ExecutionModel
from eldr_sglang.sim.paged_experts import PagedExperts
from eldr_sglang.sim.replay import TraceReplay, distinct_counter, touched_mask


@dataclass
class Requests:
    """What the decode side knows of each simulated request, and when its first token left."""

    prompt: np.ndarray  # [N] prompt tokens (KV on arrival at the decode worker)
    out: np.ndarray  # [N] output tokens, the first from prefill
    dec_start: np.ndarray  # [N] first decode row of the replayed trace request
    dec_len: np.ndarray  # [N] its decode rows (replayed cyclically)
    first_token: np.ndarray = field(init=False)

    def __post_init__(self):
        self.first_token = np.full(len(self.prompt), np.nan)


class Replica:
    """One decode worker's running batch and its queue of requests whose KV is arriving."""

    def __init__(self, requests: Requests, kv_capacity: int, max_running: int, cache: PagedExperts | None = None):
        self.rq = requests
        self.kv_capacity = kv_capacity
        self.max_running = max_running
        self.cache = cache
        # the running batch, one entry per request
        self.req = np.zeros(0, np.int64)
        self.pos = np.zeros(0, np.int64)  # decode steps done
        self.need = np.zeros(0, np.int64)  # decode steps to do
        self.ds = np.zeros(0, np.int64)
        self.dl = np.zeros(0, np.int64)
        self.ctx = np.zeros(0, np.int64)  # KV tokens each holds
        self.reserve = np.zeros(0, np.int64)  # KV tokens each reserved
        self.pending: list = []  # heap of (ready_time, seq, sim request)
        self.busy = False  # a step is running
        self.kv = 0  # KV tokens read by the next step
        self.reserved = 0
        self.peak_reserved = 0
        self.leases: dict = {}
        self.wake_at = float("inf")  # the wake-up already scheduled, if any

    def enqueue(self, ready: float, seq: int, r: int) -> None:
        heapq.heappush(self.pending, (ready, seq, r))

    def admit(self, now: float) -> list[int]:
        """Admit ready requests; returns those that finish on admission (their only token
        came from prefill)."""
        done: list[int] = []
        if not (self.pending and self.pending[0][0] <= now and len(self.req) < self.max_running):
            return done
        rq, adm = self.rq, []
        room = self.max_running - len(self.req)
        while self.pending and self.pending[0][0] <= now and room > 0:
            r = self.pending[0][2]
            need_kv = int(rq.prompt[r] + rq.out[r])
            if self.reserved + need_kv > self.kv_capacity:
                break
            heapq.heappop(self.pending)
            rq.first_token[r] = now
            if rq.out[r] <= 1:
                done.append(r)
                continue
            self.reserved += need_kv
            adm.append(r)
            room -= 1
        if adm:
            a = np.asarray(adm, np.int64)
            self.req = np.concatenate([self.req, a])
            self.pos = np.concatenate([self.pos, np.zeros(len(a), np.int64)])
            self.need = np.concatenate([self.need, rq.out[a] - 1])
            self.ds = np.concatenate([self.ds, rq.dec_start[a]])
            self.dl = np.concatenate([self.dl, rq.dec_len[a]])
            self.ctx = np.concatenate([self.ctx, rq.prompt[a] + 1])
            self.reserve = np.concatenate([self.reserve, rq.prompt[a] + rq.out[a]])
            self.kv += int(rq.prompt[a].sum()) + len(a)
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        return done

    def wake_time(self, now: float) -> float | None:
        """Idle with requests still in transfer: when the first is ready, unless a wake-up at
        or before then is already scheduled."""
        if self.pending:
            ready = self.pending[0][0]
            if now < ready < self.wake_at:
                self.wake_at = ready
                return ready
        return None

    def rows(self) -> np.ndarray:
        """The trace rows the batch's tokens replay this step."""
        return self.ds + self.pos % self.dl

    def end_step(self) -> list[int]:
        """Every running request got a token; returns the finished ones, dropped from the batch."""
        self.pos += 1
        self.kv += len(self.req)
        self.ctx += 1
        fin = self.pos >= self.need
        if not fin.any():
            return []
        done = self.req[fin].tolist()
        self.kv -= int(self.ctx[fin].sum())
        self.reserved -= int(self.reserve[fin].sum())
        keep = ~fin
        self.req, self.pos, self.need = self.req[keep], self.pos[keep], self.need[keep]
        self.ds, self.dl, self.ctx, self.reserve = self.ds[keep], self.dl[keep], self.ctx[keep], self.reserve[keep]
        return done


class DecodeStep:
    """The time of one decode step, from the distinct experts its batch touches per MoE layer
    (per expert-parallel rank with ep > 1; through the replica's paged-expert tables in the
    expert-offload mode, sim/paged_experts.py)."""

    def __init__(self, replay: TraceReplay, model: ExecutionModel, perfect_overlap: bool = False):
        self.ids = replay.expert_ids
        self.E, self.L, self.top_k = replay.num_experts, replay.num_layers, replay.top_k
        self.model = model
        self.count = distinct_counter()
        # the bound: every MoE layer of every step touches only top_k experts
        self.perfect = np.full(self.L, self.top_k, np.int64) if perfect_overlap else None
        self.misses = 0

    def time(self, replica: Replica) -> tuple[float, np.ndarray]:
        """(step seconds, distinct experts per MoE layer) for the replica's running batch."""
        B, kv, ep, step_time = len(replica.req), replica.kv, self.model.ep, self.model.decode_step_time
        ids = self.ids[replica.rows()]
        if self.perfect is not None:  # with paged experts, the bound also pages nothing in
            d = self.perfect
            if replica.cache is not None:
                return step_time(B, kv, d, np.zeros(self.L), np.ones(self.L)), d
            return step_time(B, kv, d if ep == 1 else np.full((self.L, ep), -(-self.top_k // ep), np.int64)), d
        if ep > 1:
            d_rank = touched_mask(ids, self.E).reshape(self.L, ep, self.E // ep).sum(axis=2)
            return step_time(B, kv, d_rank), d_rank.sum(axis=1)
        if replica.cache is not None:
            touched = touched_mask(ids, self.E)
            d = touched.sum(axis=1)
            miss, waves = replica.cache.access(touched, B * self.top_k * self.L)
            self.misses += int(miss.sum())
            return step_time(B, kv, d, miss, waves), d
        d = self.count(ids, self.E)
        return step_time(B, kv, d), d
