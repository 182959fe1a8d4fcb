"""Read SGLang's per-request routed experts into ELDR traces.

What SGLang returns (checked in the sglang 0.5.23 wheel: srt/state_capturer/base.py,
srt/state_capturer/routed_experts.py, srt/managers/tokenizer_manager.py,
srt/entrypoints/openai/protocol.py):

- The server needs `--enable-return-routed-experts`; a request asks with
  `"return_routed_experts": true` (native `/generate` and the OpenAI-compatible routes).
- Native `/generate`: `meta_info["routed_experts"]` is base64 of a flat little-endian int32
  array of shape `[rows, num_hidden_layers, top_k]` with `top_k = num_experts_per_tok`
  (fused shared experts are cut off). `rows = prompt_tokens + completion_tokens - 1 -
  routed_experts_start_len`: the capture covers token positions `[start_len, seqlen - 1)`,
  because the last generated token is never fed through the model. So the first
  `prompt_tokens - start_len` rows are the prompt (prefill) and the rest are decode steps.
- OpenAI-compatible responses carry the same string in `sglext.routed_experts`, with the
  token counts in `usage`.
- Dense (non-MoE) layers are present as all-zero columns and must be masked. Their ids are
  logical expert ids (captured in layers/moe/topk.py).

`python -m sglang.benchmark.serving --return-routed-experts` (0.5.23, checked in
sglang/benchmark/serving.py) only *asks* the server for routed experts: its client drops them,
and its `--output-file` JSONL (one summary object per run; with `--output-details` also the
per-request arrays `input_lens`, `output_lens`, `ttfts`, `itls`, `generated_texts`,
`errors`) holds no routed experts. `read_bench_serving_output` therefore reads a per-request
`routed_experts` list from such a record when a client that keeps them wrote it (the same
record with one more details array, aligned with `input_lens`/`output_lens`; the optional
patches/optional/sglang-0.5.23-bench-serving-routed-experts.patch makes the stock client do
that), and otherwise fails with an error saying what to do instead (`eldr collect`, that
patch, or save the /generate responses as JSONL).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from .format import Trace


class RoutedExpertsError(ValueError):
    """SGLang routed-experts data is malformed or does not fit the declared model."""


@dataclass
class ModelSpec:
    """What is needed to turn SGLang's `[rows, num_hidden_layers, top_k]` into a trace."""

    num_hidden_layers: int
    top_k: int
    num_experts: int
    moe_layers: list[int] | None = None  # hidden-layer indices that are MoE; None: infer
    model: str = "unknown"

    @classmethod
    def from_args(
        cls,
        num_hidden_layers: int,
        top_k: int,
        num_experts: int,
        moe_layers: Iterable[int] | None = None,
        first_k_dense_replace: int | None = None,
        model: str = "unknown",
    ) -> "ModelSpec":
        if num_hidden_layers < 1 or top_k < 1 or num_experts < 1:
            raise RoutedExpertsError("num_hidden_layers, top_k and num_experts must be >= 1")
        if top_k > num_experts:
            raise RoutedExpertsError(f"top_k={top_k} exceeds num_experts={num_experts}")
        if moe_layers is not None and first_k_dense_replace is not None:
            raise RoutedExpertsError("give moe_layers or first_k_dense_replace, not both")
        layers = None
        if first_k_dense_replace is not None:
            if not 0 <= first_k_dense_replace < num_hidden_layers:
                raise RoutedExpertsError(
                    f"first_k_dense_replace={first_k_dense_replace} must lie in [0, {num_hidden_layers})")
            layers = list(range(first_k_dense_replace, num_hidden_layers))
        elif moe_layers is not None:
            layers = sorted({int(x) for x in moe_layers})
            if not layers:
                raise RoutedExpertsError("moe_layers is empty")
            if layers[0] < 0 or layers[-1] >= num_hidden_layers:
                raise RoutedExpertsError(
                    f"moe_layers must lie in [0, {num_hidden_layers}), got {layers[0]}..{layers[-1]}")
        return cls(num_hidden_layers, top_k, num_experts, layers, model)

    @classmethod
    def preset(cls, name: str) -> "ModelSpec":
        """From the model catalogue (a name such as 'deepseek-v3', an HF id or a config.json)."""
        from eldr_sglang.models import model_shape

        s = model_shape(name)
        return cls.from_args(s["num_hidden_layers"], s["top_k"], s["num_experts"],
                             first_k_dense_replace=s["first_k_dense_replace"], model=s["hf_id"])


