"""`eldr drift-check`: replay a trace's prefill signatures through the DriftMonitor.

    eldr drift-check centroids.eldr --trace traffic.npz [--window 512] [--json]
        replay a trace's prefill signatures through the DriftMonitor against the centroid
        file's baseline; print each window and whether (and when) drift would be reported.
"""

from __future__ import annotations

import json

import numpy as np

from eldr_sglang.cli import args as A
from eldr_sglang.cli.signatures import trace_signatures


def register(subparsers) -> None:
    q = subparsers.add_parser("drift-check", help="run the drift monitor over a trace against a centroid file's baseline",
                              description="Replay a trace's prefill signatures through the DriftMonitor (windowed d* and "
                                          "cluster shares vs the baseline stored in the centroid file) and report each window.")
    q.add_argument("centroids", help="centroid file (.eldr) with a provenance baseline (written by eldr fit or eldr refit)")
    q.add_argument("--trace", required=True, help="trace (.npz)")
    q.add_argument("--requests", default=None, help="request range a:b of the trace (default: all)")
    q.add_argument("--window", type=A.integer(1, A.MAX_REQUESTS), default=512, help="requests per window (default 512)")
    q.add_argument("--d-shift", type=A.real(0.0, 1e6, lo_open=True), default=1.0, help="mean-d* shift threshold in baseline s.d. (default 1.0)")
    q.add_argument("--js", type=A.real(0.0, 1.0, lo_open=True), default=0.1, help="cluster-share Jensen-Shannon threshold (default 0.1)")
    q.add_argument("--patience", type=A.integer(1, 1_000_000), default=2, help="consecutive out-of-profile windows that make drift (default 2)")
    q.add_argument("--json", action="store_true", help="print the windows as JSON")
    q.set_defaults(func=run_check)


def run_check(args) -> int:
    from eldr_sglang.drift.monitor import DriftMonitor

    cs, S, valid, req = trace_signatures(args.centroids, args.trace, args.requests)
    m = DriftMonitor(cs.provenance_json, num_workers=int(cs.num_workers), window=args.window, d_shift_threshold=args.d_shift, js_threshold=args.js,
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
