"""What the patched SGLang 0.5.23 calls. Each function is a no-op unless the server runs with
`--enable-eldr-signature` in prefill mode, so the patch costs one attribute read when off.

Call sites (patches/sglang-0.5.23):
- `install(model_runner)`        ModelRunner init, next to the routed-experts capturer
- `begin_forward(runner, batch)` ModelRunner.forward, before the model runs
- `capture(layer_id, topk_ids)`  layers/moe/topk.py `capture_routed_experts_if_allowed`
- `emit(scheduler, reqs)`        disaggregation/prefill.py, when requests finish prefill
                                 (before their KV is sent)
- `openai_chunk(content, seen)`  OpenAI chat/completions streaming: forward the payload
- `resolve_late_binding(args)`   arg_groups/pd_disaggregation_hook.py
- `status()` / `merge_status()`  Scheduler / DataParallelController `get_init_info`: the
                                 `eldr_signature` field of `/server_info` ("on" or "off (reason)")

Parallel layouts. The rows a MoE layer's top-k covers are mapped to this rank's tokens the way
SGLang's own per-request capture (`state_capturer/routed_experts.py`, RoutedExpertsCapturer)
reads them, with its helpers:
- TP, EP without DeepEP, multi-node TP: every rank sees all of its DP group's tokens;
- DP attention: the rows of all DP ranks are gathered; this rank's tokens start where
  `get_dp_local_slice_cpu` says (read at the first MoE layer, once SGLang has padded them);
- DeepEP (and DeepEP v2), normal and low-latency: each attention-TP rank holds a slice of the
  tokens; they are all-gathered over the attention-TP group (`attn_tp_all_gather_into_tensor`,
  the capturer's own call) and then start at row 0.
The ids are logical (the capture site precedes the EPLB logical-to-physical map), so EPLB and
redundant experts never change a count. One rank per DP group (the scheduler's rank zero) sends
outputs, and it holds that group's requests' full counts. Layouts where that is not so are
refused at start-up (`layout_refusal`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from eldr_sglang.sglang_ext.payload import DEFAULT_MAX_BYTES, META_KEY, PAYLOAD_VERSION, encode_counts

logger = logging.getLogger(__name__)

ACCUMULATOR = None  # CountsAccumulator of this process, or None
MAX_BYTES = DEFAULT_MAX_BYTES
STATUS = "off (--enable-eldr-signature not set)"  # what /server_info reports as eldr_signature
_GATHER: Callable[[Any], Any] | None = None  # DeepEP: top-k rows -> the attention-TP group's rows
_DP_SLICE: Callable[[Any], int] | None = None  # DP attention: forward batch -> this rank's first row
_EXTEND_MODES = ("EXTEND", "MIXED", "SPLIT_PREFILL")


# --------------------------------------------------------------------------- model shape
def moe_layer_ids(hf_config: Any) -> list[int]:
    """Hidden-layer ids that hold a routed MoE block, from a HF text config."""
    n = int(hf_config.num_hidden_layers)
    if getattr(hf_config, "first_k_dense_replace", None) is not None:  # DeepSeek V2/V3, Kimi
        first = int(hf_config.first_k_dense_replace)
        freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        return [l for l in range(n) if l >= first and l % freq == 0]
    if getattr(hf_config, "decoder_sparse_step", None) is not None:  # Qwen2/3 MoE
        step = int(hf_config.decoder_sparse_step or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        return [l for l in range(n) if l not in dense and (l + 1) % step == 0]
    return list(range(n))  # GPT-OSS, Mixtral, ...: every layer is MoE


def num_routed_experts(hf_config: Any) -> int:
    for key in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError("cannot tell the number of routed experts from the model config")


def _flag(name: str, default: Any = False) -> Any:
    from sglang.srt.runtime_context import get_disagg

    return getattr(get_disagg(), name, default)


# --------------------------------------------------------------------------- layout
def layout_refusal(args: Mapping[str, Any]) -> str | None:
    """Why a server with these (resolved) arguments cannot attribute expert counts to its
    requests, naming the flag; None when it can."""
    if not args.get("enable_eldr_signature"):
        return "--enable-eldr-signature not set"
    mode = args.get("disaggregation_mode", "null")
    if mode != "prefill":
        return f"--disaggregation-mode {mode}: signatures are made by prefill servers"
    pp = int(args.get("pp_size") or 1)
    if pp > 1:
        return f"--pp-size {pp}: each pipeline stage sees only its own layers' experts"
    cp = int(args.get("attn_cp_size") or 1)
    if cp > 1:
        return f"--attn-cp-size {cp}: context parallelism splits a request's tokens across ranks"
    if args.get("enable_two_batch_overlap"):
        return "--enable-two-batch-overlap: each MoE layer's top-k ids arrive in two micro-batches"
    return None


def status() -> str:
    """This process's `eldr_signature` for /server_info: "on", or "off (reason)"."""
    return STATUS


