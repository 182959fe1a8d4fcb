"""Drift study: static vs adaptive ELDR when the domain mix shifts mid-run (simulated).

    python benchmarks/drift_study.py [--quick] [--json] [--out benchmarks/results]

Workload: a synthetic GPT-OSS-20B-shaped trace (eldr_sglang.traces.synth, calibrated defaults, one
routing model throughout). Phase A draws its requests from domains 0-3, phase B from domains
4-7 (bursts of one domain stay bursts). The centroids are fitted on a separate calibration
set from phase A's domains only. Requests are replayed in order by closed-loop clients on K=8
decode workers (H100 each), so the stream switches from A to B halfway.

Part 1 (drift), at `--load` clients per worker, every policy on the same workload:
- shortest_queue                   the best load balancer of the TPOT study
- eldr                             static: the phase-A fit all the way (tau 0.1)
- eldr+drift-refit                 DriftMonitor + reservoir; a refit when drift is detected,
                                   on the signatures seen since its onset
- eldr+periodic-refit              a refit every 1000 routed requests on the latest 1024
                                   (a reservoir horizon of one interval), no detection
- eldr+drift-refit+bl0.25          drift refit plus bounded loads (load_factor 0.25)
- eldr(ideal swap)                 reference, not deployable: the same refit on clean
                                   phase-B calibration requests, swapped in exactly at the shift
Refits run synchronously (the simulated clock is paused) and the new centroids take effect
64 routed requests later (the background refit's latency, ~1-2 s of wall time here).

Part 2 (adaptive band): fixed tau=0.1 vs bounded loads (load_factor 0.05/0.1/0.25/0.5 on top of
tau 0.1) with static centroids, at several loads, on the stationary phase-A stream and on the
drifting A->B stream.

Part 4 (rolling drift): one domain of the four in use is replaced every 1600 requests (1000
with --quick), four times; fit on the first set.

Part 3 (real routing): part 1's comparison on ../shared/traces/gptoss20b.npz split by domain
(see `setup_real`; the trace is small, so requests repeat -- stated in the report).

Nothing is tuned to the outcome: the monitor, reservoir and controller use their defaults
except the cooldown/interval in requests; execution-model constants are the simulator's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from eldr_sglang.drift.refit import refit_file  # noqa: E402
from eldr_sglang.testing.provenance import code_state  # noqa: E402
from eldr_sglang.drift.drifting_workload import AdaptivePolicy, drifting_trace  # noqa: E402
from eldr_sglang.offline.fit import fit_trace  # noqa: E402
from eldr_sglang.sim.cluster import ClusterConfig, simulate  # noqa: E402
from eldr_sglang.sim.cost_model import ExecutionModel  # noqa: E402
from eldr_sglang.sim.policies import eldr_signatures, make_policy  # noqa: E402
from eldr_sglang.models import get_model  # noqa: E402
from eldr_sglang.sim.profiles import get_hardware  # noqa: E402
from eldr_sglang.sim.replay import TraceReplay  # noqa: E402
from eldr_sglang.workload import replay_workload  # noqa: E402

K = 8
TAU = 0.1
DOMAINS_A = [0, 1, 2, 3]
DOMAINS_B = [4, 5, 6, 7]
ACTIVATION_DELAY = 64
SHARED = Path(os.environ.get("ELDR_SHARED_TRACES", ROOT.parent / "shared" / "traces"))


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def pct(new, old):
    return (new / old - 1.0) * 100.0 if old else float("nan")


class IdealSwap:
    """Reference only: static ELDR that swaps to the phase-B fit at a given routed request."""

    uses_labels = False

    def __init__(self, path_a, path_b, sigs, swap_at, workdir, seed=0):
        from eldr_sglang import _core

        self.name = "eldr(ideal swap)"
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "ideal.eldr")
        shutil.copyfile(path_a, self.path)
        self.path_b = path_b
        self.router = _core.Router(policy="eldr", num_workers=K, centroids=self.path, tau=TAU, seed=seed, reload_interval_ms=0)
        self.sig, self.valid = sigs
        self.swap_at = swap_at
        self.count = 0
        self.events = []

    def route(self, r):
        if self.count == self.swap_at:
            shutil.copyfile(self.path_b, self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)
            self.router.reload()
            self.events.append({"triggered_at": self.count, "activated_at": self.count, "reason": "ideal swap at the shift"})
        self.count += 1
        return int(self.router.route_signature(self.sig[r] if self.valid[r] else None))

    def acquire(self, w, tokens):
        return self.router.acquire(w, tokens)

    def loads(self):
        return list(self.router.loads())


def setup(seed: int, n_phase: int, calib: int, tmp: str):
    t0 = time.perf_counter()
    tr, cal, ph = drifting_trace([(DOMAINS_A, n_phase), (DOMAINS_B, n_phase), (DOMAINS_B, calib)],
                                 calibration=calib, seed=seed, prompt_len=(64, 256), output_len=128)
    fa = fit_trace(tr, workers=K, tau=TAU, requests=cal, seed=seed)
    pa = os.path.join(tmp, f"a{seed}.eldr")
    fa.write(pa)
    replay = TraceReplay(tr)
    sigs = eldr_signatures(replay, pa)
    # the ideal reference: the same refit procedure (phase-A SignatureSpec kept), on clean
    # phase-B calibration signatures
    pb = os.path.join(tmp, f"b{seed}.eldr")
    cal_b = np.flatnonzero((ph == 2) & sigs[1])
    refit_file(pa, sigs[0][cal_b], pb, reason="ideal reference: phase-B calibration set", seed=seed)
    ev = np.flatnonzero((ph == 0) | (ph == 1))  # calibration requests and phase-B calibration are not replayed
    log(f"seed {seed}: trace {tr.num_requests} requests, two fits, {time.perf_counter() - t0:.1f} s")
    return dict(name=f"seed {seed}", trace=tr, replay=replay, sigs=sigs, pa=pa, pb=pb, eval=ev, phase=ph[ev], fit_a=fa.report)


def make(label, s, tmp, seed, interval, cooldown, lf=None):
    common = dict(tau=TAU, seed=seed, activation_delay=ACTIVATION_DELAY, cooldown=cooldown)
    work = os.path.join(tmp, f"w{seed}-{label}")
    if label == "shortest_queue":
        return make_policy("shortest_queue", K, seed=seed)
    if label.startswith("eldr@"):  # static with bounded loads "eldr@0.1+bl0.25"
        p = make_policy("eldr", K, centroids=s["pa"], tau=TAU, seed=seed, signatures=s["sigs"])
        if lf is not None:
            p.router.load_factor = lf
        return p
    if label == "eldr":
        return make_policy("eldr", K, centroids=s["pa"], tau=TAU, seed=seed, signatures=s["sigs"])
    if label == "eldr+drift-refit":
        return AdaptivePolicy(label, K, s["pa"], s["sigs"], work, on_drift=True, **common)
    if label == "eldr+drift-refit+bl0.25":
        return AdaptivePolicy(label, K, s["pa"], s["sigs"], work, on_drift=True, load_factor=0.25, **common)
    if label == "eldr+periodic-refit":
        # the reservoir covers one interval, so each refit fits the latest traffic
        return AdaptivePolicy(label, K, s["pa"], s["sigs"], work, on_drift=False, interval=interval,
                              reservoir_kw=dict(capacity=1024, horizon=1024), **common)
    if label == "eldr(ideal swap)":
        return IdealSwap(s["pa"], s["pb"], s["sigs"], int(np.argmax(s["phase"] == 1)), work, seed=seed)
    raise ValueError(label)


def run_part1(labels, s, tmp, seed, interval, cooldown, em, cfg, conc):
    """Every part-1 policy on scenario s: per-phase stats, refit events and TPOT curves."""
    wl = replay_workload(s["replay"], requests=s["eval"], arrival="closed", concurrency=conc, seed=seed)
    stats, evs, curves = {}, {}, {}
    for lab in labels:
        t0 = time.perf_counter()
        pol = make(lab, s, tmp, seed, interval, cooldown)
        res = simulate(s["replay"], wl, pol, em, cfg)
        assert (res.completions == 1).all(), f"{lab}: a request was lost or duplicated"
        st = stats[lab] = phase_stats(res, s["phase"], skip=conc)
        ev = getattr(pol, "events", [])
        curves[lab] = {**tpot_curve(res, 20), "refits": activation_times(res, ev)}
        curves["_shift"] = float(np.nanmin(res.arrival[s["phase"] == 1]))
        evs[lab] = [{k: v for k, v in e.items() if k != "error" or v} for e in ev]
        log(f"  {s['name']} {lab:26s} A {st['A']['tpot_mean']:.3f}  B early {st['B early']['tpot_mean']:.3f}  "
            f"B late {st['B late']['tpot_mean']:.3f} ms  refits {len(ev)}  ({time.perf_counter() - t0:.1f} s)")
    return stats, evs, curves


ROLLING = [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7]]


def run_rolling(n_phase: int, calib: int, tmp: str, interval: int, cooldown: int, load: int, em) -> dict:
    """Part 4, a rolling drift (seed 0): every n_phase requests one domain of the four in use is
    replaced by a new one; fitted on phase 0's domains."""
    t0 = time.perf_counter()
    tr, cal, ph = drifting_trace([(d, n_phase) for d in ROLLING], calibration=calib, seed=0,
                                 prompt_len=(64, 256), output_len=128)
    fa = fit_trace(tr, workers=K, tau=TAU, requests=cal, seed=0)
    pa = os.path.join(tmp, "roll-a.eldr")
    fa.write(pa)
    replay = TraceReplay(tr)
    sigs = eldr_signatures(replay, pa)
    ev = np.flatnonzero(ph >= 0)
    s = dict(name="rolling", pa=pa, sigs=sigs, phase=ph[ev])
    conc = load * K
    wl = replay_workload(replay, requests=ev, arrival="closed", concurrency=conc, seed=0)
    C = np.asarray(_core_centroids(pa))
    out = {"phases": ROLLING, "requests_per_phase": n_phase, "d_star": [], "stats": {}, "refits": {}}
    for i in range(len(ROLLING)):
        S = sigs[0][ev[(ph[ev] == i) & sigs[1][ev]]]
        out["d_star"].append(float((1.0 - S @ C.T).min(axis=1).mean()))
    log(f"rolling drift: {tr.num_requests} requests, fit, {time.perf_counter() - t0:.1f} s")
    for lab in ["shortest_queue", "eldr", "eldr+drift-refit", "eldr+periodic-refit", "eldr+drift-refit+bl0.25"]:
        t1 = time.perf_counter()
        pol = make(lab, s, tmp, 0, interval, cooldown)
        res = simulate(replay, wl, pol, em, ClusterConfig(num_decode=K))
        assert (res.completions == 1).all(), f"{lab}: a request was lost or duplicated"
        tp = (res.finish - res.first_token) / np.maximum(res.output_len - 1, 1) * 1e3
        keep = np.arange(len(tp)) >= conc
        out["stats"][lab] = [float(tp[(s["phase"] == i) & keep].mean()) for i in range(len(ROLLING))]
        out["refits"][lab] = [e["triggered_at"] for e in getattr(pol, "events", [])]
        log(f"  rolling {lab:26s} " + " ".join(f"{x:.3f}" for x in out["stats"][lab])
            + f"  refits at {out['refits'][lab]}  ({time.perf_counter() - t1:.1f} s)")
    return out


