"""Production-scale traces: `eldr synth` (trace v2, streamed) and `eldr fit` from disk, by the CLI.

Each step runs as its own `eldr` process; the table gives its wall time, its CPU time (with
its worker processes') and its peak RSS (the sum over the process and its workers, sampled
from /proc, or the child's ru_maxrss from wait4 if larger), next to the goal of issue 13. The load average is
printed with each step: the machine is shared, and times depend on it.

    python benchmarks/bench_scale.py --json benchmarks/results/bench_scale.json
    python benchmarks/bench_scale.py --case gptoss-1m --json benchmarks/results/bench_scale_1m.json

Cases:
- deepseek-100k: `eldr synth --model deepseek-v3 --requests 100000` (defaults: prompts 128-512,
  decode routing of the first 10,000 requests kept), then `eldr fit` K=8 on that file.
  Goals: synth < 4 GiB peak RSS; fit <= 60 s.
- gptoss-1m: `eldr synth --model gpt-oss-20b --requests 1000000 --keep-decode 10000`, then
  `eldr fit` K=64. Goal: both together <= 15 min and <= 8 GiB peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

GIB = 1 << 30

CASES = {
    "deepseek-100k": {
        "synth": ["--model", "deepseek-v3", "--requests", "100000"],
        "fit": ["--workers", "8"],
        "goals": {"synth_rss_gib": 4.0, "fit_wall_s": 60.0},
    },
    "gptoss-1m": {
        "synth": ["--model", "gpt-oss-20b", "--requests", "1000000"],
        "fit": ["--workers", "64"],
        "goals": {"total_wall_s": 900.0, "peak_rss_gib": 8.0},
    },
}


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (its worker processes), from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmRSS:"))
            with open(f"/proc/{p}/task/{p}/children") as fh:
                todo += [int(c) for c in fh.read().split()]
        except (OSError, StopIteration, ValueError):
            pass  # gone meanwhile
    return total


def run_step(argv: list[str], timeout_s: float | None = None) -> dict:
    """Run one command; its wall time, CPU time (its own and its reaped workers'), peak RSS
    and exit status, and the machine's 1-minute load average sampled every 5 s while it ran
    (the machine is shared). ru_maxrss is the largest single process; with worker processes
    the peak of their sum (sampled every 0.5 s from /proc) is reported as peak_tree_rss_gib."""
    load = os.getloadavg()[0]
    samples: list[float] = []
    tree = [0]
    stop = threading.Event()

    def sample():
        n = 0
        while not stop.wait(0.5):
            tree[0] = max(tree[0], _tree_rss(proc.pid))
            n += 1
            if n % 10 == 0:
                samples.append(os.getloadavg()[0])

    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    killer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
    if killer is not None:
        killer.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    timed_out = killer is not None and not killer.is_alive() and wall >= timeout_s
    if killer is not None:
        killer.cancel()
    stop.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    samples = samples or [os.getloadavg()[0]]
    return {"argv": argv, "rc": proc.returncode, "wall_s": wall, "peak_rss_gib": usage.ru_maxrss * 1024 / GIB,
            "peak_tree_rss_gib": max(tree[0], usage.ru_maxrss * 1024) / GIB,
            "cpu_s": usage.ru_utime + usage.ru_stime, "load_before": load, "load_after": os.getloadavg()[0],
            "load_during": {"min": min(samples), "mean": sum(samples) / len(samples), "max": max(samples)},
            "timed_out": bool(timed_out), "output_tail": out[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="case(s) to run (default deepseek-100k)")
    ap.add_argument("--dir", help="directory for the trace and centroid files (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--reuse", action="store_true",
                    help="keep a trace already in --dir and the synth row of the same case from the --json file "
                         "(re-measure the fit only)")
    ap.add_argument("--step-timeout", type=float, default=None,
                    help="kill a step after this many seconds (it is then reported as timed out)")
    args = ap.parse_args()
    eldr = [sys.executable, "-m", "eldr_sglang"]
    work = args.dir or tempfile.mkdtemp(prefix="bench_scale.")
    os.makedirs(work, exist_ok=True)
    rows = []
    print(f"bench_scale on {platform.machine()} with {os.cpu_count()} CPUs; files in {work}")
    for name in args.case or ["deepseek-100k"]:
        case = CASES[name]
        trace, cent = os.path.join(work, f"{name}.npz"), os.path.join(work, f"{name}.eldr")
        previous = {}
        if args.reuse and args.json and os.path.exists(args.json):
            with open(args.json) as fh:
                previous = {r["case"]: r for r in json.load(fh)["rows"]}
        if args.reuse and os.path.exists(trace) and name in previous:
            synth = dict(previous[name]["synth"], reused=True)
        else:
            synth = run_step([*eldr, "synth", *case["synth"], "--out", trace, "--no-progress"], args.step_timeout)
        size = os.path.getsize(trace) / GIB if os.path.exists(trace) else float("nan")
        fit = run_step([*eldr, "fit", trace, *case["fit"], "--out", cent, "--json", cent + ".json", "-q"], args.step_timeout)
        rep = {}
        if fit["rc"] == 0:
            with open(cent + ".json") as fh:
                rep = json.load(fh)
        row = {"case": name, "synth": synth, "fit": fit, "trace_gib": size, "goals": case["goals"],
               "fit_report": {k: rep.get(k) for k in ("n_fitted", "dim", "cluster_sizes", "balanced", "seconds")}
               | {"optimal_assignment": rep.get("kmeans", {}).get("optimal_assignment"),
                  "signature_density": rep.get("kmeans", {}).get("signature_density")}}
        rows.append(row)
        for step, r in (("synth", synth), ("fit", fit)):
            ld = r.get("load_during") or {"mean": float("nan"), "max": float("nan")}
            print(f"  {name:14s} {step:5s}: rc {r['rc']}  wall {r['wall_s']:7.1f} s  cpu {r['cpu_s']:7.1f} s  "
                  f"peak RSS {r.get('peak_tree_rss_gib', r['peak_rss_gib']):5.2f} GiB  load {r['load_before']:.1f} -> {r['load_after']:.1f} "
                  f"(during: mean {ld['mean']:.1f}, max {ld['max']:.1f})")
            if r.get("timed_out"):
                print(f"    killed after {args.step_timeout:.0f} s (--step-timeout): did not finish")
            elif r["rc"] != 0:
                print("    " + r["output_tail"].strip().replace("\n", "\n    "))
        fr = row["fit_report"]
        print(f"  {name:14s} trace {size:.2f} GiB on disk; fit: {fr['n_fitted']} requests, D={fr['dim']}, sizes "
              f"{min(fr['cluster_sizes'] or [0])}..{max(fr['cluster_sizes'] or [0])}, balanced {fr['balanced']}, "
              f"certified optimal {fr['optimal_assignment']}")
        g = case["goals"]
        if "synth_rss_gib" in g:
            srss = synth.get("peak_tree_rss_gib", synth["peak_rss_gib"])
            print(f"  goal synth peak RSS < {g['synth_rss_gib']} GiB: {srss:.2f} GiB "
                  f"({'met' if synth['rc'] == 0 and srss < g['synth_rss_gib'] else 'NOT met'})")
            print(f"  goal fit wall <= {g['fit_wall_s']:.0f} s: {fit['wall_s']:.1f} s "
                  f"({'met' if fit['rc'] == 0 and fit['wall_s'] <= g['fit_wall_s'] else 'NOT met'}); "
                  f"its CPU time {fit['cpu_s']:.1f} s (on 2 CPUs a fit can take less wall than CPU)")
        else:
            total = synth["wall_s"] + fit["wall_s"]
            peak = max(r.get("peak_tree_rss_gib", r["peak_rss_gib"]) for r in (synth, fit))
            ok = synth["rc"] == 0 and fit["rc"] == 0
            print(f"  goal synth+fit <= {g['total_wall_s']:.0f} s: {total:.1f} s "
                  f"({'met' if ok and total <= g['total_wall_s'] else 'NOT met'}); "
                  f"peak <= {g['peak_rss_gib']} GiB: {peak:.2f} GiB ({'met' if ok and peak <= g['peak_rss_gib'] else 'NOT met'})")
        if not args.keep:
            for p in (trace, cent, cent + ".json"):
                if os.path.exists(p):
                    os.remove(p)
    if args.json:
        from eldr_sglang.io_safe import write_json

        write_json({"machine": {"arch": platform.machine(), "cpus": os.cpu_count()}, "rows": rows}, args.json)
    return 0 if all(r["synth"]["rc"] == 0 and r["fit"]["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
