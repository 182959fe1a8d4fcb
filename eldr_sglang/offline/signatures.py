"""Signatures of many requests, computed as a stream of bounded chunks by the Rust normalizer.

The signature of a request depends on its prefill tokens only (the ELDR paper,
arXiv:2607.00466; README "The ELDR rule"). We never expand the whole trace: requests are
processed in chunks of at most ``chunk_tokens`` prefill tokens, each chunk goes through
``SignatureSpec.batch_from_topk`` (Rust, GIL released), and the dense chunk result is turned
into CSR at once, so memory stays at one chunk plus the sparse result.

IDF and layer weights are fit-time statistics and live here, in Python:
``idf[l][e] = log((|C|+1)/(df[l][e]+1)) (+1)`` with ``df`` the number of calibration
requests whose prefill used ``(l, e)`` at least once.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import scipy.sparse as sp

from eldr_sglang.progress import progress as progress_bar
from eldr_sglang.traces.format import Trace, span_rows

DEFAULT_CHUNK_TOKENS = 1 << 18


def _core():
    try:
        from eldr_sglang import _core
    except ImportError as exc:  # pragma: no cover - depends on the build
        raise RuntimeError(
            "the Rust extension eldr_sglang._core is not built; run `maturin develop --release`"
        ) from exc
    return _core


def iter_chunks(
    trace: Trace,
    requests: np.ndarray | None = None,
    part: str = "prefill",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
    """Yield (request indices, ids [T_chunk, L, k], offsets [R_chunk+1], prefix_len or None)
    for the given part ("prefill", "decode" or "all") of each request, in bounded chunks.

    Request r of the chunk is ids[offsets[r] : offsets[r] + prefix_len[r]] (the whole span
    when prefix_len is None). A run of consecutive prefill requests is passed as a view of
    the trace (no copy); anything else is gathered, at most chunk_tokens rows at a time."""
    req = np.arange(trace.num_requests) if requests is None else np.asarray(requests, dtype=np.int64)
    off = trace.req_offsets
    pl = trace.prefill_len.astype(np.int64)
    if part == "prefill":
        starts, lens = off[req], pl[req]
    elif part == "decode":
        starts, lens = off[req] + pl[req], off[req + 1] - off[req] - pl[req]
    elif part == "all":
        starts, lens = off[req], off[req + 1] - off[req]
    else:
        raise ValueError(f"unknown part {part!r}")
    csum = np.cumsum(lens)
    j = 0
    n = len(req)
    while j < n:
        base = csum[j - 1] if j else 0
        # take requests until the chunk holds chunk_tokens tokens (at least one request)
        e = int(np.searchsorted(csum, base + chunk_tokens, side="right"))
        e = min(max(e, j + 1), n)
        rj = req[j:e]
        lj = lens[j:e]
        if part in ("prefill", "all") and rj[-1] - rj[0] == e - 1 - j and np.all(np.diff(rj) == 1):
            lo, hi = int(off[rj[0]]), int(off[rj[-1] + 1])
            offsets = off[rj[0] : rj[-1] + 2] - lo
            yield rj, trace.expert_ids[lo:hi], offsets, (lj if part == "prefill" else None)
        else:
            rows = span_rows(starts[j:e], lj)
            offsets = np.zeros(e - j + 1, dtype=np.int64)
            np.cumsum(lj, out=offsets[1:])
            yield rj, trace.expert_ids[rows], offsets, None
        j = e


def dense_to_csr(a: np.ndarray) -> sp.csr_matrix:
    """Dense signature rows -> CSR float32 of their nonzeros (the same values, bit for bit)."""
    mask = a != 0
    counts = mask.sum(axis=1)
    indptr = np.zeros(a.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.nonzero(mask)[1].astype(np.int32)
    return sp.csr_matrix((a[mask].astype(np.float32), indices, indptr), shape=a.shape)


def compute_signatures(
    trace: Trace,
    spec,
    requests: np.ndarray | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    progress: bool = False,
    desc: str = "signatures",
) -> tuple[sp.csr_matrix, np.ndarray]:
    """Signatures of the requests' prefill tokens: (CSR [R, D] float32 unit rows, valid [R]).

    ``spec`` is an ``eldr_sglang._core.SignatureSpec``. Rows without a usable signature
    (no prefill token, or only zero-weight layers) are empty and ``valid`` is False.
    """
    if spec.num_layers != trace.num_layers or spec.num_experts != trace.num_experts:
        raise ValueError(
            f"signature spec is for {spec.num_layers} layers x {spec.num_experts} experts, "
            f"the trace has {trace.num_layers} x {trace.num_experts}"
        )
    n_req = trace.num_requests if requests is None else len(requests)
    blocks: list[sp.csr_matrix] = []
    valids: list[np.ndarray] = []
    with progress_bar(n_req, desc=desc, unit="req", leave=False, enabled=progress) as bar:
        for idx, ids, offsets, prefix in iter_chunks(trace, requests, "prefill", chunk_tokens):
            sig, valid = spec.batch_from_topk(ids, offsets, prefix)
            blocks.append(dense_to_csr(np.asarray(sig, dtype=np.float32)))
            valids.append(np.asarray(valid, dtype=bool))
            bar.update(len(idx))
    if not blocks:
        return sp.csr_matrix((0, spec.dim), dtype=np.float32), np.zeros(0, dtype=bool)
    S = sp.vstack(blocks, format="csr").astype(np.float32)
    return S, np.concatenate(valids)


def document_frequency(raw: sp.csr_matrix, num_layers: int, num_experts: int) -> np.ndarray:
    """df [L, E]: how many rows use (l, e). ``raw`` has all L*E columns."""
    if raw.shape[1] != num_layers * num_experts:
        raise ValueError("document_frequency needs signatures over all layers")
    nz = raw.copy()
    nz.eliminate_zeros()
    df = np.bincount(nz.indices, minlength=num_layers * num_experts)
    return df.reshape(num_layers, num_experts)


def compute_idf(df: np.ndarray, n_docs: int, plus_one: bool = True) -> np.ndarray:
    """Smoothed IDF of the ELDR paper (arXiv:2607.00466): log((|C|+1)/(df+1)), plus 1 when
    ``plus_one``.

    With ``plus_one`` an expert every request uses keeps weight 1 instead of 0; that
    matters for small models (GPT-OSS-20B: 32 experts, top-4), where long prompts touch
    almost every expert."""
    idf = np.log((n_docs + 1.0) / (np.asarray(df, dtype=np.float64) + 1.0))
    if plus_one:
        idf += 1.0
    return idf.astype(np.float32)


def raw_signatures(trace: Trace, requests=None, chunk_tokens=DEFAULT_CHUNK_TOKENS, progress=False):
    """Signatures with every layer at weight 1 and IDF 1: counts / ||counts||, [R, L*E].

    Any other layer weighting and IDF is a column scaling of these rows followed by a row
    normalisation, which layer selection uses to score many weightings cheaply."""
    core = _core()
    L, E = trace.num_layers, trace.num_experts
    spec = core.SignatureSpec(np.ones(L, dtype=np.float32), np.ones((L, E), dtype=np.float32))
    return compute_signatures(trace, spec, requests, chunk_tokens, progress, desc="prefill counts")


def make_spec(layer_weights: np.ndarray, idf: np.ndarray):
    return _core().SignatureSpec(
        np.ascontiguousarray(layer_weights, dtype=np.float32), np.ascontiguousarray(idf, dtype=np.float32)
    )


def decode_profiles(trace: Trace, requests=None, chunk_tokens=DEFAULT_CHUNK_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """Per-request decode expert usage: ([R, L, E] float32, each layer's row sums to 1
    over the experts the decode tokens chose; has_decode [R] bool)."""
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    core = _core()
    req = np.arange(trace.num_requests) if requests is None else np.asarray(requests, dtype=np.int64)
    out = np.zeros((len(req), L, E), dtype=np.float32)
    has = np.zeros(len(req), dtype=bool)
    pos = 0
    for idx, ids, offsets, _ in iter_chunks(trace, req, "decode", chunk_tokens):
        lens = np.diff(offsets)
        for j in range(len(idx)):  # the Rust counter: no [tokens, L, k] int64 key array
            if lens[j]:
                cnt = np.asarray(core.count_topk(ids[offsets[j] : offsets[j + 1]], E), dtype=np.int64)
                out[pos + j] = cnt / (int(lens[j]) * k)
        has[pos : pos + len(idx)] = lens > 0
        pos += len(idx)
    return out, has


