"""Trace replay: what one request does to the experts, shared by the simulator and the
worker emulator.

Per trace request r:
- its prefill signature, computed from its prompt tokens only (`prefill_ids`, and
  `signatures(spec)` for all requests at once through the Rust `SignatureSpec`);
- its decode-token routing, in order: decode step s (s = 0, 1, ...) processes output token
  s as input, whose top-k ids are decode row s of the request. The first output token comes
  from prefill, so n output tokens take n-1 decode steps using rows 0..n-2. When more output
  tokens are asked for than were recorded, the recorded decode rows are replayed
  cyclically (same request, same experts) -- stated in every report that does it.

A trace of either version replays: a v1 trace has every token's routing; a v2 trace
(`traces.counts_file`) replays the requests whose decode routing it kept (all of them when
written with `--keep-decode all`), their prompts known by counts. Signatures, expert profiles
and the prefill payload all come from the prompt counts (`prompt_counts`), which for v1 are
counted from the prompt rows by the Rust `count_topk`: the same numbers either way.

Domain labels are not read here.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp  # noqa: F401  (the prompt counts' type)

from eldr_sglang.traces import Trace, TraceError
from eldr_sglang.traces.counts_file import CountsTrace


def distinct_per_layer_np(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Reference (numpy) count of distinct experts per layer of top-k ids [N, L, k]."""
    ids = np.asarray(ids)
    n, L, _ = ids.shape
    if n == 0:
        return np.zeros(L, dtype=np.uint32)
    flat = (ids.astype(np.int64) + (np.arange(L, dtype=np.int64) * num_experts)[None, :, None]).ravel()
    mask = np.zeros(L * num_experts, dtype=bool)
    mask[flat] = True
    return mask.reshape(L, num_experts).sum(axis=1).astype(np.uint32)


