"""Prototype, NOT the router's policy: ELDR with a load guard, to size a proposed Rust change.

    python benchmarks/explore_eldr_guard.py [--out benchmarks/results]

The TPOT study shows ELDR's band (tau = 0.1) collapsing to one or two workers when domains
are well separated, so a burst of one domain floods them (load imbalance ~3x). The guard
takes the Rust ELDR decision (Router.route_signature(explain=True)) and, when the chosen
worker's in-flight count exceeds `(1 + slack) * min_load + 2`, re-picks the nearest centroid
among the workers at or below that bound. Everything else (simulator, execution model, fits,
workloads) is the study's. K = 8, 32 clients per decode worker.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from eldr_sglang.offline.fit import fit_trace  # noqa: E402
from eldr_sglang.sim.cluster import ClusterConfig, simulate  # noqa: E402
from eldr_sglang.sim.cost_model import ExecutionModel  # noqa: E402
from eldr_sglang.sim.metrics import compute_metrics  # noqa: E402
from eldr_sglang.sim.policies import eldr_signatures, make_policy  # noqa: E402
from eldr_sglang.sim.profiles import get_hardware, get_model  # noqa: E402
from eldr_sglang.sim.replay import TraceReplay  # noqa: E402
from eldr_sglang.sim.workload import make_workload  # noqa: E402
from tpot_study import eval_requests, provenance, workloads  # noqa: E402


class GuardedEldr:
    def __init__(self, inner, sigs, slack: float):
        self.inner, self.sig, self.valid, self.slack = inner, sigs[0], sigs[1], slack
        self.name = f"eldr+guard{slack:g}"

    def route(self, r: int) -> int:
        d = self.inner.router.route_signature(self.sig[r] if self.valid[r] else None, explain=True)
        loads = np.asarray(d.loads, dtype=np.float64)
        bound = loads.min() * (1 + self.slack) + 2
        if d.distances is None or loads[d.worker] <= bound:
            return int(d.worker)
        ok = np.nonzero(loads <= bound)[0]
        return int(ok[np.argmin(np.asarray(d.distances)[ok])])

    def acquire(self, w, tokens):
        return self.inner.acquire(w, tokens)

    def loads(self):
        return self.inner.loads()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    K, per = 8, 32
    lines = ["# Prototype: ELDR with a load guard (not the router's policy)", "",
             f"Command: `python benchmarks/explore_eldr_guard.py` (code: {provenance()}). K={K}, {per} clients per decode "
             "worker, closed loop, tau=0.1; see the script's docstring for the guard rule. Changes are against shortest_queue.", "",
             "| workload | policy | TPOT p50 | TPOT p99 | p50 vs SQ | p99 vs SQ | locality | imbalance |", "|---|---|---|---|---|---|---|---|"]
    tmp = tempfile.mkdtemp(prefix="eldr-guard-")
    for w in workloads(quick=False):
        if "uniform" in w["name"]:
            continue
        t = w["trace"]
        em = ExecutionModel(get_model(t.model), get_hardware(w["hardware"]))
        rp = TraceReplay(t)
        cpath = os.path.join(tmp, f"{w['name']}.eldr")
        fit_trace(t, workers=K, seed=0, requests=w["fit"]).write(cpath)
        sigs = eldr_signatures(rp, cpath)
        wl = make_workload(rp, requests=eval_requests(w["eval"], per * K), arrival="closed", concurrency=per * K)
        pols = [make_policy("shortest_queue", K), make_policy("eldr", K, replay=rp, centroids=cpath, signatures=sigs)]
        pols += [GuardedEldr(make_policy("eldr", K, replay=rp, centroids=cpath, signatures=sigs), sigs, s) for s in (0.1, 0.25)]
        base = None
        for p in pols:
            m = compute_metrics(simulate(rp, wl, p, em, ClusterConfig(num_decode=K)))
            t_ = m["tpot_ms"]
            base = base or t_
            lines.append(f"| {w['name']} | {p.name} | {t_['p50']:.2f} | {t_['p99']:.2f} | {(t_['p50'] / base['p50'] - 1) * 100:+.1f}% | "
                         f"{(t_['p99'] / base['p99'] - 1) * 100:+.1f}% | {m['expert_locality']:.3f} | {m['load_imbalance']:.2f} |")
            print(lines[-1], flush=True)
    out = Path(args.out) / "eldr_load_guard.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
