"""`eldr refit`: refit a centroid file on a trace's prefill signatures.

    eldr refit centroids.eldr --trace traffic.npz [--requests 2000:4000] [--out new.eldr]
        refit the centroids on a trace's prefill signatures, keeping the file's layer weights
        and IDF, mapping the new centroids onto the workers with the least disturbance, and
        write the result atomically (default: replace the input, which a running router
        hot-reloads).

Also runnable as `python -m eldr_sglang.cli.refit ...` (refit or drift-check, same arguments).
"""

from __future__ import annotations

import json
import sys

from eldr_sglang.cli import args as A
from eldr_sglang.cli.signatures import trace_signatures


def register(subparsers) -> None:
    p = subparsers.add_parser("refit", help="refit a centroid file on a trace's signatures (keeps the spec)",
                              description="Refit the centroids on the prefill signatures of a trace's requests, keeping the "
                                          "file's layer weights and IDF; new centroids go to the workers they are closest to.")
    p.add_argument("centroids", help="current centroid file (.eldr)")
    p.add_argument("--trace", required=True, help="trace (.npz) whose requests' prefill signatures to fit")
    p.add_argument("--requests", default=None, help="request range a:b of the trace (default: all)")
    p.add_argument("--out", default=None, help="output file (default: replace the input atomically)")
    p.add_argument("--seed", type=A.seed, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run_refit)


def run_refit(args) -> int:
    from eldr_sglang.drift.refit import refit_file

    from eldr_sglang.io_safe import check_output

    # replacing the input centroid file is the default (its previous version is kept as .prev)
    check_output(args.out or args.centroids, what="--out", inputs=[("--trace", args.trace)])
    cs, S, valid, req = trace_signatures(args.centroids, args.trace, args.requests)
    summary = refit_file(args.centroids, S[valid], args.out or args.centroids, reason=f"eldr refit --trace {args.trace}",
                         seed=args.seed, extra={"trace": str(args.trace), "requests": [int(req[0]), int(req[-1]) + 1]})
    if args.json:
        print(json.dumps(summary, indent=1, default=float))
        return 0
    print(f"refitted {summary['n_signatures']} signatures of {len(req)} requests -> {summary['out_path']} "
          f"(checksum {summary['checksum']:#x}, {summary['seconds']:.1f} s)")
    print("worker <- new cluster: " + ", ".join(f"{k}<-{j}" for k, j in enumerate(summary["mapping"])))
    print("cosine(old, new) per worker: " + " ".join(f"{x:.2f}" for x in summary["centroid_similarity"]))
    b = summary["baseline"]
    print(f"new baseline: mean d* {b['mean_d_star']:.4f} (s.d. {b['std_d_star']:.4f}), cluster sizes {summary['cluster_sizes']}")
    return 0


def main(argv=None) -> int:
    import argparse

    from eldr_sglang.cli import CliError, drift_check

    parser = argparse.ArgumentParser(prog="eldr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(sub)
    drift_check.register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, OSError) as exc:
        print(f"eldr {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
