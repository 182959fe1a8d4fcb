"""`eldr inspect`: readable summary of a centroid file."""

from __future__ import annotations

import json
import math

import numpy as np

from eldr_sglang.cli import args as A


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="summarize a centroid file",
        description="Print what a centroid file holds: workers, layers, tau, provenance and each worker's expert profile.",
    )
    p.add_argument("centroids", help="centroid file (.eldr)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--top", type=A.integer(0, 100_000), default=5, help="top (layer, expert) entries shown per worker (default 5)")
    p.set_defaults(func=run)


def summarize(path: str, top: int = 5) -> dict:
    from eldr_sglang import _core

    cs = _core.CentroidSet.open(str(path))
    C = np.asarray(cs.centroids(), dtype=np.float64)
    w = np.asarray(cs.layer_weights(), dtype=np.float64)
    idf = np.asarray(cs.idf(), dtype=np.float64)
    E = int(cs.num_experts)
    layers = [int(l) for l in np.flatnonzero(w > 0)]
    try:
        prov = json.loads(cs.provenance_json or "{}")
    except json.JSONDecodeError:
        prov = {"unparsed": cs.provenance_json}
    if not isinstance(prov, dict):  # shown as it is, not read as fields
        prov = {"unparsed": cs.provenance_json}
    K = C.shape[0]
    cc = C @ C.T
    workers = []
    for k in range(K):
        order = np.argsort(-C[k], kind="stable")[:top]
        workers.append(
            {
                "index": k,
                "name": cs.worker_names[k],
                "norm": float(np.linalg.norm(C[k])),
                "nonzero": int(np.count_nonzero(C[k])),
                "top": [
                    {"layer": layers[int(i) // E], "expert": int(i) % E, "weight": float(C[k, i])} for i in order
                ],
                "nearest_other": (int(np.argsort(-cc[k])[1]) if K > 1 else None),
                "nearest_other_cosine": (float(np.sort(cc[k])[-2]) if K > 1 else None),
            }
        )
    fit = _obj(prov.get("fit"))
    return {
        "path": str(path),
        "format_version": int(cs.version),
        "checksum": f"{int(cs.checksum):#x}" if isinstance(cs.checksum, int) else str(cs.checksum),
        "num_workers": K,
        "num_layers": int(cs.num_layers),
        "num_experts": E,
        "dim": int(cs.dim),
        "tau": round(float(cs.tau), 7),
        "selected_layers": layers,
        "layer_weights": [float(x) for x in w],
        "idf": {"min": float(idf.min()), "max": float(idf.max()), "mean": float(idf.mean())},
        "centroid_cosine": cc.round(6).tolist(),
        "workers": workers,
        "provenance": prov,
        "cluster_sizes": fit.get("cluster_sizes"),
    }


def _obj(v) -> dict:
    """A provenance field that should be an object; anything else (null, a list) shows as empty."""
    return v if isinstance(v, dict) else {}


def _num(v, digits: int) -> str:
    """A provenance number for display; '?' when missing, null or not a finite number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return "?"
    return f"{v:.{digits}f}"


def format_summary(s: dict) -> str:
    from eldr_sglang.offline.report import _ranges

    lines = [
        f"{s['path']}: ELDR centroid file v{s['format_version']} (checksum {s['checksum']})",
        f"  workers K={s['num_workers']}  layers {s['num_layers']} x experts {s['num_experts']}  "
        f"signature dim {s['dim']}  tau {s['tau']}",
        f"  selected layers: {_ranges(s['selected_layers'])}"
        + ("" if set(s["layer_weights"]) <= {0.0, 1.0} else f"  weights {[round(x, 3) for x in s['layer_weights']]}"),
        f"  idf: min {s['idf']['min']:.3f}  mean {s['idf']['mean']:.3f}  max {s['idf']['max']:.3f}",
    ]
    p = s["provenance"]
    if p:
        params = _obj(p.get("params"))
        lines.append(
            f"  provenance: {p.get('tool', '?')} at {p.get('created_utc', '?')} from "
            f"{p.get('trace_path', p.get('trace_model', '?'))} (sha256 {str(p.get('trace_file_sha256') or p.get('trace_sha256', '?'))[:16]}...)"
        )
        if params:
            lines.append("  params: " + ", ".join(f"{k}={v}" for k, v in params.items()))
        fit = _obj(p.get("fit"))
        if fit:
            lines.append(f"  fit: {fit.get('n_fitted')} requests, cluster sizes {fit.get('cluster_sizes')}, objective {_num(fit.get('objective'), 6)}")
        b = _obj(p.get("baseline"))
        if b:
            shares = b.get("nearest_share")
            shares = [_num(x, 3) for x in shares] if isinstance(shares, list) else shares
            lines.append(
                f"  drift baseline: mean d* {_num(b.get('mean_d_star'), 4)} (p90 {_num(b.get('p90_d_star'), 4)}), "
                f"nearest shares {shares}"
            )
    lines.append("  workers:")
    for w in s["workers"]:
        top = ", ".join(f"L{t['layer']}/E{t['expert']}:{t['weight']:.3f}" for t in w["top"])
        near = (
            f"  nearest worker {w['nearest_other']} (cos {w['nearest_other_cosine']:.3f})" if w["nearest_other"] is not None else ""
        )
        lines.append(f"    [{w['index']}] {w['name']}: {w['nonzero']} nonzero; top {top}{near}")
    return "\n".join(lines)


def run(args) -> int:
    from eldr_sglang.cli import CliError

    if args.top < 0:
        raise CliError("--top must be >= 0")
    s = summarize(args.centroids, args.top)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print(format_summary(s))
    return 0
