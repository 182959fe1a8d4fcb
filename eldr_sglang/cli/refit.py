"""`eldr refit` and `eldr drift-check`: offline tools around the online drift machinery.

    eldr drift-check centroids.eldr --trace traffic.npz [--window 512] [--json]
        replay a trace's prefill signatures through the DriftMonitor against the centroid
        file's baseline; print each window and whether (and when) drift would be reported.
    eldr refit centroids.eldr --trace traffic.npz [--requests 2000:4000] [--out new.eldr]
        refit the centroids on a trace's prefill signatures, keeping the file's layer weights
        and IDF, mapping the new centroids onto the workers with the least disturbance, and
        write the result atomically (default: replace the input, which a running router
        hot-reloads).

Also runnable as `python -m eldr_sglang.cli.refit ...` (same arguments).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def register(subparsers) -> None:
    p = subparsers.add_parser("refit", help="refit a centroid file on a trace's signatures (keeps the spec)",
                              description="Refit the centroids on the prefill signatures of a trace's requests, keeping the "
                                          "file's layer weights and IDF; new centroids go to the workers they are closest to.")
    p.add_argument("centroids", help="current centroid file (.eldr)")
    p.add_argument("--trace", required=True, help="trace (.npz) whose requests' prefill signatures to fit")
    p.add_argument("--requests", default=None, help="request range a:b of the trace (default: all)")
    p.add_argument("--out", default=None, help="output file (default: replace the input atomically)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run_refit)
    q = subparsers.add_parser("drift-check", help="run the drift monitor over a trace against a centroid file's baseline",
                              description="Replay a trace's prefill signatures through the DriftMonitor (windowed d* and "
                                          "cluster shares vs the baseline stored in the centroid file) and report each window.")
    q.add_argument("centroids", help="centroid file (.eldr) with a provenance baseline (written by eldr fit or eldr refit)")
    q.add_argument("--trace", required=True, help="trace (.npz)")
    q.add_argument("--requests", default=None, help="request range a:b of the trace (default: all)")
    q.add_argument("--window", type=int, default=512, help="requests per window (default 512)")
    q.add_argument("--d-shift", type=float, default=1.0, help="mean-d* shift threshold in baseline s.d. (default 1.0)")
    q.add_argument("--js", type=float, default=0.1, help="cluster-share Jensen-Shannon threshold (default 0.1)")
    q.add_argument("--patience", type=int, default=2, help="consecutive out-of-profile windows that make drift (default 2)")
    q.add_argument("--json", action="store_true", help="print the windows as JSON")
    q.set_defaults(func=run_check)


def _range(text, n):
    if text is None:
        return np.arange(n, dtype=np.int64)
    a, sep, b = str(text).partition(":")
    if not sep:
        raise ValueError(f"--requests must look like a:b, got {text!r}")
    try:
        lo = int(a) if a else 0
        hi = int(b) if b else n
    except ValueError:
        raise ValueError(f"--requests must look like a:b with integers, got {text!r}") from None
    if not (0 <= lo < hi <= n):
        raise ValueError(f"--requests {text} is outside the trace's 0:{n}")
    return np.arange(lo, hi, dtype=np.int64)


def _signatures(centroids: str, trace_path: str, requests):
    from eldr_sglang import _core
    from eldr_sglang.traces import load_trace

    cs = _core.CentroidSet.open(str(centroids))
    t = load_trace(trace_path)
    if t.num_layers != cs.num_layers or t.num_experts != cs.num_experts:
        raise ValueError(f"the trace has {t.num_layers} layers x {t.num_experts} experts, the centroid file "
                         f"{cs.num_layers} x {cs.num_experts}")
    req = _range(requests, t.num_requests)
    sub = t.subset(req) if len(req) != t.num_requests else t
    S, valid = cs.spec().batch_from_topk(sub.expert_ids, sub.req_offsets.astype(np.int64), sub.prefill_len.astype(np.int64))
    return cs, np.asarray(S), np.asarray(valid), req


def run_refit(args) -> int:
    from eldr_sglang.drift.refit import refit_file

    from eldr_sglang.io_safe import check_output

    # replacing the input centroid file is the default (its previous version is kept as .prev)
    check_output(args.out or args.centroids, what="--out", inputs=[("--trace", args.trace)])
    cs, S, valid, req = _signatures(args.centroids, args.trace, args.requests)
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


def run_check(args) -> int:
    from eldr_sglang.drift.monitor import DriftMonitor

    cs, S, valid, req = _signatures(args.centroids, args.trace, args.requests)
    m = DriftMonitor(cs.provenance_json, window=args.window, d_shift_threshold=args.d_shift, js_threshold=args.js,
                     patience=args.patience, history=1 << 20)
    C = np.asarray(cs.centroids())
    first = None
    for i in np.flatnonzero(valid):
        d = 1.0 - S[i] @ C.T
        k = int(np.argmin(d))
        m.observe(float(d[k]), k)
        if first is None and m.drifted()[0]:
            first = (int(req[i]), m.drifted()[1])
    wins = m.windows()
    if args.json:
        print(json.dumps({"windows": wins, "drift_at_request": first[0] if first else None,
                          "reason": first[1] if first else None, "baseline": m.baseline}, default=float))
        return 0
    b = m.baseline
    print(f"baseline: mean d* {b['mean_d_star']:.4f} (s.d. {b['std_d_star']:.4f}); {len(wins)} windows of {args.window}; "
          f"{int((~valid).sum())} requests without a signature skipped")
    print(f"{'window':>6} {'mean d*':>8} {'shift sd':>8} {'JS':>6}  out")
    for j, w in enumerate(wins):
        print(f"{j:6d} {w['mean_d_star']:8.4f} {w['d_shift']:+8.2f} {w['js']:6.3f}  {'*' if w['out_of_profile'] else ''}")
    if first:
        print(f"drift reported at trace request {first[0]}: {first[1]}")
    else:
        print("no drift reported")
    return 0


def main(argv=None) -> int:
    import argparse

    from eldr_sglang.cli import CliError

    parser = argparse.ArgumentParser(prog="eldr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, OSError) as exc:
        print(f"eldr {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
