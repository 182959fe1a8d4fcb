"""`eldr demo`: the whole ELDR story on an embedded default, in about a minute on 2 cores.

1. Generate a synthetic, domain-skewed DeepSeek-V3 routing workload (eldr_sglang.traces.synth).
2. Fit the centroids (balanced K-means over prefill signatures) on its first part.
3. Simulate the PD cluster on the later part with every policy and a small load sweep.
4. Print the comparison table and write a plot and JSON to the output directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from eldr_sglang.cli import args as A


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="end-to-end demo: synthetic DeepSeek-V3 workload -> fit -> simulate -> table + plot",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--out", default="eldr-demo-out", help="output directory (default eldr-demo-out/)")
    p.add_argument("--model", default="deepseek-v3", help="synthetic model shape (default deepseek-v3)")
    p.add_argument("--hardware", default="h200", help="hardware profile (default h200)")
    p.add_argument("--workers", type=A.workers, default=8, help="decode workers K (default 8)")
    p.add_argument("--requests", type=A.integer(1, A.MAX_REQUESTS), default=1200, help="synthetic requests (default 1200)")
    p.add_argument("--fit-fraction", type=A.real(0.0, 1.0, lo_open=True, hi_open=True), default=1 / 3, help="first part of the trace used for the fit (default 1/3)")
    p.add_argument("--output-len", type=A.integer(1, A.MAX_TOKENS), default=128, help="output tokens per request (default 128)")
    p.add_argument("--concurrency", type=A.listed(A.integer(1, 1_000_000)), default="64,128,256,512", help="closed-loop loads to sweep (default 64,128,256,512)")
    p.add_argument("--tau", type=A.tau, default=0.1, help="ELDR band width (default 0.1)")
    p.add_argument("--eldr-load-factor", type=A.real(-1000.0, 1000.0), default=0.05, metavar="F",
                   help="also show ELDR with bounded loads F as 'eldr/F' (default 0.05; negative to skip)")
    p.add_argument("--taus", type=A.listed(A.tau, allow_empty=True), default="0,0.05,0.2,0.5", help="extra ELDR band widths shown at the middle load (default 0,0.05,0.2,0.5; '' for none)")
    p.add_argument("--uniform", action="store_true", help="uniform (no-locality) control workload instead")
    p.add_argument("--seed", type=A.seed, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    A.add_max_memory(p)
    p.set_defaults(func=run)


# Everything the demo writes into --out; an existing --out may hold only these.
DEMO_FILES = ("results.json", "results.md", "centroids.eldr", "tpot_vs_load.png", "policies.png", "manifest.json")


def run(args: argparse.Namespace) -> int:
    from eldr_sglang.io_safe import StagedDir
    from eldr_sglang.sim.report import write_json

    show = not args.no_progress
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if show else (lambda *a: None)
    K = args.workers
    loads = list(args.concurrency)  # parsed and checked by argparse
    from eldr_sglang import memory
    from eldr_sglang.models import model_shape

    shape = model_shape(args.model)
    memory.require(memory.synth_bytes(args.requests, (64 + 256) / 2 + args.output_len, shape["num_layers"], shape["top_k"],
                                      shape["num_experts"]), f"demo of {args.requests} requests", args.max_memory)
    t0 = time.perf_counter()
    # Every file goes into a fresh directory beside --out, swapped in at the end.
    with StagedDir(args.out, what="--out", owned=DEMO_FILES) as stage:
        wrote = _run(args, stage.tmp, K, loads, say, show)
        write_json({"tool": "eldr demo", "files": sorted(p.name for p in wrote), "seed": args.seed,
                    "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, stage.tmp / "manifest.json")
        final = stage.commit()
    print()
    print("wrote " + ", ".join(str(final / p.name) for p in wrote) + f"  ({time.perf_counter() - t0:.0f} s)")
    return 0


def _run(args, out: Path, K: int, loads: list, say, show: bool) -> list:
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.report import format_table
    from eldr_sglang.sim.runner import paper_check

    trace, fit, cpath, n_fit, eval_idx = _generate_and_fit(args, out, K, say, show)
    model = get_model(trace.model)
    em = ExecutionModel(model, get_hardware(args.hardware))
    sim = _simulate_loads(args, trace, str(cpath), eval_idx, em, K, loads, say, show)
    say("[4/4] writing results")
    print()
    print(f"ELDR demo: synthetic {'uniform' if args.uniform else 'domain-skewed'} {model.name}, fit on {n_fit} requests, "
          f"evaluated on {len(eval_idx)} others; {K} decode workers, {em.tp}x{em.hardware.name} each")
    print(paper_check(em))
    print()
    print(format_table(sim["main_pol"], title=f"closed loop, concurrency {sim['main_load']} "
                                              f"({sim['main_load'] / K:.0f} per decode worker)"))
    if "oracle" in sim["main_pol"]:
        print("oracle: a reference, not a policy a router can run: it routes by each request's domain label (the "
              "synthetic trace's; live traffic has none) to the shortest queue among the workers set aside for that domain")
    if sim["tau_rows"]:
        _print_tau_sweep(args.tau, sim["main_load"], sim["main_pol"], sim["tau_rows"])
    meta = {
        "tau_sweep": {n: m["tpot_ms"] for n, m in sim["tau_rows"].items()},
        "model": em.describe(), "workers": K, "fit_requests": n_fit, "eval_requests": int(len(eval_idx)),
        "concurrency": sim["main_load"], "tau": args.tau, "uniform": args.uniform, "seed": args.seed,
        "fit_report": getattr(fit, "report", None) if isinstance(getattr(fit, "report", None), (dict, str)) else None,
        "paper_check": paper_check(em),
    }
    return _write_results(out, cpath, meta, sim, title=f"{model.name}, K={K}")


def _generate_and_fit(args, out: Path, K: int, say, show: bool):
    """Steps 1-2: the synthetic trace, and centroids fitted on its first --fit-fraction.
    Returns (trace, fit, centroid path, fit requests, held-out request indices)."""
    import numpy as np

    from eldr_sglang.offline.fit import fit_trace
    from eldr_sglang.traces.synth import generate

    say(f"[1/4] generating a synthetic {'uniform' if args.uniform else 'domain-skewed'} {args.model} workload: "
        f"{args.requests} requests, {args.output_len} output tokens each")
    trace = generate(model=args.model, requests=args.requests, domains=8, uniform=args.uniform, seed=args.seed,
                     prompt_len=(64, 256), output_len=args.output_len)
    n_fit = max(K, int(round(args.requests * args.fit_fraction)))
    fit_idx = np.arange(n_fit)
    eval_idx = np.arange(n_fit, trace.num_requests)
    if len(eval_idx) < K:
        raise ValueError("too few requests left to evaluate; raise --requests")

    say(f"[2/4] fitting {K} centroids on the first {n_fit} requests (tau={args.tau})")
    cpath = out / "centroids.eldr"
    fit = fit_trace(trace, workers=K, tau=args.tau, layers="middle", seed=args.seed, requests=fit_idx, progress=show)
    fit.write(str(cpath))
    return trace, fit, cpath, n_fit, eval_idx


def _simulate_loads(args, trace, cpath: str, eval_idx, em, K: int, loads: list, say, show: bool) -> dict:
    """Step 3: every policy at every closed-loop load, and the tau sweep at the middle load."""
    from eldr_sglang.sim.cluster import ClusterConfig
    from eldr_sglang.sim.policies import eldr_signatures
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.sim.runner import parse_policies, run_comparison
    from eldr_sglang.workload import replay_workload

    replay = TraceReplay(trace)
    bounded = f",eldr/{args.eldr_load_factor:g}" if args.eldr_load_factor >= 0 else ""
    # `default` is the router's default policy (eldr_sglang.defaults): the demo shows what users run
    specs = parse_policies(f"random,round_robin,shortest_queue,power_of_two,eldr{bounded},default,oracle", args.tau)
    cfg = ClusterConfig(num_decode=K)
    say(f"[3/4] simulating {len(eval_idx)} held-out requests on {K} decode workers x tp={em.tp} {em.hardware.name}, "
        f"loads {loads}, {len(specs)} policies")
    sweep: dict[str, list] = {s.label: [] for s in specs}
    runs = []
    sigs = eldr_signatures(replay, cpath)
    main_load = loads[len(loads) // 2] if len(loads) > 1 else loads[0]
    main_pol, main_res = None, None
    for c in loads:
        wl = replay_workload(replay, requests=eval_idx, arrival="closed", concurrency=c, seed=args.seed)
        pol, res = run_comparison(replay, wl, specs, em, cfg, centroids=cpath, seed=args.seed,
                                  progress=show, keep_results=(c == main_load), signatures=sigs)
        say(f"      concurrency {c}: " + ", ".join(f"{n} {m['tpot_ms']['p50']:.2f}" for n, m in pol.items()) + " ms TPOT p50")
        for n, m in pol.items():
            sweep[n].append((c, m))
        runs.append({"concurrency": c, "policies": pol})
        if c == main_load:
            main_pol, main_res = pol, res

    tau_rows = {}
    if list(args.taus):
        wl = replay_workload(replay, requests=eval_idx, arrival="closed", concurrency=main_load, seed=args.seed)
        tspecs = parse_policies(",".join(f"eldr@{x:g}" for x in args.taus))
        tau_rows, _ = run_comparison(replay, wl, tspecs, em, cfg, centroids=cpath, seed=args.seed,
                                     progress=show, signatures=sigs)
    return {"sweep": sweep, "runs": runs, "main_load": main_load, "main_pol": main_pol, "main_res": main_res,
            "tau_rows": tau_rows}


def _print_tau_sweep(tau: float, main_load: int, main_pol: dict, tau_rows: dict) -> None:
    from eldr_sglang.sim.report import best_balancer

    base = best_balancer(main_pol)  # the table's baseline, so both read the same change
    sq = main_pol[base]["tpot_ms"]
    print()
    print(f"tau sweep at concurrency {main_load} (small tau: more locality, less balance; changes vs {base}, "
          "as in the table):")
    for n, m in {"eldr@" + f"{tau:g}": main_pol["eldr"], **tau_rows}.items():
        t = m["tpot_ms"]
        print(f"  {n:10s} TPOT p50 {t['p50']:6.2f} ms ({(t['p50'] / sq['p50'] - 1) * 100:+5.1f}%), "
              f"p99 {t['p99']:6.2f} ms ({(t['p99'] / sq['p99'] - 1) * 100:+5.1f}%), "
              f"experts/layer/step {m['unique_experts_per_layer_step']:6.1f}, imbalance {m['load_imbalance']:.2f}")


def _write_results(out: Path, cpath: Path, meta: dict, sim: dict, title: str) -> list:
    """results.json, results.md and the two plots (skipped without matplotlib); returns the paths."""
    from eldr_sglang.io_safe import write_text
    from eldr_sglang.sim.report import json_summary, markdown_table, plot_runs, plot_sweep, write_json

    main_pol, main_res = sim["main_pol"], sim["main_res"]
    obj = json_summary(main_pol, meta)
    obj["sweep"] = sim["runs"]
    write_json(obj, out / "results.json")
    write_text(out / "results.md", markdown_table(main_pol) + "\n")
    wrote = [out / "results.json", out / "results.md", cpath]
    try:
        plot_sweep(sim["sweep"], out / "tpot_vs_load.png", xlabel="concurrency (clients)", title=title)
        plot_runs(main_pol, {n: r.step_distinct for n, r in main_res.items()}, out / "policies.png",
                  title=f"{title}, concurrency {sim['main_load']}")
        wrote += [out / "tpot_vs_load.png", out / "policies.png"]
    except RuntimeError as exc:  # matplotlib missing
        print(f"note: {exc}", file=sys.stderr)
    return wrote
