"""`eldr synth`: write a synthetic domain-skewed (or uniform control) routing trace."""

from __future__ import annotations

import argparse
import contextlib
import os
import time

from eldr_sglang.models import MODEL_SHAPES, model_shape
from eldr_sglang.cli import args as A


def _length(text: str):
    """'300' -> 300 (a mean); '128,512' -> (128, 512) (uniform range)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO,HI, got {text!r}") from None
    if any(not 1 <= v <= A.MAX_TOKENS for v in vals) or (len(vals) == 2 and vals[0] > vals[1]):
        raise argparse.ArgumentTypeError(f"lengths must lie in 1..{A.MAX_TOKENS} with LO <= HI, got {text!r}")
    if len(vals) == 1:
        return vals[0]
    if len(vals) == 2:
        return (vals[0], vals[1])
    raise argparse.ArgumentTypeError(f"expected N or LO,HI, got {text!r}")


KEEP_DECODE_DEFAULT = 10000


def _keep(text: str):
    """'all' -> None (every request), else a request count."""
    return None if str(text).strip().lower() == "all" else A.integer(0, A.MAX_REQUESTS)(text)


def _jobs(text: str):
    """'auto' -> None (one per CPU), else a process count."""
    return None if str(text).strip().lower() == "auto" else A.integer(1, 1024)(text)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "synth",
        help="generate a synthetic MoE routing trace",
        description="Generate a synthetic domain-skewed MoE routing trace (ELDR trace v2, or v1), calibrated "
                    "to real GPT-OSS-20B routing statistics; --uniform gives the no-locality control.",
    )
    p.add_argument("--model", required=True, type=A.model, help="model shape: " + A.MODEL_HELP.format(", ".join(MODEL_SHAPES)))
    p.add_argument("--requests", type=A.integer(1, A.MAX_REQUESTS), required=True, help="number of requests")
    p.add_argument("--domains", type=A.integer(1, 4096), default=8, help="number of domains (default 8)")
    p.add_argument("--uniform", action="store_true", help="uniform routing: no domain locality (control)")
    p.add_argument("--seed", type=A.seed, default=0)
    p.add_argument("--prompt-len", type=_length, default=(128, 512), metavar="N|LO,HI",
                   help="prompt length: a mean, or a uniform range (default 128,512)")
    p.add_argument("--output-len", type=_length, default=256, metavar="N|LO,HI",
                   help="decode length: exactly N, or a uniform range (default 256)")
    p.add_argument("--burstiness", type=A.real(0.0, 1.0), default=0.7,
                   help="probability a request belongs to its regime's dominant domain (default 0.7)")
    p.add_argument("--rate", type=A.real(0.0, 1e9, lo_open=True), default=4.0, help="mean arrival rate, requests/s (default 4)")
    p.add_argument("--format", choices=["v2", "v1"], default="v2",
                   help="v2 (default): per-request prompt counts streamed to disk in bounded memory, decode "
                        "routing of --keep-decode requests; v1: every token's routing, held in memory")
    p.add_argument("--keep-decode", type=_keep, default=KEEP_DECODE_DEFAULT, metavar="N|all",
                   help=f"(v2) keep the decode routing of the first N requests, or 'all' (default {KEEP_DECODE_DEFAULT}: "
                        "enough for a simulator study; the fit needs none)")
    p.add_argument("--jobs", type=_jobs, default=None, metavar="N|auto",
                   help="(v2) worker processes drawing blocks of requests in parallel (default auto: one per CPU); "
                        "the trace is the same for any N")
    p.add_argument("--out", required=True, help="output trace (.npz), written atomically")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    A.add_max_memory(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from eldr_sglang import memory
    from eldr_sglang.io_safe import check_output
    from eldr_sglang.progress import progress
    from eldr_sglang.traces.synth import SynthSpec

    check_output(args.out, what="--out", create_parent=True)  # before the generation, not after
    shape = model_shape(args.model)
    spec = SynthSpec(model=args.model, requests=args.requests, domains=args.domains, uniform=args.uniform,
                     seed=args.seed, prompt_len=args.prompt_len, output_len=args.output_len, burstiness=args.burstiness,
                     rate=args.rate)
    t0 = time.time()
    show = not args.no_progress and args.requests >= 2000
    if args.format == "v2":
        from eldr_sglang.traces.counts_file import open_counts_trace
        from eldr_sglang.traces.synth import write_synth

        with contextlib.ExitStack() as stack:
            bars = []

            def update(n: int) -> None:  # the bar starts with the first tokens, after the memory check
                if not bars:
                    bars.append(stack.enter_context(progress(desc="synth", unit="tok", unit_scale=True)))
                bars[0].update(n)

            write_synth(args.out, spec, keep_decode=args.keep_decode, progress=update if show else None,
                        max_memory=args.max_memory, jobs=args.jobs)
        with open_counts_trace(args.out) as t:
            kept = t.meta["decode_requests"]
            print(f"wrote {args.out} (trace v2): {args.model} {'uniform' if args.uniform else f'{args.domains} domains'}, "
                  f"{t.num_requests} requests, {int(t.prefill_len.sum())} prompt tokens counted, decode routing of "
                  f"{kept} requests, {t.num_layers}x{t.num_experts} top-{t.top_k} "
                  f"({os.path.getsize(args.out) / 2**20:.0f} MiB) in {time.time() - t0:.1f}s")
        return 0
    from eldr_sglang.traces import save_trace
    from eldr_sglang.traces.synth import generate

    mean = lambda v: (v[0] + v[1]) / 2 if isinstance(v, tuple) else float(v)  # noqa: E731
    memory.require(memory.synth_bytes(args.requests, mean(args.prompt_len) + mean(args.output_len), shape["num_layers"],
                                      shape["top_k"], shape["num_experts"]),
                   f"synth of {args.requests} requests", args.max_memory)
    with progress(desc="synth", unit="tok", unit_scale=True, enabled=show) as bar:
        trace = generate(spec, progress=bar.update)
    save_trace(trace, args.out)
    T = trace.expert_ids.shape[0]
    print(f"wrote {args.out} (trace v1): {args.model} {'uniform' if args.uniform else f'{args.domains} domains'}, "
          f"{trace.num_requests} requests, {T} tokens, {trace.num_layers}x{trace.num_experts} top-{trace.top_k} "
          f"({trace.expert_ids.nbytes / 2**20:.0f} MiB of ids) in {time.time() - t0:.1f}s")
    return 0
