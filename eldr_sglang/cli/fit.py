"""`eldr fit`: trace -> balanced centroids file, with a quality report."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

from eldr_sglang.cli import CliError


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
    p.add_argument("trace", help="ELDR trace (.npz, format version 1)")
    p.add_argument("--workers", "-k", type=int, required=True, help="number of decode workers K")
    p.add_argument("--out", "-o", required=True, help="centroid file to write (.eldr)")
    p.add_argument("--tau", type=float, default=0.1, help="locality band width stored in the file (default 0.1)")
    p.add_argument(
        "--layers",
        default="middle",
        help="middle | all | auto | LIST such as 4-12,15 or 6:0.5,7-10 (default middle)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the k-means++ restarts (default 0)")
    p.add_argument("--restarts", type=int, default=4, help="seeded k-means++ restarts (default 4)")
    p.add_argument("--max-iter", type=int, default=50, help="k-means iterations per restart (default 50)")
    p.add_argument(
        "--tol", type=float, default=1e-5, help="stop when an iteration improves the objective by at most this share (default 1e-5)"
    )
    p.add_argument("--no-idf-plus-one", action="store_true", help="use log((|C|+1)/(df+1)) without the +1")
    p.add_argument("--worker-names", help="comma-separated names of the K decode workers, in order")
    p.add_argument("--json", dest="json_out", help="also write the full report as JSON to this path")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _check_out(path: str, what: str) -> Path:
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{what} {path} is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"{what}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise CliError(f"{what}: directory {parent} is not writable")
    return p


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o)}")


def _clean(o):
    """NaN is not JSON: write null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def run(args) -> int:
    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.offline.report import format_report
    from eldr_sglang.traces import load_trace

    out = _check_out(args.out, "--out")
    js = _check_out(args.json_out, "--json") if args.json_out else None
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
    trace = load_trace(args.trace)
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
        idf_plus_one=not args.no_idf_plus_one,
        worker_names=names,
        source_path=args.trace,
    )
    report = dict(res.report)
    report["out"] = str(out)
    # stage the JSON first, so a failure leaves neither file behind
    tmp_json = None
    if js is not None:
        fd, tmp_json = tempfile.mkstemp(dir=js.parent if str(js.parent) else ".", prefix=f".{js.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(_clean(report), fh, indent=2, default=_json_default)
    try:
        res.write(out)
    except BaseException:
        if tmp_json:
            Path(tmp_json).unlink(missing_ok=True)
        raise
    if tmp_json:
        os.replace(tmp_json, js)
    print(format_report(report))
    print(f"wrote {out}" + (f" and {js}" if js else ""))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