def decode_routed_experts(value, num_hidden_layers: int, top_k: int) -> np.ndarray:
    """int32 [rows, num_hidden_layers, top_k] from SGLang's base64 string (or a nested list)."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
            raise RoutedExpertsError(f"routed_experts is not valid base64 ({exc})") from None
        if len(raw) % 4:
            raise RoutedExpertsError(f"routed_experts holds {len(raw)} bytes, not a whole number of int32 values")
        flat = np.frombuffer(raw, dtype="<i4")
    elif isinstance(value, list):
        try:
            flat = np.asarray(value, dtype=np.int64).ravel()
        except (TypeError, ValueError) as exc:
            raise RoutedExpertsError(f"routed_experts list is not numeric ({exc})") from None
        if flat.size and (flat.min() < np.iinfo(np.int32).min or flat.max() > np.iinfo(np.int32).max):
            raise RoutedExpertsError("routed_experts list holds values outside int32")
        flat = flat.astype(np.int32)
    else:
        raise RoutedExpertsError(f"routed_experts must be a base64 string, got {type(value).__name__}")
    per_row = num_hidden_layers * top_k
    if flat.size % per_row:
        raise RoutedExpertsError(
            f"routed_experts holds {flat.size} int32 values, not divisible by "
            f"num_hidden_layers*top_k = {num_hidden_layers}*{top_k} = {per_row}; check the model settings")
    return flat.reshape(-1, num_hidden_layers, top_k)


@dataclass
class RequestRouting:
    """One request: MoE-layer ids [rows, L_moe, k] and how many rows are its prompt."""

    ids: np.ndarray
    prefill_len: int
    domain: str | None = None
    rid: str | None = None


def _moe_layers_for(arr: np.ndarray, spec: ModelSpec) -> list[int]:
    if spec.moe_layers is not None:
        return spec.moe_layers
    if spec.top_k < 2:
        raise RoutedExpertsError("with top_k=1 dense layers cannot be told apart from MoE layers; "
                                 "give moe_layers or first_k_dense_replace")
    # top-k ids of a MoE layer are distinct, so with k >= 2 only a dense layer is all zeros
    moe = [l for l in range(arr.shape[1]) if np.any(arr[:, l, :])]
    if not moe:
        raise RoutedExpertsError("every layer is all zeros: no MoE routing in this response")
    return moe


def split_request(
    arr: np.ndarray,
    prompt_tokens: int,
    completion_tokens: int,
    spec: ModelSpec,
    start_len: int = 0,
    where: str = "",
) -> RequestRouting:
    """Mask dense layers, validate ids and find the prompt/decode boundary of one response."""
    at = f"{where}: " if where else ""
    if prompt_tokens < 0 or completion_tokens < 0:
        raise RoutedExpertsError(f"{at}negative token counts")
    rows = arr.shape[0]
    expected = prompt_tokens + completion_tokens - 1 - start_len
    if rows == expected:
        prefill = prompt_tokens - start_len
    elif rows == expected + 1:  # a capture that also covers the last token
        prefill = prompt_tokens - start_len
    else:
        raise RoutedExpertsError(
            f"{at}routed_experts has {rows} rows but prompt_tokens + completion_tokens - 1"
            f"{' - start_len' if start_len else ''} = {expected}; the model settings or the "
            "token counts do not match this response")
    if prefill < 0:
        raise RoutedExpertsError(f"{at}routed_experts_start_len={start_len} exceeds prompt_tokens={prompt_tokens}")
    layers = _moe_layers_for(arr, spec)
    dense = np.setdiff1d(np.arange(spec.num_hidden_layers), layers)
    if dense.size and rows and np.any(arr[:, dense, :]):
        bad = int(dense[np.flatnonzero(np.any(arr[:, dense, :], axis=(0, 2)))[0]])
        raise RoutedExpertsError(
            f"{at}hidden layer {bad} is declared dense but holds nonzero expert ids; "
            "check moe_layers / first_k_dense_replace")
    ids = arr[:, layers, :]
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= spec.num_experts:
            raise RoutedExpertsError(
                f"{at}expert ids out of range: found {lo}..{hi}, num_experts={spec.num_experts}")
        if spec.top_k > 1:
            srt = np.sort(ids, axis=-1)
            dup = np.any(srt[..., 1:] == srt[..., :-1], axis=(0, 2))
            if np.any(dup):
                bad = layers[int(np.flatnonzero(dup)[0])]
                raise RoutedExpertsError(
                    f"{at}hidden layer {bad} repeats an expert within a token's top-k: "
                    "it is not a MoE layer or the data is corrupt")
    return RequestRouting(ids=ids, prefill_len=prefill)


def _find(d: dict, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def response_routing(resp: dict, spec: ModelSpec, start_len: int = 0, where: str = "") -> RequestRouting:
    """One /generate response (meta_info) or OpenAI-compatible response (sglext + usage)."""
    at = f"{where}: " if where else ""
    if not isinstance(resp, dict):
        raise RoutedExpertsError(f"{at}a response must be a JSON object, got {type(resp).__name__}")
    if "error" in resp and "meta_info" not in resp:
        raise RoutedExpertsError(f"{at}the response is an error: {str(resp['error'])[:200]}")
    meta = resp.get("meta_info")
    value = _find(resp, "meta_info", "routed_experts")
    counts = meta if isinstance(meta, dict) else None
    if value is None:
        value = _find(resp, "sglext", "routed_experts")
        if value is None and isinstance(resp.get("choices"), list) and resp["choices"]:
            value = _find(resp["choices"][0], "meta_info", "routed_experts")
        counts = resp.get("usage") if isinstance(resp.get("usage"), dict) else counts
    if value is None:
        raise RoutedExpertsError(
            f"{at}no routed_experts in the response; start SGLang with --enable-return-routed-experts "
            "and send \"return_routed_experts\": true")
    if not counts or "prompt_tokens" not in counts or "completion_tokens" not in counts:
        raise RoutedExpertsError(f"{at}the response lacks prompt_tokens/completion_tokens")
    arr = decode_routed_experts(value, spec.num_hidden_layers, spec.top_k)
    rr = split_request(arr, int(counts["prompt_tokens"]), int(counts["completion_tokens"]), spec, start_len, where)
    rr.rid = str(meta.get("id")) if isinstance(meta, dict) and meta.get("id") is not None else resp.get("id")
    dom = resp.get("domain")
    rr.domain = None if dom is None else str(dom)
    return rr


@dataclass
class RequestCounts:
    """One request for a trace v2: its prompt counts over the MoE layers, and optionally its
    decode routing."""

    index: np.ndarray  # int64 columns l * E + e (l: MoE layer position)
    counts: np.ndarray  # uint32, same length
    num_layers: int  # MoE layers
    prefill_len: int
    decode_len: int
    exact: bool  # False when the counts came from a log-quantized signature payload
    decode_ids: np.ndarray | None = None  # [decode_len, L, k]
    domain: str | None = None


def _signature_payload(resp: dict):
    """The `eldr_signature` payload a patched prefill puts in meta_info (or sglext)."""
    from eldr_sglang.sglang_ext.payload import META_KEY

    for where in (resp.get("meta_info"), resp.get("sglext")):
        if isinstance(where, dict) and where.get(META_KEY) is not None:
            return where[META_KEY]
    return None


def response_counts(resp: dict, spec: ModelSpec, keep_decode: bool = True, where: str = "") -> RequestCounts:
    """One response as prompt counts: from its per-token routed_experts when it has them
    (exact; decode routing kept when `keep_decode`), else from the `eldr_signature` payload
    of a patched prefill (decoded by the router's own decoder; no decode routing)."""
    from eldr_sglang import _core

    at = f"{where}: " if where else ""
    payload = _signature_payload(resp) if isinstance(resp, dict) else None
    has_ids = isinstance(resp, dict) and any(_find(resp, *p) is not None for p in (
        ("meta_info", "routed_experts"), ("sglext", "routed_experts")))
    if has_ids or payload is None:
        rr = response_routing(resp, spec, where=where)
        L = rr.ids.shape[1]
        c = np.asarray(_core.count_topk(np.ascontiguousarray(rr.ids[: rr.prefill_len]), spec.num_experts)).reshape(-1)
        nz = np.flatnonzero(c)
        return RequestCounts(nz.astype(np.int64), c[nz].astype(np.uint32), L, rr.prefill_len,
                             rr.ids.shape[0] - rr.prefill_len, True,
                             rr.ids[rr.prefill_len:].astype(np.uint8 if spec.num_experts <= 256 else np.int16)
                             if keep_decode else None, rr.domain)
    from eldr_sglang.sglang_ext.payload import PayloadError, decode_payload

    try:
        sig = decode_payload(payload)
    except PayloadError as exc:
        raise RoutedExpertsError(f"{at}bad eldr_signature payload: {exc}") from None
    if sig.counts.shape[1] != spec.num_experts:
        raise RoutedExpertsError(f"{at}eldr_signature has {sig.counts.shape[1]} experts per layer, "
                                 f"the model {spec.num_experts}")
    if spec.moe_layers is not None and list(sig.layers) != list(spec.moe_layers):
        raise RoutedExpertsError(f"{at}eldr_signature covers hidden layers {list(sig.layers)[:4]}..., "
                                 f"the model's MoE layers are {spec.moe_layers[:4]}...")
    meta = resp.get("meta_info") if isinstance(resp.get("meta_info"), dict) else resp.get("usage") or {}
    if "prompt_tokens" not in meta or "completion_tokens" not in meta:
        raise RoutedExpertsError(f"{at}the response lacks prompt_tokens/completion_tokens")
    c = np.rint(sig.counts).astype(np.uint32).reshape(-1)
    nz = np.flatnonzero(c)
    dom = resp.get("domain")
    return RequestCounts(nz.astype(np.int64), c[nz], len(sig.layers), int(meta["prompt_tokens"]),
                         max(0, int(meta["completion_tokens"]) - 1), bool(sig.exact), None,
                         None if dom is None else str(dom))


def build_trace(requests: list[RequestRouting], spec: ModelSpec, source: str, note: str = "") -> Trace:
    """Concatenate requests into a validated v1 trace (uint8 ids when E <= 256)."""
    if not requests:
        raise RoutedExpertsError("no requests: the trace would be empty")
    L = requests[0].ids.shape[1]
    for r in requests:
        if r.ids.shape[1] != L:
            raise RoutedExpertsError(
                f"requests disagree on the number of MoE layers ({r.ids.shape[1]} vs {L}); "
                "give moe_layers or first_k_dense_replace")
    dtype = np.uint8 if spec.num_experts <= 256 else np.int16
    lens = np.array([r.ids.shape[0] for r in requests], dtype=np.int64)
    off = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    ids = np.empty((int(off[-1]), L, spec.top_k), dtype=dtype)
    for r, a, b in zip(requests, off[:-1], off[1:]):
        ids[a:b] = r.ids
    domains = [r.domain for r in requests]
    layers = spec.moe_layers if spec.moe_layers is not None else None
    trace = Trace(
        expert_ids=ids,
        req_offsets=off,
        prefill_len=np.array([r.prefill_len for r in requests], dtype=np.int32),
        meta={"model": spec.model, "num_layers": L, "num_experts": spec.num_experts, "top_k": spec.top_k,
              "source": source, "note": note, "num_hidden_layers": spec.num_hidden_layers,
              **({"moe_layers": layers} if layers is not None else {})},
        domain=np.array([d if d is not None else "" for d in domains]) if any(d is not None for d in domains) else None,
    )
    trace.validate()
    return trace


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) for each non-blank line; clear errors for bad lines."""
    path = Path(path)
    if not path.exists():
        raise OSError(f"file not found: {path}")
    with open(path, "r", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as exc:
                raise RoutedExpertsError(f"{path}:{n}: not valid JSON ({exc.msg})") from None


def read_responses_jsonl(path: str | os.PathLike, spec: ModelSpec, start_len: int = 0) -> Trace:
    """A trace from a JSONL file of SGLang responses: each line a /generate response (or a
    list of them, as a batched /generate returns), or an OpenAI-compatible response. An
    optional top-level "domain" key on a response becomes its label."""
    reqs = []
    for n, obj in iter_jsonl(path):
        for i, resp in enumerate(obj if isinstance(obj, list) else [obj]):
            reqs.append(response_routing(resp, spec, start_len, where=f"{path}:{n}" + (f"[{i}]" if isinstance(obj, list) else "")))
    return build_trace(reqs, spec, source=f"sglang responses {Path(path).name}")


def read_bench_serving_output(path: str | os.PathLike, spec: ModelSpec, run: int = -1) -> Trace:
    """A trace from an `sglang.benchmark.serving --output-file` JSONL record (run `run`,
    default the last one appended). Needs per-request `routed_experts` (base64 strings, None
    for failed requests) aligned with `input_lens` and `output_lens`; see the module
    docstring for why the stock 0.5.23 client does not write them."""
    records = [obj for _, obj in iter_jsonl(path)]
    if not records:
        raise RoutedExpertsError(f"{path}: no benchmark records")
    try:
        rec = records[run]
    except IndexError:
        raise RoutedExpertsError(f"{path}: run {run} does not exist ({len(records)} records)") from None
    if not isinstance(rec, dict) or "completed" not in rec and "input_lens" not in rec:
        raise RoutedExpertsError(f"{path}: not an sglang.benchmark.serving output record")
    if "routed_experts" not in rec:
        hint = ("" if "input_lens" in rec else
                " (this record has no per-request details either: it was written without --output-details)")
        raise RoutedExpertsError(
            f"{path}: the record holds no per-request routed_experts{hint}. sglang.benchmark.serving "
            "0.5.23 sends return_routed_experts but does not store the answers; collect them with "
            "`eldr collect`, apply patches/optional/sglang-0.5.23-bench-serving-routed-experts.patch "
            "to the client, or save the /generate responses as JSONL and read those")
    re_list, ins, outs = rec["routed_experts"], rec.get("input_lens"), rec.get("output_lens")
    if not isinstance(re_list, list) or not isinstance(ins, list) or not isinstance(outs, list):
        raise RoutedExpertsError(f"{path}: routed_experts, input_lens and output_lens must be lists")
    if not len(re_list) == len(ins) == len(outs):
        raise RoutedExpertsError(
            f"{path}: routed_experts ({len(re_list)}), input_lens ({len(ins)}) and output_lens "
            f"({len(outs)}) differ in length")
    errors = rec.get("errors") or [""] * len(ins)
    reqs = []
    for i, (val, p, c) in enumerate(zip(re_list, ins, outs)):
        if val is None or (i < len(errors) and errors[i]):
            continue  # a failed request has no routing
        arr = decode_routed_experts(val, spec.num_hidden_layers, spec.top_k)
        reqs.append(split_request(arr, int(p), int(c), spec, where=f"{path}: request {i}"))
    return build_trace(reqs, spec, source=f"sglang.benchmark.serving {Path(path).name}")


def read_sglang(path: str | os.PathLike, spec: ModelSpec) -> Trace:
    """Either format, told apart by the first record."""
    for _, obj in iter_jsonl(path):
        if isinstance(obj, dict) and ("completed" in obj or "input_lens" in obj) and "meta_info" not in obj:
            return read_bench_serving_output(path, spec)
        return read_responses_jsonl(path, spec)
    raise RoutedExpertsError(f"{path}: the file is empty")