def merge_status(statuses) -> str:
    """One `eldr_signature` for a server of several schedulers (DP ranks): "on" only if all are."""
    vals = [s for s in statuses if isinstance(s, str)]
    off = [s for s in vals if s != "on"]
    if off:
        return off[0]
    return "on" if vals else "off (no scheduler reported a signature status)"


def _off(reason: str, asked: bool) -> None:
    global STATUS
    STATUS = f"off ({reason})"
    if asked:  # one line, naming the flag; silent on servers that never asked for signatures
        logger.warning("ELDR signature off: %s; the router routes this server's requests without one", reason)


def _attn_tp_gather(buf, tp: int, gather_into: Callable[[Any, Any], Any]) -> Callable[[Any], Any]:
    """DeepEP scatters a forward's tokens over the attention-TP ranks: rebuild the group's rows
    with SGLang's own all-gather into a fixed buffer (graph-safe). Every rank of the group
    calls it at every MoE layer, as RoutedExpertsCapturer.capture does; None when the rows
    outgrow the buffer (the forward is then refused, on every rank alike)."""
    import torch

    def gather(local):
        n, w = int(local.shape[0]), int(local.shape[1])
        if n * tp * w > buf.numel():
            return None
        out = buf[: n * tp * w].view(n * tp, w)
        gather_into(out, local.to(torch.int32).contiguous())
        return out

    return gather


# --------------------------------------------------------------------------- install
class _Off(Exception):
    """Why the signature stays off on this server (the reason `_off` logs)."""


def install(model_runner: Any) -> None:
    """Create this process's accumulator when the server is an ELDR prefill worker whose
    layout can be attributed; otherwise set STATUS to "off (reason)" and say so once."""
    global ACCUMULATOR, MAX_BYTES, STATUS
    if getattr(model_runner, "is_draft_worker", False):
        return
    if not _asked():  # the common case on every other server: nothing more is read, nothing logged
        _off("--enable-eldr-signature not set", False)
        return
    try:
        get_parallel, get_schedule = _runtime_context()
        from eldr_sglang.sglang_ext.accumulator import CountsAccumulator  # torch, on a server that asked

        hf = model_runner.model_config.hf_text_config
        moe_layers, num_experts = _routed_experts(hf)
        par = _parallel_layout(get_parallel)
    except _Off as why:
        _off(str(why), True)
        return
    sched = get_schedule()
    max_tokens = max(
        int(getattr(sched, "chunked_prefill_size", 0) or 0),
        int(getattr(sched, "max_prefill_tokens", 0) or 0),
        8192,
    )
    top_k = int(getattr(hf, "num_experts_per_tok", 8))
    max_rows = _capture_rows(model_runner, par, max_tokens, top_k)
    pool = model_runner.req_to_token_pool
    MAX_BYTES = int(_flag("eldr_signature_max_bytes", DEFAULT_MAX_BYTES))
    ACCUMULATOR = CountsAccumulator(
        num_hidden_layers=int(hf.num_hidden_layers),
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        max_slots=int(pool.req_to_token.shape[0]),
        max_tokens=max_tokens,
        max_rows=max_rows,
        device=model_runner.device,
    )
    STATUS = "on"
    layout = "DeepEP rows gathered over attention TP" if par.scattered else (
        f"DP attention, {par.dp_ranks} DP ranks" if par.dp_attention else "all rows local")
    logger.info(
        "ELDR signature on: %d MoE layers x %d experts, %d slots, %d tokens per forward, payload <= %d bytes, %s",
        len(ACCUMULATOR.moe_layers), ACCUMULATOR.num_experts, ACCUMULATOR.max_slots, max_tokens, MAX_BYTES, layout,
    )