def _core_centroids(path):
    from eldr_sglang import _core

    return _core.CentroidSet.open(path).centroids()


def setup_real(path: Path, n_phase: int, tmp: str):
    """The real GPT-OSS-20B trace split by domain: phase A = the alphabetically first half of
    the domain names, phase B = the rest. Half of phase A's requests (seeded) are the
    calibration set; the stream replays the other half of A, then all of B, each repeated in
    trace order to n_phase requests. Caveat: with only 703 requests the stream repeats them,
    so a refit on B's traffic (adaptive or ideal) has seen the very requests it then routes."""
    from eldr_sglang.traces import load_trace

    t = load_trace(path)
    dom = np.asarray(t.domain).astype(str)
    names = sorted(set(dom))
    da, db = names[: len(names) // 2], names[len(names) // 2:]
    ia, ib = np.flatnonzero(np.isin(dom, da)), np.flatnonzero(np.isin(dom, db))
    perm = np.random.default_rng(0).permutation(len(ia))
    cal, ev_a = np.sort(ia[perm[: len(ia) // 2]]), np.sort(ia[perm[len(ia) // 2:]])
    fa = fit_trace(t, workers=K, tau=TAU, requests=cal, seed=0)
    pa = os.path.join(tmp, "real-a.eldr")
    fa.write(pa)
    replay = TraceReplay(t)
    sigs = eldr_signatures(replay, pa)
    pb = os.path.join(tmp, "real-b.eldr")
    refit_file(pa, sigs[0][ib[sigs[1][ib]]], pb, reason="ideal reference: all phase-B requests (in-sample)", seed=0)
    ev = np.concatenate([np.resize(ev_a, n_phase), np.resize(ib, n_phase)])
    phase = np.concatenate([np.zeros(n_phase, int), np.ones(n_phase, int)])
    log(f"real trace: A = {da} ({len(ia)} requests, {len(cal)} calibration), B = {db} ({len(ib)})")
    return dict(name="real", trace=t, replay=replay, sigs=sigs, pa=pa, pb=pb, eval=ev, phase=phase, fit_a=fa.report,
                domains_a=da, domains_b=db, n_cal=int(len(cal)), n_a=int(len(ev_a)), n_b=int(len(ib)))


def phase_stats(res, phase, skip: int) -> dict:
    """TPOT per phase (A after the first `skip` requests: the closed loop's ramp-up; B early =
    its first third, B late = the rest) and expert locality of the decode steps in each."""
    tpot = (res.finish - res.first_token) / np.maximum(res.output_len - 1, 1)
    idx = np.arange(len(tpot))
    b0 = int(np.argmax(phase == 1))
    nb = int((phase == 1).sum())
    sel = {"A": (phase == 0) & (idx >= skip), "B early": (idx >= b0) & (idx < b0 + nb // 3), "B late": idx >= b0 + nb // 3,
           "all": idx >= skip}
    t_b = float(np.nanmin(res.first_token[phase == 1]))
    t_bl = float(np.nanmin(res.first_token[b0 + nb // 3:]))
    out = {}
    for name, m in sel.items():
        x = tpot[m] * 1e3
        out[name] = {"tpot_mean": float(np.mean(x)), "tpot_p50": float(np.percentile(x, 50)), "tpot_p99": float(np.percentile(x, 99))}
    st = res.step_start
    steps = {"A": st < t_b, "B early": (st >= t_b) & (st < t_bl), "B late": st >= t_bl, "all": st >= 0}
    for name, m in steps.items():
        null = float(res.step_null_distinct[m].astype(np.float64).sum())
        out[name]["locality"] = float(res.step_distinct[m].astype(np.float64).sum() / null) if null else float("nan")
        out[name]["experts"] = float(res.step_distinct[m].mean()) if m.any() else float("nan")
    reqs = np.bincount(res.worker[idx >= b0 + nb // 3], minlength=K).astype(float)
    out["B late"]["imbalance"] = float(reqs.max() / reqs.mean())
    return out


def tpot_curve(res, bins: int) -> dict:
    tpot = (res.finish - res.first_token) / np.maximum(res.output_len - 1, 1) * 1e3
    edges = np.linspace(0, len(tpot), bins + 1).astype(int)
    return {"t": [float(np.median(res.arrival[a:b])) for a, b in zip(edges[:-1], edges[1:])],
            "tpot": [float(np.mean(tpot[a:b])) for a, b in zip(edges[:-1], edges[1:])]}


def activation_times(res, events) -> list[float]:
    """Simulated time at which each refit took effect: the prefill completion of the request
    routed `activated_at`-th."""
    order = np.sort(res.prefill_done[np.isfinite(res.prefill_done)])
    return [float(order[min(e["activated_at"], len(order) - 1)]) for e in events if e.get("activated_at") is not None]


def git_state() -> dict:
    """HEAD and whether the files this study depends on differ from it (other engineers edit
    the generator and the k-means in the same tree; their uncommitted edits change the numbers)."""
    return code_state(("eldr_sglang/traces/synth.py", "eldr_sglang/offline", "eldr_sglang/sim", "eldr_sglang/drift"))


def run_part2(s: dict, loads, lfs, tmp, seed: int, interval: int, cooldown: int, em, cfg) -> list[dict]:
    """Part 2: the adaptive band (bounded loads at each factor in lfs) against the fixed tau and
    shortest_queue, with static centroids, on the stationary and the drifting stream."""
    rows = []
    for stream in ("stationary A", "drift A->B"):
        ev_idx = s["eval"][s["phase"] == 0] if stream == "stationary A" else s["eval"]
        ph = s["phase"][s["phase"] == 0] if stream == "stationary A" else s["phase"]
        for c in loads:
            wl2 = replay_workload(s["replay"], requests=ev_idx, arrival="closed", concurrency=c * K, seed=seed)
            row = {"stream": stream, "load": c, "policies": {}}
            for lab, lf in [("shortest_queue", None), (f"eldr@{TAU:g}", None)] + [(f"eldr@{TAU:g}+bl{f:g}", f) for f in lfs]:
                pol = make(lab, s, tmp, seed, interval, cooldown, lf=lf)
                res = simulate(s["replay"], wl2, pol, em, cfg)
                row["policies"][lab] = _band_metrics(res, warmup=c * K, phases=None if stream == "stationary A" else ph)
            rows.append(row)
            log(f"  band {stream} load {c}: " + ", ".join(f"{k} {v['tpot_mean']:.3f}" for k, v in row["policies"].items()))
    return rows


def _band_metrics(res, warmup: int, phases=None) -> dict:
    """TPOT mean/p50/p99 after the first `warmup` requests, locality, imbalance; with the
    stream's phases also the late-B TPOT."""
    tp = ((res.finish - res.first_token) / np.maximum(res.output_len - 1, 1) * 1e3)[warmup:]
    reqs = np.bincount(res.worker, minlength=K).astype(float)
    null = float(res.step_null_distinct.astype(np.float64).sum())
    m = {"tpot_mean": float(tp.mean()), "tpot_p50": float(np.percentile(tp, 50)), "tpot_p99": float(np.percentile(tp, 99)),
         "locality": float(res.step_distinct.astype(np.float64).sum() / null),
         "imbalance": float(reqs.max() / reqs.mean())}
    if phases is not None:
        m["B_late_tpot_mean"] = phase_stats(res, phases, skip=warmup)["B late"]["tpot_mean"]
    return m


LABELS = ["shortest_queue", "eldr", "eldr+drift-refit", "eldr+periodic-refit", "eldr+drift-refit+bl0.25", "eldr(ideal swap)"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, shorter phases, fewer loads (under ~3 min)")
    ap.add_argument("--json", action="store_true", help="print the JSON results instead of the table")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--load", type=int, default=32, help="clients per decode worker in part 1")
    return ap.parse_args(argv)


def plan(args) -> dict:
    """The study's sizes: --quick shrinks the seeds, phases and load sweep."""
    quick = args.quick
    return {"seeds": [0] if quick else [0, 1, 2], "n_phase": 2000 if quick else 4000, "calib": 1000,
            "interval": 1000, "cooldown": 1000, "loads": (8, 32) if quick else (8, 32, 64),
            "lfs": (0.05, 0.1, 0.25, 0.5), "n_real": 2000 if quick else 3000, "n_roll": 1000 if quick else 1600}


def run_synthetic(pl: dict, args, tmp: str) -> dict:
    """Parts 1 and 2 on the synthetic drifting stream, one run of part 1 per seed."""
    part1: dict = {lab: [] for lab in LABELS}
    events: dict = {}
    out = {"part1": part1, "events": events, "curves": {}, "part2": [], "fits": [], "em": None}
    for seed in pl["seeds"]:
        s = setup(seed, pl["n_phase"], pl["calib"], tmp)
        out["fits"].append({k: s["fit_a"][k] for k in ("domain_purity", "baseline") if k in s["fit_a"]})
        em = out["em"] = ExecutionModel(get_model(s["trace"].model), get_hardware("h100"))
        cfg = ClusterConfig(num_decode=K)
        stats, evs, crv = run_part1(LABELS, s, tmp, seed, pl["interval"], pl["cooldown"], em, cfg, args.load * K)
        for lab in LABELS:
            part1[lab].append(stats[lab])
            events.setdefault(lab, []).append(evs[lab])
        if seed == pl["seeds"][0]:
            out["curves"] = crv
            # part 2: adaptive band (bounded loads) vs fixed tau, static centroids
            out["part2"] = run_part2(s, pl["loads"], pl["lfs"], tmp, seed, pl["interval"], pl["cooldown"], em, cfg)
    return out


def run_real(pl: dict, args, tmp: str, em) -> dict | None:
    """Part 3: part 1 on the real gptoss20b trace split into two domain sets (None: no trace)."""
    real = SHARED / "gptoss20b.npz"
    if not real.exists():
        log(f"skipping the real trace: {real} not found")
        return None
    s = setup_real(real, pl["n_real"], tmp)
    stats, evs, crv = run_part1(LABELS, s, tmp, 0, pl["interval"], pl["cooldown"], em, ClusterConfig(num_decode=K),
                                args.load * K)
    return {"stats": stats, "events": evs, "curves": crv, "fit": {k: s["fit_a"][k] for k in ("baseline",) if k in s["fit_a"]},
            "domains_a": s["domains_a"], "domains_b": s["domains_b"], "n_cal": s["n_cal"], "n_a": s["n_a"], "n_b": s["n_b"],
            "requests_per_phase": pl["n_real"]}


def write_outputs(results: dict, out_dir: Path, stem: str) -> str:
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    md = render(results)
    (out_dir / f"{stem}.md").write_text(md)
    try:
        plot(results["curves"], results["meta"], out_dir / f"{stem}.png", "synthetic, seed %d" % results["meta"]["seeds"][0])
        if results["part3_real"] is not None:
            plot(results["part3_real"]["curves"], results["meta"], out_dir / f"{stem}_real.png", "real gptoss20b routing")
    except Exception as exc:  # matplotlib missing: tables are still written
        log(f"no plot: {exc}")
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    pl = plan(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "drift_study_quick" if args.quick else "drift_study"
    cmd = "python benchmarks/drift_study.py" + (" --quick" if args.quick else "") + (f" --load {args.load}" if args.load != 32 else "")
    t_start = time.perf_counter()
    code = git_state()  # before the run: later edits to the tree must not be credited to it
    tmp = tempfile.mkdtemp(prefix="eldr-drift-")
    try:
        syn = run_synthetic(pl, args, tmp)
        em = syn["em"]
        part3 = run_real(pl, args, tmp, em)
        part4 = run_rolling(pl["n_roll"], pl["calib"], tmp, pl["interval"], pl["cooldown"], args.load, em)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {
        "meta": {"command": cmd, "runtime_s": round(time.perf_counter() - t_start, 1), "cpus": os.cpu_count(),
                 "seeds": pl["seeds"], "git": code, "K": K, "tau": TAU, "requests_per_phase": pl["n_phase"],
                 "calibration": pl["calib"], "load": args.load, "refit_interval_requests": pl["interval"],
                 "cooldown_requests": pl["cooldown"], "activation_delay_requests": ACTIVATION_DELAY,
                 "model": em.describe() if em else None, "domains_a": DOMAINS_A, "domains_b": DOMAINS_B},
        "fits": syn["fits"],
        "part1": syn["part1"],
        "events": syn["events"],
        "curves": syn["curves"],
        "part2": syn["part2"],
        "part3_real": part3,
        "part4_rolling": part4,
    }
    md = write_outputs(results, out_dir, stem)
    print(json.dumps(results, default=float) if args.json else md)
    log(f"done in {results['meta']['runtime_s']:.0f} s; wrote {out_dir / (stem + '.md')}")
    return 0


def _agg(runs: list[dict], phase: str, key: str) -> tuple[float, float, float]:
    x = np.array([r[phase][key] for r in runs])
    return float(x.mean()), float(x.min()), float(x.max())


def part1_table(p1: dict, events: dict, n: int) -> list[str]:
    L = ["| policy | A TPOT | B early TPOT | B late TPOT | B late vs shortest_queue | B late vs static eldr | B late p99 | locality A / B late | refits |",
         "|---|---|---|---|---|---|---|---|---|"]
    sq = p1["shortest_queue"]
    st = p1["eldr"]

    def cell(runs, ph, key="tpot_mean"):
        a, lo, hi = _agg(runs, ph, key)
        return f"{a:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if n > 1 else "")

    for lab, runs in p1.items():
        d_sq = [pct(r["B late"]["tpot_mean"], q["B late"]["tpot_mean"]) for r, q in zip(runs, sq)]
        d_st = [pct(r["B late"]["tpot_mean"], q["B late"]["tpot_mean"]) for r, q in zip(runs, st)]
        nref = [len(e) for e in events.get(lab, [])]
        L.append(f"| {lab} | {cell(runs, 'A')} | {cell(runs, 'B early')} | {cell(runs, 'B late')} | "
                 f"{np.mean(d_sq):+.1f}% | {np.mean(d_st):+.1f}% | {cell(runs, 'B late', 'tpot_p99')} | "
                 f"{_agg(runs, 'A', 'locality')[0]:.3f} / {_agg(runs, 'B late', 'locality')[0]:.3f} | "
                 f"{'/'.join(map(str, nref)) if nref else '-'} |")
    return L


def describe_events(ev: list[dict]) -> str:
    return "; ".join(f"at routed request {e['triggered_at']} ({e.get('signatures')} signatures, mean old/new centroid cosine "
                     f"{(e.get('mean_similarity') or float('nan')):.2f}): {e['reason']}" for e in ev)


def render(res) -> str:
    m = res["meta"]
    n = len(m["seeds"])
    L = ["# Drift study: static vs adaptive ELDR under a domain-mix shift (simulated)", "",
         f"Command: `{m['command']}` (runtime {m['runtime_s']:.0f} s on {m['cpus']} CPUs; git {m['git']['head']}"
         + (f", with uncommitted edits to {', '.join(m['git']['dirty'])}" if m['git']['dirty'] else "") + ").", "",
         f"Synthetic GPT-OSS-20B-shaped trace, K={m['K']} decode workers (1xH100 each), closed loop with {m['load']} clients "
         f"per worker, tau={m['tau']}. Phase A = domains {m['domains_a']}, then phase B = domains {m['domains_b']}, "
         f"{m['requests_per_phase']} requests each; the centroids are fitted on {m['calibration']} separate phase-A requests. "
         f"Refits take effect {m['activation_delay_requests']} routed requests after they are triggered; cooldown "
         f"{m['cooldown_requests']} requests, periodic interval {m['refit_interval_requests']} requests. "
         f"{'Mean over seeds ' + str(m['seeds']) + ' [min, max] in brackets.' if n > 1 else 'One seed.'} "
         "TPOT in ms (mean over requests); `B early` = first third of phase B (includes the detection delay), "
         "`B late` = the rest; locality = distinct experts per decode step / the expectation for randomly mixed "
         "batches of the same size (lower = more expert sharing; 1.000 = none).", "",
         "## Part 1: TPOT by phase", ""]
    L += part1_table(res["part1"], res["events"], n)
    ev = res["events"].get("eldr+drift-refit", [[]])[0]
    if ev:
        L += ["", "Drift-triggered refits (seed %d): " % m["seeds"][0] + describe_events(ev)]
    fa = res["fits"][0]
    if "baseline" in fa:
        b = fa["baseline"]
        L += ["", f"Fit baseline (seed {m['seeds'][0]}): mean d* {b['mean_d_star']:.4f}, s.d. {b['std_d_star']:.4f}."]
    L += ["", "![TPOT over time](%s)" % (("drift_study_quick.png" if "quick" in m["command"] else "drift_study.png")), "",
          "## Part 2: fixed tau vs bounded loads (adaptive band), static centroids, seed %d" % m["seeds"][0], "",
          "Bounded loads (`load_factor` f): a worker stays a band candidate only while its in-flight count is below "
          "ceil((1+f)(total+1)/K), so the band widens exactly when queues become unequal.", "",
          "| stream | load/worker | policy | TPOT mean | p50 | p99 | vs fixed tau | vs shortest_queue | locality | imbalance (max/mean req) |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for row in res["part2"]:
        base = row["policies"][f"eldr@{m['tau']:g}"]["tpot_mean"]
        sqm = row["policies"]["shortest_queue"]["tpot_mean"]
        for lab, v in row["policies"].items():
            L.append(f"| {row['stream']} | {row['load']} | {lab} | {v['tpot_mean']:.3f} | {v['tpot_p50']:.3f} | {v['tpot_p99']:.3f} | "
                     f"{pct(v['tpot_mean'], base):+.1f}% | {pct(v['tpot_mean'], sqm):+.1f}% | {v['locality']:.3f} | {v['imbalance']:.2f} |")
    r3 = res.get("part3_real")
    if r3:
        L += ["", "## Part 3: the same comparison on real routing (gptoss20b trace, split by domain)", "",
              f"Phase A = {', '.join(r3['domains_a'])}; phase B = {', '.join(r3['domains_b'])} (the alphabetically first and "
              f"second half of the domain names). Fit on {r3['n_cal']} of phase A's requests; the stream replays the other "
              f"{r3['n_a']} phase-A requests, then the {r3['n_b']} phase-B requests, each repeated in trace order to "
              f"{r3['requests_per_phase']} requests (recorded output lengths). Caveat: the trace has only 703 requests, so "
              "a refit on phase-B traffic (adaptive, and the ideal swap fitted on all of B) has seen the very requests it "
              "then routes: an optimistic setting for both. One run (deterministic).", ""]
        L += part1_table({k: [v] for k, v in r3["stats"].items()}, {k: [v] for k, v in r3["events"].items()}, 1)
        ev = r3["events"].get("eldr+drift-refit", [])
        if ev:
            L += ["", "Drift-triggered refits: " + describe_events(ev)]
        L += ["", "![TPOT over time, real trace](%s)" % ("drift_study_quick_real.png" if "quick" in m["command"] else "drift_study_real.png")]
    r4 = res.get("part4_rolling")
    if r4:
        n4 = r4["requests_per_phase"]
        L += ["", "## Part 4: rolling drift (synthetic, seed 0)", "",
              f"Every {n4} requests one domain of the four in use is replaced by a new one: "
              + " -> ".join("{" + ",".join(map(str, d)) + "}" for d in r4["phases"])
              + ". Fitted on the first set. Mean TPOT (ms) per phase (ramp-up excluded); mean d* of each phase "
              "against the original fit: " + ", ".join(f"{x:.3f}" for x in r4["d_star"]) + ".", "",
              "| policy | " + " | ".join(f"phase {i}" for i in range(len(r4["phases"]))) + " | phases 1-4 vs shortest_queue | refits at request |",
              "|---|" + "---|" * len(r4["phases"]) + "---|---|"]
        sq4 = r4["stats"]["shortest_queue"]
        for lab, v in r4["stats"].items():
            rel = np.mean([pct(a, b) for a, b in zip(v[1:], sq4[1:])])
            L.append(f"| {lab} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {rel:+.1f}% | "
                     + (", ".join(map(str, r4["refits"][lab])) or "-") + " |")
    return "\n".join(L) + "\n"


def plot(c: dict, meta: dict, path: Path, what: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"shortest_queue": "tab:gray", "eldr": "tab:red", "eldr+drift-refit": "tab:blue", "eldr+periodic-refit": "tab:orange",
              "eldr+drift-refit+bl0.25": "tab:cyan", "eldr(ideal swap)": "tab:green"}
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7.5, 5.0), dpi=80, sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    sq = np.asarray(c["shortest_queue"]["tpot"])
    t_sq = c["shortest_queue"]["t"]
    for lab, v in c.items():
        if lab.startswith("_"):
            continue
        ax.plot(v["t"], v["tpot"], "-", lw=1.1, label=lab, color=colors.get(lab))
        if lab != "shortest_queue":
            bx.plot(t_sq, (np.asarray(v["tpot"]) / sq - 1) * 100, "-", lw=1.1, color=colors.get(lab))
        for t in v["refits"]:
            for a in (ax, bx):
                a.axvline(t, color=colors.get(lab), lw=0.7, ls=":")
    bx.axhline(0, color="tab:gray", lw=0.8)
    for a in (ax, bx):
        a.axvline(c["_shift"], color="k", lw=1.0, ls="--")
        a.tick_params(labelsize=7)
    ax.text(c["_shift"], ax.get_ylim()[1], " domain mix shifts", va="top", fontsize=7)
    ax.set_ylabel("TPOT (ms), mean per bin", fontsize=8)
    bx.set_ylabel("TPOT vs shortest_queue (%)", fontsize=8)
    bx.set_xlabel("simulated time (s); bins of 1/%d of the requests; dotted = a refit takes effect" % len(sq), fontsize=8)
    ax.set_title(f"TPOT over time ({what}, K={meta['K']}, {meta['load']} clients/worker)", fontsize=9)
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
