"""Where a fit reads its requests from: a v1 trace in memory, or a v2 trace on disk, chunk by chunk.

The fit needs, of every calibration request, its prompt counts (for document frequencies
and signatures), and of a sample, its decode routing (layer selection, the report). Both
sources give these through the same few methods, and both send every signature through the
Rust normalizer (`SignatureSpec`), the router's own path: from top-k ids for v1
(`batch_from_topk`), from the stored counts for v2 (`from_sparse_batch`, one call a chunk).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import scipy.sparse as sp

from eldr_sglang.offline import report as rpt
from eldr_sglang.offline.signatures import (
    DEFAULT_CHUNK_TOKENS,
    dense_to_csr,
    compute_signatures,
    decode_profiles,
    document_frequency,
    raw_signatures,
)
from eldr_sglang.progress import progress as progress_bar
from eldr_sglang.traces.counts_file import CountsTrace
from eldr_sglang.traces.format import Trace
from eldr_sglang.traces.source import TraceSource


# np.bincount converts its input to intp first; in slices that temporary stays in cache
_BINCOUNT_SLICE = 1 << 16
_HASH_POOL = None


def _hash_pool():
    global _HASH_POOL
    if _HASH_POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _HASH_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eldr-sha256")
    return _HASH_POOL


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class TokenSource:
    """A v1 trace: every token's top-k ids in memory."""

    def __init__(self, trace: Trace, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        self.trace = trace
        self.chunk_tokens = chunk_tokens
        self._raw = None

    def prefill_pass(self, req: np.ndarray, progress: bool) -> tuple[np.ndarray, np.ndarray]:
        """(valid [N], df [L, E] over the valid requests) in one streaming pass."""
        t = self.trace
        self._raw, valid = raw_signatures(t, req, self.chunk_tokens, progress)
        return valid, document_frequency(self._raw[valid], t.num_layers, t.num_experts)

    def raw_rows(self, req: np.ndarray, rows: np.ndarray) -> sp.csr_matrix:
        """Raw (all layers, IDF 1) signatures of req[rows]; rows index the prefill pass's req."""
        return self._raw[rows]

    def signatures(self, spec, req: np.ndarray, progress: bool, dense: bool = False):
        """(signatures [N, D] float32: CSR, or an ndarray when `dense`; valid [N])."""
        S, valid = compute_signatures(self.trace, spec, req, self.chunk_tokens, progress, desc="signatures")
        return (S.toarray() if dense else S), valid

    def has_decode(self, req: np.ndarray) -> np.ndarray:
        return self.trace.decode_len()[req] > 0

    def decode_profiles(self, req: np.ndarray) -> np.ndarray:
        return decode_profiles(self.trace, req, self.chunk_tokens)[0]

    def decode_locality(self, req: np.ndarray, assign: np.ndarray, rng) -> dict:
        return rpt.decode_locality(self.trace, req, assign, rng)

    def digest(self) -> str:
        """sha256 of the trace's routing content (ids, offsets, prefill lengths, shape meta)."""
        t = self.trace
        h = hashlib.sha256()
        h.update(json.dumps([t.num_layers, t.num_experts, t.top_k, str(t.expert_ids.dtype)]).encode())
        for a in (t.req_offsets.astype(np.int64), t.prefill_len.astype(np.int32)):
            h.update(np.ascontiguousarray(a).tobytes())
        step = 1 << 20
        for s in range(0, t.expert_ids.shape[0], step):
            h.update(np.ascontiguousarray(t.expert_ids[s : s + step]).tobytes())
        return h.hexdigest()

    def file_digest(self, path) -> str:
        return file_sha256(path)


def _spec_rows(spec, rows: "_Rows") -> tuple[sp.csr_matrix, np.ndarray]:
    """Signatures of count rows through the Rust normalizer, one batched call
    (`SignatureSpec.from_sparse_batch`, the single-request path row by row): (CSR float32, valid)."""
    S, valid = spec.from_sparse_batch(rows.indptr, rows.index, rows.count)
    return dense_to_csr(S), valid


class _Rows:
    """CSR arrays of some requests' prompt counts (column l*E + e): the stored arrays when the
    requests are a whole chunk in order, else the selected rows."""

    __slots__ = ("indptr", "index", "count")

    def __init__(self, indptr: np.ndarray, index: np.ndarray, count: np.ndarray):
        self.indptr, self.index, self.count = indptr.astype(np.int64, copy=False), index, count

    def __len__(self) -> int:
        return len(self.indptr) - 1


class CountsSource:
    """A v2 trace: prompt counts read chunk by chunk; decode routing of the requests that kept it."""

    def __init__(self, trace: CountsTrace):
        self.trace = trace
        self._dtrace = None
        self._dreq = trace.decode_requests()
        self._digest = None  # a future: see digest()

    def _by_chunk(self, req: np.ndarray):
        """(positions in req, _Rows of those requests) per chunk holding any of req. A chunk
        read whole and in order is passed as stored (no CSR built, no dtype converted)."""
        t = self.trace
        firsts = np.array([c["first"] for c in t.chunks], dtype=np.int64)
        which = np.searchsorted(firsts, req, side="right") - 1
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(firsts) + 1))
        for i in range(len(firsts)):
            pos = order[bounds[i] : bounds[i + 1]]
            if not len(pos):
                continue
            local = req[pos] - firsts[i]
            arrays = t.chunk_arrays(i)
            if len(local) == t.chunks[i]["requests"] and np.array_equal(local, np.arange(len(local))):
                yield pos, _Rows(*arrays)
            else:
                shape = (len(arrays[0]) - 1, t.num_layers * t.num_experts)
                m = sp.csr_matrix((arrays[2], arrays[1], arrays[0]), shape=shape)[local]
                yield pos, _Rows(m.indptr, m.indices, m.data)

    def _map(self, req: np.ndarray, fn, dim: int, progress: bool, desc: str):
        """fn(counts CSR) -> (CSR rows, valid) over req, chunk by chunk, rows in req's order."""
        blocks, positions, valids = [], [], []
        with progress_bar(len(req), desc=desc, unit="req", leave=False, enabled=progress) as bar:
            for pos, counts in self._by_chunk(req):
                S, v = fn(counts)
                blocks.append(S)
                positions.append(pos)
                valids.append(v)
                bar.update(len(pos))
        pos = np.concatenate(positions)
        S = sp.vstack(blocks, format="csr")
        del blocks
        valid = np.empty(len(req), dtype=bool)
        valid[pos] = np.concatenate(valids)
        if not np.array_equal(pos, np.arange(len(req))):
            inv = np.empty(len(req), dtype=np.int64)
            inv[pos] = np.arange(len(req))
            S = S[inv]
        return S.astype(np.float32, copy=False), valid

    def prefill_pass(self, req: np.ndarray, progress: bool) -> tuple[np.ndarray, np.ndarray]:
        L, E = self.trace.num_layers, self.trace.num_experts
        self._start_digest()  # the fit will want it: hash the file while this pass reads it
        df = np.zeros(L * E, dtype=np.int64)
        valid = np.zeros(len(req), dtype=bool)
        with progress_bar(len(req), desc="prefill counts", unit="req", leave=False, enabled=progress) as bar:
            for pos, rows in self._by_chunk(req):
                index = rows.index
                if rows.count.size and rows.count.min() == 0:  # stored zeros count for nothing
                    m = sp.csr_matrix((rows.count, index, rows.indptr), shape=(len(rows), L * E))
                    m.eliminate_zeros()
                    rows, index = _Rows(m.indptr, m.indices, m.data), m.indices
                valid[pos] = np.diff(rows.indptr) > 0
                for a in range(0, len(index), _BINCOUNT_SLICE):  # rows without counts add nothing
                    df += np.bincount(index[a : a + _BINCOUNT_SLICE], minlength=L * E)
                bar.update(len(pos))
        return valid, df.reshape(L, E)

    def _ones_spec(self):
        from eldr_sglang import _core

        L, E = self.trace.num_layers, self.trace.num_experts
        return _core.SignatureSpec(np.ones(L, dtype=np.float32), np.ones((L, E), dtype=np.float32))

    def raw_rows(self, req: np.ndarray, rows: np.ndarray) -> sp.csr_matrix:
        spec = self._ones_spec()
        return self._map(req[rows], lambda c: _spec_rows(spec, c), spec.dim, False, "raw")[0]

    def signatures(self, spec, req: np.ndarray, progress: bool, dense: bool = False):
        """(signatures [N, D] float32: CSR, or an ndarray filled chunk by chunk when `dense`;
        valid [N])."""
        if not dense:
            return self._map(req, lambda c: _spec_rows(spec, c), spec.dim, progress, "signatures")
        out = np.empty((len(req), spec.dim), dtype=np.float32)  # every row is written below
        valid = np.zeros(len(req), dtype=bool)
        with progress_bar(len(req), desc="signatures", unit="req", leave=False, enabled=progress) as bar:
            for pos, rows in self._by_chunk(req):
                a = int(pos[0])
                if np.array_equal(pos, np.arange(a, a + len(pos))):  # in place, no chunk-sized copy
                    _, valid[a : a + len(pos)] = spec.from_sparse_batch(rows.indptr, rows.index, rows.count,
                                                                         out=out[a : a + len(pos)])
                else:
                    out[pos], valid[pos] = spec.from_sparse_batch(rows.indptr, rows.index, rows.count)
                bar.update(len(pos))
        return out, valid

    def has_decode(self, req: np.ndarray) -> np.ndarray:
        kept = np.isin(req, self._dreq)
        return kept & (self.trace.decode_len()[req] > 0)

    def _decode(self, req: np.ndarray) -> tuple[Trace, np.ndarray]:
        if self._dtrace is None:
            self._dtrace = self.trace.decode_trace()
        return self._dtrace, np.searchsorted(self._dreq, req)

    def decode_profiles(self, req: np.ndarray) -> np.ndarray:
        dt, pos = self._decode(req)
        return decode_profiles(dt, pos)[0]

    def decode_locality(self, req: np.ndarray, assign: np.ndarray, rng) -> dict:
        keep = self.has_decode(req)
        if not keep.any():
            return {"batch_sizes": [], "requests_with_decode": 0}
        dt, pos = self._decode(req[keep])
        return rpt.decode_locality(dt, pos, assign[keep], rng)

    def _start_digest(self) -> None:
        # The digest of a v2 trace is its file's sha256: one sequential read in a background
        # thread (hashlib and file reads release the GIL), overlapping the fit's own passes.
        if self._digest is None:
            self._digest = _hash_pool().submit(file_sha256, self.trace.path)

    def digest(self) -> str:
        """sha256 of the trace file (a v2 file holds nothing but the trace)."""
        self._start_digest()
        return self._digest.result()

    def file_digest(self, path) -> str:
        return self.digest() if os.path.samefile(path, self.trace.path) else file_sha256(path)


def prefill_source(trace: TraceSource, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> "TokenSource | CountsSource":
    """The reader of a trace of either version: by its prompt counts (v2) or its tokens (v1)."""
    if not isinstance(trace, TraceSource):
        raise TypeError("fit_trace needs an eldr_sglang.traces.Trace (v1) or CountsTrace (v2)")
    return CountsSource(trace) if trace.counts_only else TokenSource(trace, chunk_tokens)