def _asked() -> bool:
    """Whether this server was started with --enable-eldr-signature."""
    try:
        return bool(_flag("enable_eldr_signature"))
    except Exception:  # not a server process of the patched series
        return False


def _runtime_context():
    """(get_parallel, get_schedule) of SGLang's runtime context, once the server's layout is
    one the signature can attribute; raises _Off otherwise."""
    try:
        from sglang.srt.runtime_context import get_parallel, get_schedule, get_server_args

        reason = layout_refusal(get_server_args().resolved_dict())
    except Exception as exc:  # a layout this module does not know: stay off, loudly
        raise _Off(f"cannot read the server's layout: {exc}") from None
    if reason is not None:
        raise _Off(reason)
    return get_parallel, get_schedule


def _routed_experts(hf) -> tuple[list[int], int]:
    """(MoE layer ids, routed experts per layer) of the model's config; raises _Off."""
    try:
        return moe_layer_ids(hf), num_routed_experts(hf)
    except (ValueError, AttributeError, TypeError) as exc:  # not an MoE model, or an unknown config
        raise _Off(f"--enable-eldr-signature on a model without routed experts: {exc}") from None


@dataclass(frozen=True)
class _Parallel:
    scattered: bool  # DeepEP: a rank's capture site sees only its share of the group's rows
    dp_attention: bool
    attn_tp: int
    dp_ranks: int
    gather_into: Callable[[Any, Any], Any]  # SGLang's attention-TP all-gather
    dp_local_slice: Callable[..., Any]


def _parallel_layout(get_parallel) -> _Parallel:
    """How the server spreads a forward's rows over its ranks; raises _Off."""
    try:
        from sglang.srt.layers.dp_attention import (
            attn_tp_all_gather_into_tensor,
            get_dp_local_slice_cpu,
            is_dp_attention_enabled,
        )
        from sglang.srt.state_capturer.routed_experts import _is_scattered_a2a_backend

        parallel = get_parallel()
        return _Parallel(bool(_is_scattered_a2a_backend()), bool(is_dp_attention_enabled()), int(parallel.attn_tp_size),
                         int(parallel.num_dp_ranks), attn_tp_all_gather_into_tensor, get_dp_local_slice_cpu)
    except Exception as exc:
        raise _Off(f"cannot read the parallel layout: {exc}") from None


def _capture_rows(model_runner: Any, par: _Parallel, max_tokens: int, top_k: int) -> int:
    """Set how a forward's rows reach this rank's accumulator (_GATHER, _DP_SLICE) and return
    the most rows one forward can bring."""
    import torch

    global _GATHER, _DP_SLICE
    # SGLang pads each DP rank's rows to a multiple of the attention-TP size
    rows_per_rank = max_tokens + par.attn_tp
    _GATHER = _DP_SLICE = None
    if par.scattered:
        shared = int(getattr(getattr(model_runner.model, "shared_experts_config", None), "num_fused_shared_experts", 0) or 0)
        buf = torch.empty(rows_per_rank * (top_k + shared), dtype=torch.int32, device=model_runner.device)
        _GATHER = _attn_tp_gather(buf, par.attn_tp, par.gather_into)
        return rows_per_rank
    if par.dp_attention:
        # the eager forward's layout (can_run_graph False): a graph replay never calls back
        # into Python, and the accumulator refuses such a forward
        dp_slice = par.dp_local_slice
        _DP_SLICE = lambda fb: dp_slice(fb, False, None)[0]  # noqa: E731
        return rows_per_rank * max(par.dp_ranks, 1)
    return rows_per_rank


# --------------------------------------------------------------------------- forward
def begin_forward(model_runner: Any, forward_batch: Any) -> None:
    acc = ACCUMULATOR
    if acc is None or getattr(model_runner, "is_draft_worker", False):
        return
    mode = getattr(forward_batch.forward_mode, "name", str(forward_batch.forward_mode))
    lens = forward_batch.extend_seq_lens_cpu
    if mode not in _EXTEND_MODES or lens is None:
        acc.deactivate()
        return
    idx = forward_batch.req_pool_indices_cpu
    if idx is None:
        idx = forward_batch.req_pool_indices.cpu()
    slots = [int(x) for x in idx.tolist()] if hasattr(idx, "tolist") else [int(x) for x in idx]
    gen = model_runner.req_to_token_pool.req_generation
    generations = [int(x) for x in gen[slots].tolist()]
    dp_slice = _DP_SLICE
    acc.begin_forward(
        slots,
        [int(x) for x in lens],
        generations,
        slots_dev=forward_batch.req_pool_indices,
        lens_dev=forward_batch.extend_seq_lens,
        row_start=0 if dp_slice is None else (lambda: dp_slice(forward_batch)),
    )