def touched_mask(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, L, k] ids -> [L, E] bool mask of experts touched (for the offload cache)."""
    n, L, _ = ids.shape
    mask = np.zeros((L, num_experts), dtype=bool)
    if n:
        mask[np.broadcast_to(np.arange(L)[None, :, None], ids.shape), ids] = True
    return mask


def distinct_counter():
    """The per-step distinct-expert counter: the Rust `distinct_per_layer` (the same code the
    serving side uses) when the extension is built, the numpy reference otherwise."""
    try:
        from eldr_sglang._core import distinct_per_layer

        return distinct_per_layer
    except ImportError:  # pragma: no cover - only before the extension is built
        return distinct_per_layer_np


class TraceReplay:
    """Replays a trace's requests: prompt lengths, signatures and decode-step routing.

    `trace` is a v1 `Trace` or an open v2 `CountsTrace` (see the module doc). Request r of the
    replay is request `source_requests[r]` of `source`, the trace given; `trace` is a v1 trace
    of the replayed requests (for v2: their decode rows only)."""

    def __init__(self, trace: Trace | CountsTrace):
        self.source = trace
        self._counts = None  # CSR [R, L*E] prompt counts, made on first use for v1
        if trace.counts_only:
            dec = trace.decode_trace()  # the kept decode routing: a v1 trace with no prompt rows
            req = trace.decode_requests()
            keep = trace.decode_len()[req] > 0  # a v2 trace has no prompt rows to replay instead
            if not keep.any():
                raise TraceError(f"{trace.path}: no request keeps decode tokens to replay")
            if not keep.all():
                dec = dec.subset(np.flatnonzero(keep))
                req = req[keep]
            self.source_requests = req
            self._counts = trace.counts(req)
            prompt_rows = np.zeros(len(req), dtype=np.int64)
            self.prompt_len = trace.prefill_len[req].astype(np.int64)
            trace = dec
        else:
            self.source_requests = np.arange(trace.num_requests, dtype=np.int64)
            prompt_rows = self.prompt_len = trace.prefill_len.astype(np.int64)
        self.trace = trace
        self.expert_ids = trace.expert_ids
        self.num_layers = trace.num_layers
        self.num_experts = trace.num_experts
        self.top_k = trace.top_k
        off = trace.req_offsets.astype(np.int64)
        self.dec_start = off[:-1] + prompt_rows
        self.dec_len = off[1:] - self.dec_start
        # A request without recorded decode tokens replays its prompt rows instead.
        no_dec = self.dec_len <= 0
        if np.any(no_dec):
            self.dec_start = np.where(no_dec, off[:-1], self.dec_start)
            self.dec_len = np.where(no_dec, off[1:] - off[:-1], self.dec_len)
        if np.any(self.dec_len <= 0):
            bad = int(np.nonzero(self.dec_len <= 0)[0][0])
            raise ValueError(f"trace request {bad} has no tokens at all; it cannot be replayed")
        self.recorded_output_len = np.maximum(off[1:] - off[:-1] - prompt_rows, 1)

    @property
    def num_requests(self) -> int:
        return self.trace.num_requests

    @property
    def is_counts(self) -> bool:
        """Whether the prompts are known by their counts only (a v2 trace)."""
        return self.source.counts_only

    def prefill_ids(self, r: int) -> np.ndarray:
        """[prompt_len, L, k] top-k ids of request r's prompt (v1 traces only)."""
        if self.is_counts:
            raise TraceError("a v2 trace keeps prompt counts, not each prompt token's routing")
        return self.trace.prefill_ids(r)

    def prompt_counts(self) -> "sp.csr_matrix":
        """CSR [R, L*E] of each request's prompt counts (column l*E + e)."""
        if self._counts is None:
            from eldr_sglang.traces.counts_file import prefill_counts

            t = self.trace
            self._counts = prefill_counts(t.expert_ids, t.req_offsets.astype(np.int64), self.prompt_len, t.num_experts)
        return self._counts

    def prompt_distinct(self) -> np.ndarray:
        """[R, L] distinct experts each request's prompt touched per MoE layer (from its counts)."""
        m = self.prompt_counts()
        rows = np.repeat(np.arange(m.shape[0]), np.diff(m.indptr))
        nz = m.data > 0
        out = np.zeros((m.shape[0], self.num_layers), dtype=np.int64)
        np.add.at(out, (rows[nz], m.indices[nz] // self.num_experts), 1)
        return out

    def prompt_counts_of(self, r: int) -> np.ndarray:
        """[L, E] uint32 prompt counts of request r."""
        row = self.prompt_counts()[r]
        out = np.zeros(self.num_layers * self.num_experts, dtype=np.uint32)
        out[row.indices] = row.data
        return out.reshape(self.num_layers, self.num_experts)

    def signatures(self, spec) -> tuple[np.ndarray, np.ndarray]:
        """Prefill signatures of all requests through the Rust SignatureSpec:
        ([R, D] float32, [R] valid). From the prompt rows of a v1 trace, from the counts of a
        v2 one: the same bits (both weight the same counts in the same order)."""
        if self.is_counts:
            c = self.prompt_counts()
            return spec.from_sparse_batch(c.indptr.astype(np.int64), c.indices, c.data)
        return spec.batch_from_topk(self.expert_ids, self.trace.req_offsets.astype(np.int64), self.prompt_len)

    def decode_trace(self) -> Trace:
        """The trace with each request's decode rows as its whole prompt: fitting and signing
        it gives what a clairvoyant router that knew the decode-time routing would use (the
        protocol's upper bound). Request order and domains are kept."""
        rows = np.concatenate([np.arange(s, s + n) for s, n in zip(self.dec_start.tolist(), self.dec_len.tolist())])
        off = np.zeros(self.num_requests + 1, np.int64)
        np.cumsum(self.dec_len, out=off[1:])
        t = self.trace
        return Trace(expert_ids=np.ascontiguousarray(self.expert_ids[rows]), req_offsets=off,
                     prefill_len=self.dec_len.astype(t.prefill_len.dtype), meta=dict(t.meta), domain=t.domain,
                     subdomain=t.subdomain, arrival_s=t.arrival_s)

    def decode_signatures(self, spec) -> tuple[np.ndarray, np.ndarray]:
        """Signatures from each request's decode rows instead of its prompt (see decode_trace)."""
        d = self.decode_trace()
        return spec.batch_from_topk(d.expert_ids, d.req_offsets, None)

    def expert_profiles(self) -> list:
        """Per request, its prompt's expert profile for the locality balancer (Rust
        ExpertProfile: counts of prompt tokens per (layer, expert) over the prompt length)."""
        cached = getattr(self, "_profiles", None)
        if cached is not None:
            return cached
        from eldr_sglang._core import ExpertProfile

        L, E = self.num_layers, self.num_experts
        out = []
        C = self.prompt_counts()
        for r in range(self.num_requests):
            a, b = C.indptr[r], C.indptr[r + 1]
            out.append(ExpertProfile(L, E, C.indices[a:b].astype(np.int64), C.data[a:b].astype(np.float64),
                                     max(int(self.prompt_len[r]), 1)))
        self._profiles = out
        return out

    def signature(self, spec, r: int) -> np.ndarray | None:
        """Request r's prefill signature, or None when it has no usable one."""
        from eldr_sglang._core import NoSignature

        try:
            if self.is_counts:
                C = self.prompt_counts()
                a, b = C.indptr[r], C.indptr[r + 1]
                return spec.from_sparse(C.indices[a:b].astype(np.int64), C.data[a:b])
            return spec.from_topk(np.ascontiguousarray(self.prefill_ids(r)))
        except NoSignature:
            return None

    def decode_row(self, r: int, step: int) -> int:
        return int(self.dec_start[r] + step % self.dec_len[r])

    def step_rows(self, reqs: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Trace rows of a decode batch: request reqs[i] at decode step steps[i]."""
        return self.dec_start[reqs] + steps % self.dec_len[reqs]

    def step_ids(self, reqs: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """[B, L, k] top-k ids of a decode batch."""
        return self.expert_ids[self.step_rows(reqs, steps)]
