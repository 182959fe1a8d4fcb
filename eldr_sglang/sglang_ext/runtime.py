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
"""

from __future__ import annotations

import json
import logging
from typing import Any

from eldr_sglang.sglang_ext.payload import DEFAULT_MAX_BYTES, META_KEY, PAYLOAD_VERSION, encode_counts

logger = logging.getLogger(__name__)

ACCUMULATOR = None  # CountsAccumulator of this process, or None
MAX_BYTES = DEFAULT_MAX_BYTES
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


# --------------------------------------------------------------------------- install
def install(model_runner: Any) -> None:
    """Create this process's accumulator when the server is an ELDR prefill worker."""
    global ACCUMULATOR, MAX_BYTES
    if getattr(model_runner, "is_draft_worker", False):
        return
    try:
        if not _flag("enable_eldr_signature") or _flag("disaggregation_mode", "null") != "prefill":
            return
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.runtime_context import get_schedule
    except Exception as exc:  # a layout this module does not know: stay off, loudly
        logger.warning("ELDR signature disabled: %s", exc)
        return
    if is_dp_attention_enabled():
        logger.warning(
            "ELDR signature disabled: DP attention gathers tokens of all DP ranks into the MoE "
            "layers; the router falls back to shortest-queue for these requests"
        )
        return
    from eldr_sglang.sglang_ext.accumulator import CountsAccumulator

    hf = model_runner.model_config.hf_text_config
    try:
        moe_layers, num_experts = moe_layer_ids(hf), num_routed_experts(hf)
    except (ValueError, AttributeError, TypeError) as exc:  # not an MoE model, or an unknown config
        logger.warning("ELDR signature disabled: %s", exc)
        return
    sched = get_schedule()
    max_tokens = max(
        int(getattr(sched, "chunked_prefill_size", 0) or 0),
        int(getattr(sched, "max_prefill_tokens", 0) or 0),
        8192,
    )
    pool = model_runner.req_to_token_pool
    MAX_BYTES = int(_flag("eldr_signature_max_bytes", DEFAULT_MAX_BYTES))
    ACCUMULATOR = CountsAccumulator(
        num_hidden_layers=int(hf.num_hidden_layers),
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=int(getattr(hf, "num_experts_per_tok", 8)),
        max_slots=int(pool.req_to_token.shape[0]),
        max_tokens=max_tokens,
        device=model_runner.device,
    )
    logger.info(
        "ELDR signature on: %d MoE layers x %d experts, %d slots, %d tokens per forward, payload <= %d bytes",
        len(ACCUMULATOR.moe_layers), ACCUMULATOR.num_experts, ACCUMULATOR.max_slots, max_tokens, MAX_BYTES,
    )


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
    acc.begin_forward(
        slots,
        [int(x) for x in lens],
        generations,
        slots_dev=forward_batch.req_pool_indices,
        lens_dev=forward_batch.extend_seq_lens,
    )


def capture(layer_id: int | None, topk_ids: Any) -> None:
    acc = ACCUMULATOR
    if acc is not None:
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