def capture(layer_id: int | None, topk_ids: Any) -> None:
    acc = ACCUMULATOR
    if acc is None:
        return
    if _GATHER is not None:  # a collective: every attention-TP rank, every MoE layer
        topk_ids = _GATHER(topk_ids)
        if topk_ids is None:
            acc.refuse_forward()
            return
    acc.capture(layer_id, topk_ids)


# --------------------------------------------------------------------------- emit
def _slot(req: Any) -> int:
    kv = getattr(req, "kv", None)
    if kv is not None and getattr(kv, "req_pool_idx", None) is not None:
        return int(kv.req_pool_idx)
    return int(req.req_pool_idx)


def payloads_for(reqs: list, acc: Any = None, max_bytes: int | None = None) -> list[dict]:
    """One payload per request (a 'none' payload when the counts are not trustworthy)."""
    acc = ACCUMULATOR if acc is None else acc
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    counts, valid, tokens = acc.take([_slot(r) for r in reqs])
    out = []
    for c, ok, n in zip(counts, valid, tokens):
        if not ok:
            out.append({"v": PAYLOAD_VERSION, "none": "unattributed_rows"})
        else:
            out.append(encode_counts(c, acc.moe_layers, n, max_bytes))
    return out


def emit(scheduler: Any, reqs: list) -> None:
    """Attach the payload to requests that just finished prefill and stream it out now.

    It rides SGLang's own customized_info channel: a token-aligned value of the first output
    token, so it lands in meta_info[META_KEY] of the first stream chunk (and of the final
    response), before the KV cache is sent."""
    if ACCUMULATOR is None or not reqs:
        return
    try:
        payloads = payloads_for(reqs)
    except Exception:  # never take the scheduler down for a signature
        logger.exception("ELDR signature readout failed; these requests fall back at the router")
        return
    for req, p in zip(reqs, payloads):
        info = dict(req.customized_info or {})
        info[META_KEY] = [p] + [None] * max(0, len(req.output_ids) - 1)
        req.customized_info = info
    streamed = [r for r in reqs if getattr(r, "stream", False)]
    if streamed:
        scheduler.output_streamer.stream_output(streamed, False)


def openai_chunk(content: dict, seen: set) -> str | None:
    """An SSE event carrying the payload, once per choice index, for the OpenAI endpoints."""
    meta = content.get("meta_info") or {}
    sig = meta.get(META_KEY)
    index = content.get("index", 0)
    if not sig or index in seen:
        return None
    seen.add(index)
    if isinstance(sig, list):
        sig = next((s for s in sig if s is not None), None)
        if sig is None:
            return None
    body = {"id": meta.get("id"), "object": "eldr.signature", "choices": [], "sglext": {META_KEY: sig}}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


# --------------------------------------------------------------------------- flags
def resolve_late_binding(server_args: Any) -> None:
    """--enable-eldr-late-binding: prefill runs (and parks its KV) before decode connects.

    Builds on optimistic prefill: make sure at least one optimistic attempt is allowed, so a
    request prefills and emits its signature while its decode worker is still unchosen."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if not getattr(cfg, "enable_eldr_late_binding", False):
        return
    if cfg.disaggregation_mode not in ("prefill", "decode"):
        raise ValueError("--enable-eldr-late-binding needs --disaggregation-mode prefill or decode")
    if cfg.disaggregation_mode == "prefill":
        if cfg.optimistic_prefill_attempts <= 0:
            declare_resolution(server_args, "eldr_late_binding", optimistic_prefill_attempts=1)
        if not cfg.enable_eldr_signature:
            logger.warning(
                "--enable-eldr-late-binding without --enable-eldr-signature: the router "
                "waits for a signature that never comes and falls back after its timeout"
            )
