"""Synthetic, domain-skewed MoE routing traces for named model shapes.

    from eldr_sglang.traces.synth import SynthSpec, generate, write_synth
    trace = generate(model="deepseek-v3", requests=2000, domains=8, seed=0)
    spec = SynthSpec(model="deepseek-v3", requests=2000)   # the same draws, as one value
    write_synth("trace.npz", spec, keep_decode=100)          # streamed to a v2 file

The generative model (a hierarchical "topic" model of routing):

- **Concepts.** Every layer has `C` concept distributions over its experts. Concept c at
  layer l has logits `base_l + s_l * N_lc` where `base_l = g_l * (N_l + boost * generalist)`.
  A few *generalist* experts get a large shared logit and no concept-specific part, so all
  domains use them. `s_l` (the concept spread) sets how domain-specific a layer is; the
  calibrated profile makes middle layers more specific than early/late ones.
- **Domains** are mixtures over concepts: `domain_focus` of the mass on the domain's own
  (disjoint) home concepts, the rest a sparse Dirichlet(`alpha_domain`); **requests** draw their
  own mixture around their domain's (Dirichlet with concentration `request_concentration`,
  log-normally spread across requests by `concentration_spread`: some requests stay close to
  their domain, others fixate on a few concepts). Every prompt token draws one
  concept from its request's mixture, shared by all its layers (a token's "topic"), and at
  each layer a top-k set sampled *without replacement* from that concept's distribution
  (Gumbel top-k).
- **Prefill -> decode correlation.** Decode tokens draw concepts from a mix of the request's
  own mixture (which also produced its prefill) and its domain's: `decode_mix * w_req +
  (1 - decode_mix) * w_domain`.
- **Time.** Domains follow a regime process: a regime (geometric length, mean `regime_len`
  requests) has a dominant domain, and each request is from it with probability
  `burstiness`, otherwise from the global domain mix. Arrivals are Poisson; a regime is a
  traffic burst (rate x `burst_rate`) with probability `burst_prob`; `rate` is the mean.
- **Uniform control** (`uniform=True`): the same domains, lengths and arrivals (same seed
  streams), but every token picks k experts uniformly at random: no locality at all.

Speed: each (layer, concept) gets a pool of `pool_size` pre-sampled top-k sets (exact Gumbel
top-k draws), and tokens index into the pools, so the per-token cost is a random index and a
gather of k bytes per layer. The default parameters come from `calibrate_synth.py`
(see CALIBRATED_* below).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .format import Trace, span_rows
from eldr_sglang.models import MODEL_SHAPES, model_shape  # noqa: F401  (the one model catalogue)
from eldr_sglang.workload import Workload, _lengths, synthetic_workload  # noqa: F401  (the one Workload)


# ---------------------------------------------------------------------------------------
# Calibrated defaults. Fitted by benchmarks/calibrate_synth.py against
# ../shared/traces/gptoss20b.npz; the measured statistics are in
# benchmarks/results/synth_calibration.json and .md. The per-layer profiles are given at
# evenly spaced relative depths 0..1 and interpolated for models with other layer counts.
CALIBRATED_CONCEPTS = 32
CALIBRATED_ALPHA_DOMAIN = 0.3
CALIBRATED_REQUEST_CONCENTRATION = 3.0
CALIBRATED_DECODE_MIX = 0.9
CALIBRATED_CONCENTRATION_SPREAD = 1.0
CALIBRATED_DOMAIN_FOCUS = 0.5
CALIBRATED_BASE_SCALE = (0.4519, 0.6349, 1.0096, 1.7029, 1.6876, 1.0629, 0.7888, 0.7722, 0.9241, 2.1316,
                         3.5144, 3.5144, 3.5144, 4.0, 1.1418, 0.8565, 1.3051,
                         1.6708, 0.891, 1.3108, 0.9107, 2.3616, 2.0168, 3.4822)
CALIBRATED_CONCEPT_SCALE = (1.1345, 1.8032, 2.4768, 4.4153, 4.0158, 3.3045, 2.2392, 1.842, 2.6903, 6.0938,
                            8.0, 8.0, 8.0, 8.0, 2.513, 2.0187, 2.2056, 3.5855,
                            1.9605, 3.0146, 2.4966, 6.5795, 4.1405, 7.9199)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SynthParams:
    """Routing-model parameters (see the module docstring). Defaults are the calibrated ones."""

    concepts: int = CALIBRATED_CONCEPTS
    alpha_domain: float = CALIBRATED_ALPHA_DOMAIN
    request_concentration: float = CALIBRATED_REQUEST_CONCENTRATION
    decode_mix: float = CALIBRATED_DECODE_MIX
    concentration_spread: float = CALIBRATED_CONCENTRATION_SPREAD  # log-normal s.d. of per-request concentration
    domain_focus: float = CALIBRATED_DOMAIN_FOCUS  # mass of a domain's mixture on its own "home" concepts
    generalist_frac: float = 1.0 / 16.0
    generalist_boost: float = 1.5
    base_scale: tuple = CALIBRATED_BASE_SCALE
    concept_scale: tuple = CALIBRATED_CONCEPT_SCALE
    pool_size: int = 256

    def validate(self) -> None:
        if self.concepts < 1:
            raise ValueError(f"concepts must be >= 1, got {self.concepts}")
        for name in ("alpha_domain", "request_concentration"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.concentration_spread <= 5.0:
            raise ValueError(f"concentration_spread must lie in [0, 5], got {self.concentration_spread}")
        if not 0.0 <= self.domain_focus <= 1.0:
            raise ValueError(f"domain_focus must lie in [0, 1], got {self.domain_focus}")
        if not 0.0 <= self.decode_mix <= 1.0:
            raise ValueError(f"decode_mix must lie in [0, 1], got {self.decode_mix}")
        if not 0.0 <= self.generalist_frac < 1.0:
            raise ValueError(f"generalist_frac must lie in [0, 1), got {self.generalist_frac}")
        if len(self.base_scale) < 1 or len(self.concept_scale) < 1:
            raise ValueError("base_scale and concept_scale profiles must not be empty")
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")

    def layer_profile(self, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """(g_l, s_l) for each of num_layers layers, interpolated over relative depth."""
        x = np.linspace(0.0, 1.0, num_layers) if num_layers > 1 else np.array([0.5])
        def interp(p):
            p = np.asarray(p, dtype=np.float64)
            return np.interp(x, np.linspace(0.0, 1.0, len(p)), p) if len(p) > 1 else np.full(num_layers, p[0])
        return interp(self.base_scale), interp(self.concept_scale)


# ------------------------------------------------------------------------------ routing
def topk_of_scores(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries along the last axis, largest first."""
    part = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(scores, part, axis=-1), axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def gumbel_topk(logits: np.ndarray, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n top-k sets sampled without replacement from softmax(logits), for each row of
    logits [..., E] -> int [..., n, k], ordered by decreasing perturbed score."""
    E = logits.shape[-1]
    g = rng.random(size=logits.shape[:-1] + (n, E), dtype=np.float32)  # float32: 5x faster
    np.maximum(g, np.float32(1e-38), out=g)
    np.log(g, out=g)
    np.negative(g, out=g)
    np.log(g, out=g)
    np.negative(g, out=g)  # standard Gumbel
    g += logits.astype(np.float32)[..., None, :]
    return topk_of_scores(g, k)


@dataclass
class RoutingModel:
    """One synthetic model instance: standard-normal draws plus the per-layer scales.

    Concept c at layer l has logits g_l * (base_noise[l] + boost * generalist[l])
    + s_l * concept_noise[l, c] * ~generalist[l]."""

    base_noise: np.ndarray  # [L, E]
    concept_noise: np.ndarray  # [L, C, E]
    generalist: np.ndarray  # bool [L, E]
    g: np.ndarray  # [L]
    s: np.ndarray  # [L]
    boost: float

    @classmethod
    def sample(cls, num_layers: int, num_experts: int, params: SynthParams, rng: np.random.Generator) -> "RoutingModel":
        L, E, C = num_layers, num_experts, params.concepts
        g, s = params.layer_profile(L)
        n_gen = min(E - 1, max(1, int(round(params.generalist_frac * E)))) if params.generalist_frac > 0 else 0
        gen = np.zeros((L, E), dtype=bool)
        for l in range(L):
            gen[l, rng.choice(E, size=n_gen, replace=False)] = True
        return cls(base_noise=rng.standard_normal((L, E)), concept_noise=rng.standard_normal((L, C, E)),
                   generalist=gen, g=g, s=s, boost=params.generalist_boost)

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int) -> "RoutingModel":
        L, E = num_layers, num_experts
        return cls(base_noise=np.zeros((L, E)), concept_noise=np.zeros((L, 1, E)),
                   generalist=np.zeros((L, E), dtype=bool), g=np.zeros(L), s=np.zeros(L), boost=0.0)

    def layer_logits(self, layer: int, g: float | None = None, s: float | None = None) -> np.ndarray:
        """[C, E] concept logits of one layer (g, s override the layer's own scales)."""
        g = self.g[layer] if g is None else g
        s = self.s[layer] if s is None else s
        gen = self.generalist[layer]
        base = g * (self.base_noise[layer] + self.boost * gen)
        return base[None, :] + s * self.concept_noise[layer] * ~gen[None, :]

    def pools(self, layer: int, k: int, pool_size: int, rng: np.random.Generator) -> np.ndarray:
        """[C * pool_size, k] pre-sampled top-k sets of one layer (row c*P + j: concept c)."""
        return gumbel_topk(self.layer_logits(layer), k, pool_size, rng).reshape(-1, k)


def _row_view(a: np.ndarray) -> np.ndarray:
    """View the last axis of a C-contiguous array as one scalar per row (fast gathers)."""
    nbytes = a.shape[-1] * a.itemsize
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(nbytes, np.dtype(f"V{nbytes}"))
    return np.ascontiguousarray(a).view(dt)[..., 0]


def _dirichlet(alpha: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Row-wise Dirichlet that stays finite for tiny concentrations."""
    x = rng.gamma(np.maximum(alpha, 1e-3))
    s = x.sum(axis=-1, keepdims=True)
    bad = s[..., 0] <= 0
    if np.any(bad):
        x[bad] = alpha[bad] if alpha.ndim == x.ndim else 1.0
        s = x.sum(axis=-1, keepdims=True)
    return x / s


def domain_mixtures(D: int, params: SynthParams, rng: np.random.Generator) -> np.ndarray:
    """[D, C] concept mixtures: domain_focus of the mass on the domain's own home concepts
    (a disjoint share of the concepts, Dirichlet(1) inside), the rest Dirichlet(alpha_domain)
    over all concepts. Disjoint homes keep how distinct the domains are stable from seed to
    seed; a plain sparse Dirichlet makes it a lottery of overlaps."""
    C = params.concepts
    spread = _dirichlet(np.full((D, C), params.alpha_domain), rng)
    if params.domain_focus <= 0:
        return spread
    perm = rng.permutation(C)
    home = np.zeros((D, C))
    for d in range(D):
        own = perm[d::D] if D <= C else perm[[d % C]]
        home[d, own] = rng.gamma(1.0, size=len(own))
        home[d] /= home[d].sum()
    return params.domain_focus * home + (1.0 - params.domain_focus) * spread


def _draw_concepts(W: np.ndarray, row: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """int32 [len(row)]: token t draws a concept from the mixture W[row[t]] ([n, C] rows)."""
    n, C = W.shape
    cdf = np.cumsum(W, axis=1)
    cdf /= cdf[:, -1:]
    flat = (cdf + np.arange(n)[:, None]).ravel()
    u = rng.random(row.size)
    idx = np.searchsorted(flat, row + u, side="right")
    return np.minimum(idx - row * C, C - 1).astype(np.int32)


def request_mixtures(domain: np.ndarray, w_dom: np.ndarray, params: SynthParams,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """([n, C] prefill, [n, C] decode) concept mixtures of requests from these domains: the
    request's own mixture around its domain's, and decode_mix * own + (1 - decode_mix) * domain."""
    conc = params.request_concentration * np.exp(params.concentration_spread * rng.standard_normal(len(domain)))
    w_req = _dirichlet(conc[:, None] * w_dom[domain] + 1e-6, rng)
    w_dec = params.decode_mix * w_req + (1.0 - params.decode_mix) * w_dom[domain]
    return w_req, w_dec


def token_concepts(wl: Workload, params: SynthParams, rng: np.random.Generator,
                   w_dom: np.ndarray | None = None) -> np.ndarray:
    """int32 [T]: the concept of every token row of a whole workload, from one stream (prefill
    rows draw from the request's own mixture, decode rows from its decode mixture). The domain
    mixtures are drawn from rng first unless given. (The calibration's path; generate() draws
    per block of requests, see _block_ids.)"""
    D, R = len(wl.domain_weights), len(wl.domain)
    if w_dom is None:
        w_dom = domain_mixtures(D, params, rng)
    w_req, w_dec = request_mixtures(wl.domain, w_dom, params, rng)
    lens = wl.prefill_len + wl.decode_len
    req = np.repeat(np.arange(R, dtype=np.int64), lens)
    pos = np.arange(req.size, dtype=np.int64) - wl.req_offsets[req]
    row = np.where(pos < wl.prefill_len[req], req, req + R)  # rows 0..R-1 prefill, R..2R-1 decode
    return _draw_concepts(np.concatenate([w_req, w_dec]), row, rng)


@dataclass(frozen=True)
class SynthSpec:
    """What a synthetic trace is drawn from: the model shape, the workload and the routing
    parameters. generate(), iter_generate() and write_synth() take one (or its fields by
    name); the same spec, the same requests and routing.

    prompt_len: a number (the mean of a gamma(4) length distribution), a (lo, hi) pair
    (uniform, inclusive) or one integer per request. output_len: a number (every request
    decodes exactly that many tokens), a (lo, hi) pair or one integer per request. The
    regime and burst fields are described in the module doc."""

    model: str = "gpt-oss-20b"
    requests: int = 1000
    domains: int = 8
    uniform: bool = False
    seed: int = 0
    prompt_len: Any = (128, 512)
    output_len: Any = 256
    burstiness: float = 0.7
    rate: float = 4.0
    regime_len: float = 64.0
    burst_prob: float = 0.3
    burst_rate: float = 3.0
    domain_weights: Sequence[float] | None = None
    params: SynthParams | None = None

    @classmethod
    def of(cls, spec: "SynthSpec | str | None" = None, **fields) -> "SynthSpec":
        """`spec` (a SynthSpec, a model name, or None for the defaults) with `fields` replaced."""
        if spec is None:
            spec = cls()
        elif isinstance(spec, str):
            spec = cls(model=spec)
        return dataclasses.replace(spec, **fields) if fields else spec


# Requests drawn together from one random stream: generate(), iter_generate() and
# write_synth() all draw block by block, so a request's routing depends on the seed and its
# block only, not on how the output is chunked or how many requests keep decode routing.
RNG_BLOCK = 1024


@dataclass
class _Setup:
    shape: dict
    params: SynthParams
    wl: Workload
    model: RoutingModel
    pools: list
    dtype: type
    meta: dict
    names: np.ndarray
    w_dom: np.ndarray | None  # [D, C] domain mixtures; None for the uniform control
    seed: int

    @property
    def num_blocks(self) -> int:
        return -(-len(self.wl.domain) // RNG_BLOCK)


def _setup(spec: SynthSpec, check: Callable | None = None) -> _Setup:
    """The workload, the routing model and its pools; `check(workload, shape)` runs between
    the two (the memory check, before the expensive part)."""
    shape = model_shape(spec.model)
    params = spec.params or SynthParams()
    params.validate()
    L, E, k = shape["num_layers"], shape["num_experts"], shape["top_k"]
    ss = np.random.SeedSequence(int(spec.seed))
    rng_work, rng_model, rng_concept, rng_pool, _ = (np.random.default_rng(s) for s in ss.spawn(5))
    wl = synthetic_workload(spec.requests, spec.domains, rng_work, spec.prompt_len, spec.output_len, spec.burstiness,
                            spec.rate, spec.regime_len, spec.burst_prob, spec.burst_rate, spec.domain_weights)
    if check is not None:
        check(wl, shape)
    dtype = np.uint8 if E <= 256 else np.int16
    rm = RoutingModel.uniform(L, E) if spec.uniform else RoutingModel.sample(L, E, params, rng_model)
    P = params.pool_size
    pools = [_row_view(rm.pools(l, k, P, rng_pool).astype(dtype)) for l in range(L)]
    w_dom = None if spec.uniform else domain_mixtures(len(wl.domain_weights), params, rng_concept)
    meta = {
        "model": shape["hf_id"],
        "num_layers": L,
        "num_experts": E,
        "top_k": k,
        "source": "eldr synth",
        "note": ("synthetic uniform (no-locality) control" if spec.uniform else
                 "synthetic domain-skewed routing; domain labels are for evaluation only"),
        "synth": {
            "model": spec.model, "requests": int(spec.requests), "domains": int(spec.domains),
            "uniform": bool(spec.uniform), "seed": int(spec.seed), "burstiness": float(spec.burstiness),
            "rate": float(spec.rate), "regime_len": float(spec.regime_len), "burst_prob": float(spec.burst_prob),
            "burst_rate": float(spec.burst_rate), "params": dataclasses.asdict(params), "rng_block": RNG_BLOCK,
        },
    }
    names = np.array([f"domain{d}" for d in range(spec.domains)])
    return _Setup(shape, params, wl, rm, pools, dtype, meta, names, w_dom, int(spec.seed))


def _fill(st: _Setup, tok_c: np.ndarray, rng_tok: np.random.Generator, progress=None,
          chunk_tokens: int = 1 << 20) -> np.ndarray:
    """[T, L, k] ids: every token row gathers a pre-sampled top-k set of its concept's pool."""
    L, k = st.shape["num_layers"], st.shape["top_k"]
    T, P = tok_c.size, st.params.pool_size
    ids = np.empty((T, L, k), dtype=st.dtype)
    if T == 0:
        return ids
    rows = _row_view(ids.reshape(T * L, k)).reshape(T, L)
    base_idx = tok_c.astype(np.int64) * P
    # gathered layer-major into a contiguous buffer, then transposed once: about 2x faster
    # than gathering into the strided column rows[:, l] (the draws are the same)
    by_layer = np.empty((L, min(T, chunk_tokens)), dtype=rows.dtype)
    for start in range(0, T, chunk_tokens):
        stop = min(T, start + chunk_tokens)
        b = base_idx[start:stop]
        buf = by_layer[:, : stop - start]
        for l in range(L):
            j = rng_tok.integers(0, P, size=stop - start, dtype=np.int64)
            j += b
            np.take(st.pools[l], j, out=buf[l])
        rows[start:stop] = buf.T
        if progress is not None:
            progress(stop - start)
    return ids


def _block_span(st: _Setup, i: int) -> tuple[int, int]:
    return i * RNG_BLOCK, min(len(st.wl.domain), (i + 1) * RNG_BLOCK)


def _block_ids(st: _Setup, i: int, decode: bool = True, progress=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Block i's prompt ids [sum prefill_len, L, k] and, when `decode`, its decode ids
    [sum decode_len, L, k], requests in order. Three streams per block (request mixtures,
    prompt tokens, decode tokens), so the prompts are the same whether decode is drawn or not."""
    a, b = _block_span(st, i)
    rng_mix, rng_pre, rng_dec = (np.random.default_rng(s) for s in np.random.SeedSequence([st.seed, 2, i]).spawn(3))
    wl = st.wl
    n = b - a
    parts = []
    lens_of = [wl.prefill_len[a:b]] + ([wl.decode_len[a:b]] if decode else [])
    if st.w_dom is not None:
        mixtures = request_mixtures(wl.domain[a:b], st.w_dom, st.params, rng_mix)
    for part, (lens, rng) in enumerate(zip(lens_of, (rng_pre, rng_dec))):
        row = np.repeat(np.arange(n, dtype=np.int64), lens)
        tok_c = np.zeros(row.size, dtype=np.int32) if st.w_dom is None else _draw_concepts(mixtures[part], row, rng)
        parts.append(_fill(st, tok_c, rng, progress))
    return parts[0], (parts[1] if decode else None)


def _block_trace(st: _Setup, i: int, progress=None) -> Trace:
    """Block i as a v1 trace (prompt rows, then decode rows, of each request)."""
    a, b = _block_span(st, i)
    wl = st.wl
    pre, dec = _block_ids(st, i, True, progress)
    pl, dl = wl.prefill_len[a:b], wl.decode_len[a:b]
    off = np.zeros(b - a + 1, dtype=np.int64)
    np.cumsum(pl + dl, out=off[1:])
    ids = np.empty((int(off[-1]),) + pre.shape[1:], dtype=st.dtype)
    ids[span_rows(off[:-1], pl)] = pre
    ids[span_rows(off[:-1] + pl, dl)] = dec
    return Trace(expert_ids=ids, req_offsets=off, prefill_len=pl.astype(np.int32), meta=st.meta,
                 domain=st.names[wl.domain[a:b]], arrival_s=wl.arrival_s[a:b].astype(np.float64))


def _concat(traces: list[Trace], meta: dict) -> Trace:
    """Consecutive traces joined into one."""
    lens = np.concatenate([t.request_len() for t in traces])
    off = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    return Trace(expert_ids=np.concatenate([t.expert_ids for t in traces]), req_offsets=off,
                 prefill_len=np.concatenate([t.prefill_len for t in traces]), meta=meta,
                 domain=np.concatenate([t.domain for t in traces]),
                 arrival_s=np.concatenate([t.arrival_s for t in traces]))


def generate(spec: SynthSpec | str | None = None, /, *, progress: Callable[[int], None] | None = None,
             **fields) -> Trace:
    """A synthetic trace (ELDR v1, in memory) with domain labels and arrival times, drawn from
    `spec` (a SynthSpec, or a model name) with `fields` (SynthSpec's, by name) replaced.

    `progress(n)` is called with the number of token rows just finished. For request counts
    whose tokens do not fit in memory, write_synth() streams the same draws to a v2 file
    (the draws go by blocks of RNG_BLOCK requests).
    """
    st = _setup(SynthSpec.of(spec, **fields))
    wl = st.wl
    off = wl.req_offsets
    ids = np.empty((int(off[-1]), st.shape["num_layers"], st.shape["top_k"]), dtype=st.dtype)
    for i in range(st.num_blocks):
        a, b = _block_span(st, i)
        blk = _block_trace(st, i, progress)
        ids[off[a] : off[b]] = blk.expert_ids
    return Trace(
        expert_ids=ids,
        req_offsets=off,
        prefill_len=wl.prefill_len.astype(np.int32),
        meta=st.meta,
        domain=st.names[wl.domain],
        arrival_s=wl.arrival_s.astype(np.float64),
    )


def iter_generate(spec: SynthSpec | str | None = None, /, *, chunk_requests: int = 10000,
                  **fields) -> Iterator[Trace]:
    """generate()'s trace (same spec and seed: the same requests and routing) as a stream of
    v1 traces of at most `chunk_requests` requests each. Memory: one chunk plus one block of
    RNG_BLOCK requests."""
    if chunk_requests < 1:
        raise ValueError(f"chunk_requests must be >= 1, got {chunk_requests}")
    st = _setup(SynthSpec.of(spec, **fields))
    R = len(st.wl.domain)
    pending: list[Trace] = []
    have = 0
    ci = 0
    first = 0
    for i in range(st.num_blocks):
        pending.append(_block_trace(st, i))
        have += pending[-1].num_requests
        while have >= chunk_requests or (i == st.num_blocks - 1 and have > 0):
            joined = _concat(pending, st.meta)
            n = min(chunk_requests, have)
            meta = dict(st.meta)
            meta["synth"] = {**st.meta["synth"], "chunk": ci, "first_request": first, "chunk_requests": chunk_requests}
            chunk = joined.subset(np.arange(n))
            chunk.meta = meta
            yield chunk
            ci += 1
            first += n
            have -= n
            pending = [joined.subset(np.arange(n, joined.num_requests))] if have else []
    assert first == R


def _block_record(st: _Setup, i: int, keep: int):
    """Block i as written to a v2 file: (prompt counts CSR, decode routing of its requests
    below `keep` or None, token rows drawn). Depends on the setup and i only."""
    from .counts_file import prefill_counts

    a, b = _block_span(st, i)
    wl = st.wl
    pre, dec = _block_ids(st, i, decode=keep > a)
    rows = pre.shape[0] + (0 if dec is None else dec.shape[0])
    pl, dl = wl.prefill_len[a:b], wl.decode_len[a:b]
    p_off = np.zeros(b - a + 1, dtype=np.int64)
    np.cumsum(pl, out=p_off[1:])
    counts = prefill_counts(pre, p_off, pl, st.shape["num_experts"])
    del pre
    decode = None
    if dec is not None:
        m = min(b, keep) - a
        d_off = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(dl[:m], out=d_off[1:])
        decode = (np.arange(m, dtype=np.int64), d_off, dec[: d_off[-1]])
    return counts, decode, rows


MIN_BLOCKS_PER_JOB = 4  # fewer blocks than this per worker: not worth starting processes (about 1 s each)

# A worker process of write_synth(jobs > 1): it rebuilds the same setup from the same
# spec (everything in it is drawn from the seed) and computes whole blocks.
_WORKER: dict = {}


def _worker_init(spec: SynthSpec, keep: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _WORKER["st"], _WORKER["keep"] = _setup(spec), keep


def _worker_block(i: int):
    return _block_record(_WORKER["st"], i, _WORKER["keep"])


def synth_jobs(jobs: int | None) -> int:
    """Worker processes for write_synth: `jobs`, or (None) one per CPU this process may use."""
    import os

    if jobs is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)
    if int(jobs) != jobs or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    return int(jobs)


def _records(st: _Setup, spec: SynthSpec, keep: int, jobs: int):
    """Every block's record, in block order: computed here (jobs = 1) or by `jobs` worker
    processes, at most 2 blocks per worker in flight (bounded memory). Block i's draws come
    from its own seeded streams, so the records, and the file, are the same either way."""
    n = st.num_blocks
    jobs = min(jobs, n // MIN_BLOCKS_PER_JOB)
    if jobs <= 1:
        for i in range(n):
            yield _block_record(st, i, keep)
        return
    import multiprocessing as mp
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn, not fork: the parent may hold threads (a progress bar's, BLAS's)
    pool = ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                               initargs=(spec, keep))
    try:
        pending: deque = deque()
        nxt = 0
        while nxt < n or pending:
            while nxt < n and len(pending) < 2 * jobs:
                pending.append(pool.submit(_worker_block, nxt))
                nxt += 1
            try:
                rec = pending.popleft().result()
            except BrokenProcessPool as exc:  # a worker was killed (the OOM killer, a signal)
                raise OSError(f"a synth worker process died ({exc}); nothing was written") from None
            yield rec
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def write_synth(
    path,
    spec: SynthSpec | str | None = None,
    /,
    *,
    keep_decode: int | None = 0,
    progress: Callable[[int], None] | None = None,
    max_memory: int | None = None,
    jobs: int | None = 1,
    **fields,
):
    """Stream generate()'s trace (same spec, same seed, same routing) to a v2 file at `path`:
    each request's prompt counts, and the decode routing of the first `keep_decode` requests
    (None: all). `spec` and `fields` as for generate(). Memory: the per-request arrays plus
    one block of RNG_BLOCK requests per job (two in flight); checked up front
    (eldr_sglang.memory), so a run too large is refused before it starts. `jobs` worker
    processes (None: one per CPU) draw the blocks in parallel; the file is byte-for-byte the
    same for any `jobs`. `progress(n)` gets the token rows of each block written. Returns the
    path."""
    from eldr_sglang import memory

    from .counts_file import CountsTraceWriter

    jobs = synth_jobs(jobs)

    def check(wl: Workload, shape: dict) -> None:
        R = len(wl.domain)
        keep = R if keep_decode is None else max(0, min(int(keep_decode), R))
        per_block = np.add.reduceat(wl.prefill_len + wl.decode_len * (np.arange(R) < keep), np.arange(0, R, RNG_BLOCK))
        memory.require(memory.streaming_synth_bytes(R, int(per_block.max()), shape["num_layers"], shape["top_k"],
                                                    shape["num_experts"], RNG_BLOCK,
                                                    jobs=min(jobs, len(per_block) // MIN_BLOCKS_PER_JOB)),
                       f"synth of {R} requests", max_memory)

    spec = SynthSpec.of(spec, **fields)
    st = _setup(spec, check)
    wl = st.wl
    R = len(wl.domain)
    keep = R if keep_decode is None else max(0, min(int(keep_decode), R))
    L, k, E = st.shape["num_layers"], st.shape["top_k"], st.shape["num_experts"]
    meta = {k_: v for k_, v in st.meta.items() if k_ not in ("num_layers", "num_experts", "top_k")}
    meta["synth"] = {**meta["synth"], "keep_decode": keep}
    with CountsTraceWriter(path, num_layers=L, num_experts=E, top_k=k, meta=meta) as w:
        for i, (counts, decode, rows) in enumerate(_records(st, spec, keep, jobs)):
            a, b = _block_span(st, i)
            w.write_chunk(counts, wl.prefill_len[a:b], wl.decode_len[a:b], domain=st.names[wl.domain[a:b]],
                          arrival_s=wl.arrival_s[a:b], decode=decode)
            if progress is not None:
                progress(rows)
    return path


def workload_like(trace: Trace) -> dict:
    """generate() keyword arguments (SynthSpec fields) that copy a trace's workload (request
    count, prompt and decode lengths, number of domains and their request shares), not its
    routing. Used to compare a synthetic trace with a real one under the same lengths and
    domain mix."""
    if trace.domain is None:
        raise ValueError("the trace has no domain labels")
    names, inv = np.unique(trace.domain, return_inverse=True)
    counts = np.bincount(inv, minlength=len(names)).astype(np.float64)
    return {
        "requests": trace.num_requests,
        "domains": len(names),
        "domain_weights": np.sort(counts)[::-1] / counts.sum(),
        "prompt_len": trace.prefill_len.astype(np.int64),
        "output_len": trace.decode_len().astype(np.int64),
    }


