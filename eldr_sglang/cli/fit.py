"""`eldr fit`: trace -> balanced centroids file, with a quality report."""

from __future__ import annotations

import contextlib
import json
import sys

import numpy as np

from eldr_sglang.cli import CliError
from eldr_sglang.cli import args as A
from eldr_sglang.defaults import FIT_CHANGE_TOL, FIT_SAMPLE_GROWTH


def _growth(text: str) -> float:
    """--sample-growth: 0 (off) or a factor of at least 2."""
    import argparse

    g = A.real(0.0, 1e6)(text)
    if 0 < g < 2:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or at least 2, got {text!r}")
    return g


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fit",
        help="fit balanced centroids (one per decode worker) to a routing trace",
        description=(
            "Compute prefill signatures of every request in TRACE, cluster them into K equal-size "
            "groups (exact Hungarian-balanced spherical K-means) and write the centroid file the "
            "router loads. Domain labels in the trace are used only to score the fit."
        ),
    )
    p.add_argument("trace", help="ELDR trace (.npz): v1, or v2 (read from disk chunk by chunk)")
    p.add_argument("--workers", "-k", type=A.workers, required=True, help="number of decode workers K")
    p.add_argument("--out", "-o", required=True, help="centroid file to write (.eldr)")
    p.add_argument("--tau", type=A.tau, default=0.1, help="locality band width stored in the file (default 0.1)")
    p.add_argument(
        "--layers",
        default="middle",
        help="middle | all | auto | LIST such as 4-12,15 or 6:0.5,7-10 (default middle)",
    )
    p.add_argument("--seed", type=A.seed, default=0, help="seed of the k-means++ restarts (default 0)")
    p.add_argument("--restarts", type=A.integer(1, 1000), default=4, help="seeded k-means++ restarts (default 4)")
    p.add_argument("--max-iter", type=A.integer(1, 100_000), default=50, help="k-means iterations per restart (default 50)")
    p.add_argument(
        "--tol", type=A.real(0.0, 1.0), default=1e-5, help="stop when an iteration improves the objective by at most this share (default 1e-5)"
    )
    p.add_argument(
        "--change-tol", type=A.real(0.0, 1.0), default=FIT_CHANGE_TOL,
        help="also stop when at most this share of the requests changed cluster in an iteration "
             "(default %g; 0: only when none did)" % FIT_CHANGE_TOL,
    )
    p.add_argument(
        "--sample-growth", type=_growth, default=FIT_SAMPLE_GROWTH,
        help="refine the winning restart on samples this many times larger, then on all requests "
             "(0 or >= 2; default %g; 0: straight to all)" % FIT_SAMPLE_GROWTH,
    )
    p.add_argument("--no-idf-plus-one", action="store_true", help="use log((|C|+1)/(df+1)) without the +1")
    p.add_argument("--worker-names", help="comma-separated names of the K decode workers, in order")
    p.add_argument("--json", dest="json_out", help="also write the full report as JSON to this path")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    A.add_max_memory(p)
    p.set_defaults(func=run)


def _check_memory(args) -> None:
    from eldr_sglang import memory
    from eldr_sglang.offline.fit import PROFILE_SAMPLE
    from eldr_sglang.offline.signatures import DEFAULT_CHUNK_TOKENS
    from eldr_sglang.offline.layers import middle_band, parse_layers
    from eldr_sglang.traces import trace_meta

    shape, meta = memory.trace_shape(args.trace), trace_meta(args.trace)
    counts = memory.counts_shape(meta)
    if (shape is None and counts is None) or meta is None:
        return  # unreadable or invalid: open_trace says why
    E, L = int(meta["num_experts"]), int(meta["num_layers"])
    spec = args.layers.strip().lower()
    if spec == "middle":
        selected = int(np.count_nonzero(middle_band(L)))
    elif spec == "all":
        selected = L
    else:  # auto picks at least one layer; a bad list is reported by the fit itself
        try:
            selected = 1 if spec == "auto" else int(np.count_nonzero(parse_layers(args.layers, L)))
        except ValueError:
            selected = 1
    if counts is not None:
        need, requests = memory.counts_fit_bytes(counts, selected, PROFILE_SAMPLE), counts.requests
    else:
        need, requests = memory.fit_bytes(shape, E, selected, PROFILE_SAMPLE, DEFAULT_CHUNK_TOKENS), shape.requests
    memory.require(need, f"fit of {requests} requests x {selected} layers x {E} experts", args.max_memory)


def run(args) -> int:
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.offline.report import format_report
    from eldr_sglang.traces import open_trace

    from eldr_sglang import io_safe

    out, js = io_safe.check_outputs([("--out", args.out), ("--json", args.json_out)], inputs=[("the trace", args.trace)])
    if args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    if not (args.tol >= 0):
        raise CliError(f"--tol must be >= 0, got {args.tol}")
    if args.max_iter < 1:
        raise CliError(f"--max-iter must be >= 1, got {args.max_iter}")
    if args.restarts < 1:
        raise CliError(f"--restarts must be >= 1, got {args.restarts}")
    names = None
    if args.worker_names:
        names = [n.strip() for n in args.worker_names.split(",")]
        if len(names) != args.workers or any(not n for n in names):
            raise CliError(f"--worker-names needs {args.workers} non-empty names, got {args.worker_names!r}")
    _check_memory(args)
    with open_trace(args.trace) as trace:  # v1 in memory, or v2 read chunk by chunk
        res = fit_trace(
            trace,
            workers=args.workers,
            tau=args.tau,
            layers=args.layers,
            seed=args.seed,
            progress=not args.quiet,
            n_init=args.restarts,
            max_iter=args.max_iter,
            rtol=args.tol,
            change_tol=args.change_tol,
            sample_growth=args.sample_growth,
            idf_plus_one=not args.no_idf_plus_one,
            worker_names=names,
            source_path=args.trace,
        )
    report = dict(res.report)
    report["out"] = str(out)
    # Stage the JSON first and commit it after the centroid file: a failure leaves neither new.
    text = json.dumps(io_safe.json_ready(report), indent=2, allow_nan=False) + "\n"
    with contextlib.ExitStack() as stack:
        staged = stack.enter_context(io_safe.Staged(js, what="--json")) if js is not None else None
        if staged is not None:
            staged.tmp.write_text(text, encoding="utf-8")
        res.write(out)
        if staged is not None:
            staged.commit()
    print(format_report(report))
    print(f"wrote {out}" + (f" and {js}" if js else ""))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
