"""What do router replicas cost the default's locality, and do worker reports win it back?
(issue 32 item 1, simulated)

    python benchmarks/replicas_study.py --json benchmarks/results/replicas_study.json \
        --md benchmarks/results/replicas_study.md

R router replicas (eldr_sglang/sim/replicas.py) in front of one simulated cluster, K = 8
decode workers; each client request reaches a replica at random. Every replica is its own
Rust Router with its own in-flight counts and expert view, reading the workers' loads every
load-monitor interval (1 s). Modes: `own_view` (today: each replica's expert view holds
only its own requests), `worker_reports` (the service as built: the workers' occupancy
reports from their requests' profiles, blended by each replica's core, and `--router-replicas
R`, at the service's default interval for it: 0.25 s with R > 1), `worker_reports_no_replicas_flag`
(the reports without `--router-replicas`, 1 s polls), `leases` (the first study's model of
reports: each replica sees the others' requests as of the last poll), `no_polls` (the
service with `--load-monitor-interval 0`: each replica balances its own share alone), and
three variants of `leases`: `leases_projected` (each routed request also
counts R - 1 load-only leases on its worker until that worker's next poll),
`leases_mirrored` (the same leases, also ended when the request finishes), and
`leases_own_cap` (each replica's load cap on its own requests only, as in
`no_polls`). The balancers run behind the same replicas, so each change is against the
best balancer of the same R and mode. `--modes` runs a subset of the modes.

Workloads: GPT-OSS-20B's real trace (../shared, H100) and DeepSeek-V3 synthetic (8xH200), the
strict protocol's closed-loop cells (8 and 32 clients per worker, shuffled held-out requests,
fixed outputs, warm-up dropped), one split. Reported per (workload, cell, R, mode): the
default's TPOT p50 and p99 change, the distinct experts per layer-step, and herding (the
largest worker's time-weighted batch over the mean). The summary: per R and mode the median
p50 change over the cells; `gap_points_r4_<mode>` = that at R = 4 minus R = 1, in points.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eldr_sglang.sim.replicas import MODES  # noqa: E402  (own_view, leases, ... own_view_replicas)

REPLICAS = (1, 2, 4, 8)
BALANCERS = ("random", "round_robin", "shortest_queue", "power_of_two")


def herding(res, K: int) -> float:
    """The largest worker's time-weighted mean batch over the mean of the workers'."""
    w = np.asarray(res.step_worker)
    busy = np.bincount(w, weights=np.asarray(res.step_batch) * np.asarray(res.step_dt), minlength=K)
    span = float(np.max(np.asarray(res.step_start) + np.asarray(res.step_dt)) - np.min(res.step_start))
    per = busy / max(span, 1e-12)
    return float(per.max() / max(per.mean(), 1e-12))


def poll_interval(mode: str, R: int, given: float | None) -> float:
    """The load-monitor interval of a run: the one given, else the router's default, which
    `--router-replicas R` (the `worker_reports` mode) makes 0.25 s for R > 1."""
    from eldr_sglang.router.config import DEFAULT_LOAD_MONITOR_INTERVAL_S, default_load_monitor_interval

    if given is not None:
        return given
    return default_load_monitor_interval(R) if mode in ("worker_reports", "own_view_replicas") else DEFAULT_LOAD_MONITOR_INTERVAL_S


def run_cell(replay, em, K: int, idx, clients: int, R: int, mode: str, seed: int, poll_s: float | None = None) -> dict:
    from eldr_sglang.defaults import default_policy_label
    from eldr_sglang.sim.cluster import ClusterConfig, simulate
    from eldr_sglang.sim.metrics import compute_metrics
    from eldr_sglang.sim.policies import make_policy
    from eldr_sglang.sim.protocol import FIXED_OUTPUT_LEN, WARMUP_FRAC
    from eldr_sglang.sim.replicas import Replicas
    from eldr_sglang.sim.runner import parse_policies
    from eldr_sglang.workload import replay_workload

    wl = replay_workload(replay, requests=idx, order="trace", output_len=FIXED_OUTPUT_LEN, seed=seed,
                         arrival="closed", concurrency=clients)
    default = default_policy_label()
    profiles = replay.expert_profiles()
    out = {}
    for spec in parse_policies(",".join((*BALANCERS, default))):
        def make(k, spec=spec):
            return make_policy(spec.policy, K, replay=replay, seed=seed * 100 + k, load_factor=spec.load_factor,
                               profiles=profiles if spec.policy == "locality" else None, request_cost=spec.request_cost)
        pol = Replicas(make, R, K, mode=mode, seed=seed)
        res = simulate(replay, wl, pol, em, ClusterConfig(num_decode=K, load_report_interval_s=poll_interval(mode, R, poll_s)))
        m = compute_metrics(res, warmup_frac=WARMUP_FRAC)
        out[spec.label] = {"tpot_p50_ms": m["tpot_ms"]["p50"], "tpot_p99_ms": m["tpot_ms"]["p99"],
                           "distinct": m["unique_experts_per_layer_step"], "herding": herding(res, K)}
    best = min(BALANCERS, key=lambda b: out[b]["tpot_p50_ms"])
    best99 = min(out[b]["tpot_p99_ms"] for b in BALANCERS)
    d = out[default]
    return {"policies": out, "best_balancer": best, "poll_s": poll_interval(mode, R, poll_s),
            "p50_change": 100 * (d["tpot_p50_ms"] / out[best]["tpot_p50_ms"] - 1),
            "p99_change": 100 * (d["tpot_p99_ms"] / best99 - 1),
            "distinct": d["distinct"], "herding": d["herding"]}


def run_workload(w: dict, seed: int, requests: int, log, poll_s: float | None = None, modes=MODES) -> list[dict]:
    import per_request_cost_study as prc
    from eldr_sglang.sim.protocol import eval_sequence, random_splits
    from eldr_sglang.sim.replay import TraceReplay

    trace = w["make"]()
    replay = TraceReplay(trace)
    em = prc.execution_models(w, trace, full=False)["default"]
    _, ev = random_splits(replay.num_requests, 1, seed)[0]
    idx = eval_sequence(ev, "shuffle", requests, seed)
    rows = []
    for per_worker in (8, 32):
        for R in REPLICAS:
            for mode in modes:
                t0 = time.perf_counter()
                r = run_cell(replay, em, w["K"], idx, per_worker * w["K"], R, mode, seed, poll_s)
                rows.append({"workload": w["name"], "per_worker": per_worker, "R": R, "mode": mode, **r})
                log(f"   {w['name']} {per_worker}/worker R={R} {mode:14s} default p50 {r['p50_change']:+.1f}% "
                    f"p99 {r['p99_change']:+.1f}% distinct {r['distinct']:.2f} herding {r['herding']:.2f} "
                    f"({time.perf_counter() - t0:.0f} s)")
    return rows


def summary(rows: list[dict]) -> dict:
    out: dict = {"by_R": {}}
    present = {r["mode"] for r in rows}
    modes = [m for m in MODES if m in present]
    for R in REPLICAS:
        out["by_R"][str(R)] = {mode: {"p50_change_median": float(np.median([r["p50_change"] for r in rows if r["R"] == R and r["mode"] == mode])),
                                      "p99_change_median": float(np.median([r["p99_change"] for r in rows if r["R"] == R and r["mode"] == mode])),
                                      "runs": sum(r["R"] == R and r["mode"] == mode for r in rows)}
                               for mode in modes}
    for mode in modes:
        out[f"gap_points_r4_{mode}"] = out["by_R"]["4"][mode]["p50_change_median"] - out["by_R"]["1"][mode]["p50_change_median"]
    return out


def table(rows: list[dict], s: dict) -> list[str]:
    modes = list(s["by_R"]["1"])
    lines = ["| workload | clients/worker | R | mode | default p50 | default p99 | distinct/layer-step | herding | best balancer |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['per_worker']} | {r['R']} | {r['mode']} | {r['p50_change']:+.1f}% | {r['p99_change']:+.1f}% | "
              f"{r['distinct']:.2f} | {r['herding']:.2f} | {r['best_balancer']} |" for r in rows]
    lines += ["", "Changes: the default against the best balancer behind the same replicas (negative: faster).", "",
              "| R | " + " | ".join(f"{m} p50 (median) | {m} p99" for m in modes) + " |", "|---|" + "---|---|" * len(modes)]
    for R, v in s["by_R"].items():
        lines.append(f"| {R} | " + " | ".join(f"{v[m]['p50_change_median']:+.2f}% | {v[m]['p99_change_median']:+.2f}%" for m in modes) + " |")
    lines += ["", "; ".join(f"gap_points_r4_{m}: {s[f'gap_points_r4_{m}']:+.2f}" for m in modes)]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: the strict protocol's minimum)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-monitor-interval", type=float, default=None, metavar="S",
                    help="seconds between the replicas' polls of the workers, every mode (default: the router's "
                    "default, 1 s, and 0.25 s where --router-replicas R > 1 is set: own_view_replicas, worker_reports)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes to run (default: all of {', '.join(MODES)})")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--md", metavar="PATH")
    a = ap.parse_args(argv)
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: unknown mode {bad[0]!r} (known: {', '.join(MODES)})" if bad else "--modes: none given")
    for p in (a.json, a.md):
        if p and Path(p).exists():
            ap.error(f"{p} exists; move it away first (nothing is overwritten)")
    if a.load_monitor_interval is not None and not a.load_monitor_interval > 0:
        ap.error("--load-monitor-interval must be > 0")
    import per_request_cost_study as prc
    from eldr_sglang.sim.protocol import STRICT_MIN_REQUESTS

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    try:
        rows = [r for w in prc.workloads() for r in run_workload(w, a.seed, a.requests or STRICT_MIN_REQUESTS, log, a.load_monitor_interval, modes)]
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = summary(rows)
    lines = table(rows, s)
    print("\n".join(lines))
    from eldr_sglang import io_safe

    if a.json:
        io_safe.write_json({"runs": rows, **s, "load_monitor_interval_s": a.load_monitor_interval or "router defaults", "seed": a.seed,
                            "requests": a.requests or STRICT_MIN_REQUESTS,
                            "runtime_s": round(time.perf_counter() - t0, 1)}, a.json, indent=1)
    if a.md:
        io_safe.write_text(a.md, "\n".join(lines) + "\n", what="--md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
