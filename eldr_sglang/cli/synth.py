"""`eldr synth`: write a synthetic domain-skewed (or uniform control) routing trace."""

from __future__ import annotations

import argparse
import sys
import time

from eldr_sglang.synth import MODEL_SHAPES


def _length(text: str):
    """'300' -> 300 (a mean); '128,512' -> (128, 512) (uniform range)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO,HI, got {text!r}") from None
    if len(vals) == 1:
        return vals[0]
    if len(vals) == 2:
        return (vals[0], vals[1])
    raise argparse.ArgumentTypeError(f"expected N or LO,HI, got {text!r}")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "synth",
        help="generate a synthetic MoE routing trace",
        description="Generate a synthetic domain-skewed MoE routing trace (ELDR trace v1), calibrated "
                    "to real GPT-OSS-20B routing statistics; --uniform gives the no-locality control.",
    )
    p.add_argument("--model", required=True, choices=sorted(MODEL_SHAPES), help="model shape")
    p.add_argument("--requests", type=int, required=True, help="number of requests")
    p.add_argument("--domains", type=int, default=8, help="number of domains (default 8)")
    p.add_argument("--uniform", action="store_true", help="uniform routing: no domain locality (control)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=_length, default=(128, 512), metavar="N|LO,HI",
                   help="prompt length: a mean, or a uniform range (default 128,512)")
    p.add_argument("--output-len", type=_length, default=256, metavar="N|LO,HI",
                   help="decode length: exactly N, or a uniform range (default 256)")
    p.add_argument("--burstiness", type=float, default=0.7,
                   help="probability a request belongs to its regime's dominant domain (default 0.7)")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrival rate, requests/s (default 4)")
    p.add_argument("--out", required=True, help="output trace (.npz), written atomically")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from eldr_sglang.synth import generate
    from eldr_sglang.traces import save_trace

    from eldr_sglang.io_safe import check_output

    if args.requests < 1:
        raise ValueError("--requests must be >= 1")
    check_output(args.out, what="--out", create_parent=True)  # before the generation, not after
    t0 = time.time()
    bar = None
    progress = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(unit="tok", unit_scale=True, desc="synth", file=sys.stderr, disable=args.requests < 2000)
            progress = bar.update
        except ImportError:
            pass
    try:
        trace = generate(model=args.model, requests=args.requests, domains=args.domains, uniform=args.uniform,
                         seed=args.seed, prompt_len=args.prompt_len, output_len=args.output_len,
                         burstiness=args.burstiness, rate=args.rate, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    save_trace(trace, args.out)
    T = trace.expert_ids.shape[0]
    print(f"wrote {args.out}: {args.model} {'uniform' if args.uniform else f'{args.domains} domains'}, "
          f"{trace.num_requests} requests, {T} tokens, {trace.num_layers}x{trace.num_experts} top-{trace.top_k} "
          f"({trace.expert_ids.nbytes / 2**20:.0f} MiB of ids) in {time.time() - t0:.1f}s")
    return 0
