"""`eldr collect`: record routing from a running SGLang server (or convert saved responses)."""

from __future__ import annotations

import argparse
import json
import os

from eldr_sglang.models import MODEL_SHAPES
from eldr_sglang.cli import args as A


def _layers(text: str) -> list[int]:
    """'3-60' or '0,2,4' or '3-10,12'."""
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if not 0 <= lo <= hi < A.MAX_LAYERS:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            elif part:
                out.append(int(part))
                if not 0 <= out[-1] < A.MAX_LAYERS:
                    raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer list like 3-60 or 0,2,4 of layers 0..{A.MAX_LAYERS - 1}, got {text!r}") from None
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "collect",
        help="record routed experts from a running SGLang server into a trace",
        description="Send a prompt dataset (JSONL of {\"prompt\"} or {\"messages\"} records, or ShareGPT "
                    "JSON) to an SGLang server started with --enable-return-routed-experts, and write "
                    "an ELDR trace. Resumable: re-running skips prompts already answered (kept in "
                    "OUT.partial.jsonl). With --from-file, convert saved SGLang responses (JSONL of "
                    "/generate responses, or an sglang.benchmark.serving output file) instead.",
    )
    p.add_argument("dataset", nargs="?", help="prompt dataset (.jsonl or ShareGPT .json)")
    p.add_argument("--from-file", metavar="RESPONSES", help="convert saved SGLang responses; no server")
    p.add_argument("--url", default="http://127.0.0.1:30000", help="SGLang server (default http://127.0.0.1:30000)")
    p.add_argument("--out", required=True, help="output trace (.npz), written atomically")
    m = p.add_argument_group("model (a preset, or the three numbers)")
    m.add_argument("--model", type=A.model,
                   help="model preset (layer layout, top-k, experts): " + A.MODEL_HELP.format(", ".join(MODEL_SHAPES)))
    m.add_argument("--num-hidden-layers", type=A.integer(1, A.MAX_LAYERS), help="hidden layers in SGLang's routed_experts")
    m.add_argument("--top-k", type=A.integer(1, 1024), help="experts per token (num_experts_per_tok)")
    m.add_argument("--num-experts", type=A.integer(1, A.MAX_EXPERTS), help="routed experts per MoE layer")
    m.add_argument("--first-k-dense-replace", type=A.integer(0, A.MAX_LAYERS), help="the first K hidden layers are dense")
    m.add_argument("--moe-layers", type=_layers, help="MoE hidden layers, e.g. 3-60 (default: inferred)")
    m.add_argument("--model-name", help="model name recorded in the trace")
    p.add_argument("--max-new-tokens", type=A.integer(1, A.MAX_TOKENS), default=256)
    p.add_argument("--temperature", type=A.real(0.0, 100.0), default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="decode exactly --max-new-tokens tokens")
    p.add_argument("--concurrency", type=A.integer(1, 1024), default=8, help="requests in flight (default 8)")
    p.add_argument("--timeout", type=A.real(0.0, 86400.0, lo_open=True), default=600.0, help="seconds per request (default 600)")
    p.add_argument("--retries", type=A.integer(0, 100), default=2, help="retries of a transient failure (default 2)")
    p.add_argument("--limit", type=A.integer(1, A.MAX_REQUESTS), help="use only the first N prompts")
    p.add_argument("--served-model", default="default", help="'model' field of chat requests")
    p.add_argument("--api-key-env", metavar="VAR", help="read a bearer token from this environment variable")
    p.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON",
                   help="extra fields merged into every request body")
    p.add_argument("--allow-failures", action="store_true", help="write the trace without failed prompts")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep OUT.partial.jsonl after success")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--format", choices=["v2", "v1"], default="v2",
                   help="v2 (default): prompt counts per request, decode routing of --keep-decode prompts; "
                        "v1: every token's routing")
    p.add_argument("--keep-decode", type=lambda t: None if t.strip().lower() == "all" else A.integer(0, A.MAX_REQUESTS)(t),
                   default=None, metavar="N|all", help="(v2) keep the decode routing of the first N prompts (default all)")
    p.add_argument("--counts-only", action="store_true",
                   help="(v2) do not ask for return_routed_experts: take each prompt's counts from the eldr_signature "
                        "payload a patched prefill streams (SGLang with --enable-eldr-signature); no decode routing")
    p.set_defaults(func=run)


def _spec(args):
    from eldr_sglang.traces.sglang_responses import ModelSpec

    if args.model:
        if any(v is not None for v in (args.num_hidden_layers, args.top_k, args.num_experts)):
            raise ValueError("give --model or --num-hidden-layers/--top-k/--num-experts, not both")
        spec = ModelSpec.preset(args.model)
        if args.moe_layers is not None or args.first_k_dense_replace is not None:
            spec = ModelSpec.from_args(spec.num_hidden_layers, spec.top_k, spec.num_experts, args.moe_layers,
                                       args.first_k_dense_replace, spec.model)
    else:
        missing = [f for f, v in (("--num-hidden-layers", args.num_hidden_layers), ("--top-k", args.top_k),
                                  ("--num-experts", args.num_experts)) if v is None]
        if missing:
            raise ValueError(f"give --model or all of --num-hidden-layers, --top-k, --num-experts (missing {', '.join(missing)})")
        spec = ModelSpec.from_args(args.num_hidden_layers, args.top_k, args.num_experts, args.moe_layers,
                                   args.first_k_dense_replace, args.model_name or "unknown")
    if args.model_name:
        spec.model = args.model_name
    return spec


def run(args) -> int:
    from eldr_sglang.traces.collect import CollectConfig, collect, load_prompts
    from eldr_sglang.traces.sglang_responses import read_sglang
    from eldr_sglang.traces import save_trace

    from eldr_sglang.io_safe import check_output

    spec = _spec(args)
    check_output(args.out, what="--out", create_parent=True,
                 inputs=[("the dataset", args.dataset), ("--from-file", args.from_file)])
    if args.from_file:
        if args.dataset:
            raise ValueError("give a dataset (to collect) or --from-file (to convert), not both")
        trace = read_sglang(args.from_file, spec)
        save_trace(trace, args.out)
        print(f"wrote {args.out}: {trace.num_requests} requests, {trace.expert_ids.shape[0]} tokens, "
              f"{trace.num_layers} MoE layers x {trace.num_experts} experts, top-{trace.top_k}")
        return 0
    if not args.dataset:
        raise ValueError("give a prompt dataset, or --from-file to convert saved responses")
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ValueError(f"environment variable {args.api_key_env} is not set")
    if not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    prompts = load_prompts(args.dataset, args.limit)
    cfg = CollectConfig(url=args.url, spec=spec, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        ignore_eos=args.ignore_eos, concurrency=args.concurrency, timeout_s=args.timeout,
                        retries=args.retries, served_model=args.served_model, api_key=api_key,
                        extra_body=args.extra_body, routed_experts=not args.counts_only)
    if args.counts_only and args.format != "v2":
        raise ValueError("--counts-only writes a trace v2 (there is no per-token routing to write as v1)")
    res = collect(prompts, cfg, args.out, progress=not args.no_progress, allow_failures=args.allow_failures,
                  keep_checkpoint=args.keep_checkpoint, fmt=args.format,
                  keep_decode=0 if args.counts_only else args.keep_decode)
    print(f"wrote {args.out} (trace {args.format}): {res.requests} requests ({res.reused} from the checkpoint, "
          f"{res.sent} sent, {len(res.failed)} failed), {res.tokens} tokens")
    return 0
