"""Does the simulator predict the real engine? The step model fitted on real SGLang's own decode
steps, the distinct experts replayed against those counted in the servers, and the simulator's
TPOT change beside each switchback arm measured by the router (issue 34).

    python benchmarks/sim_vs_engine.py --run WORK --json benchmarks/results/sim_vs_engine.json \
        --md benchmarks/results/sim_vs_engine.md --calibration-out benchmarks/results/engine_step_fit_cpu.json

WORK is what benchmarks/real_cpu_switchback.py --keep WORK kept: per setting the router's
per-block figures, the decode servers' step logs (batch and distinct experts per MoE layer of
every decode step, counted inside the engine), the calibration trace, the centroids and the
model directory.

1. **Step time, fitted on the balancers' steps.** A decode step's time is the interval from
   its start to the same server's next step (MoE, the rest of the forward, the scheduler, any
   stall). Steps are tagged with the arm of the block they ran in (the first `--settle` seconds
   of a block, when the previous arm's requests still decode, are left out; so are intervals
   across which the batch shrank, when the server may have sat idle). The model
   (eldr_sglang/sim/host.py: the two decode servers share the host CPU)

       step = (fixed + per_request * batch + per_expert * sum_l distinct_l)
              / (1 - steal * the other server's steps per second)       [+ scatter + stalls]

   is fitted by least squares on round robin's steps of every other round-robin block that do
   not stall (a stall: over twice the model), with the stall hazard and excess per bin of the
   other server's step rate; it is tested on the held-out round-robin blocks and on every
   other arm's steps: the median absolute relative error per setting and arm. Only the
   balancer's steps enter the fit, so it cannot lean toward a locality policy. The fit is
   written as a CPU calibration file with its `host` section (`--calibration-out`) that the
   simulator reads (`--calibration` of `eldr simulate`).
2. **Distinct experts, replayed.** The simulator replays the engine's own recorded decode
   routing (the calibration trace's kept decode rows) on the same cluster (1 prefill, 2
   decode workers), closed-loop clients, output length and policies; per arm, its mean
   distinct experts per layer-step at equal batch against the servers' count (each batch size
   weighted by the engine's steps at it).
3. **TPOT change per arm against round robin**: the router's own switchback figures (ratio of
   the blocks' geometric mean TPOT p50, Welch interval over blocks) beside the simulator's
   steady-state change of TPOT p50 for the same arm on the same cluster with the fitted terms,
   with the shared host and, beside it, with the same line alone.
4. **What the engine's steps do** (benchmarks/engine_dynamics.py on the same run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_dynamics as ed  # noqa: E402
from eldr_sglang.experiment import blocks_from_records, compare, load_records  # noqa: E402
from eldr_sglang.sim.host import SharedHost, fit_shared_host, predict  # noqa: E402

FORMAT = "eldr-moe-calibration/1"
SIM_LABEL = {"eldr/none": "eldr"}  # the router's experiment arm -> the simulator's label


def sim_label(arm: str, setting: dict) -> str:
    """The simulator's label of a router arm, with the locality cost's request term the
    router used (`request_cost` of the run; runs before it was recorded used none)."""
    label = SIM_LABEL.get(arm, arm)
    if label.split("/")[0] == "locality" and ":rc=" not in label:
        label += f":rc={float(setting.get('request_cost', 0.0)):g}"
    return label
HIST_MAX = 8  # batch sizes 1..8 in the batch histograms (larger ones are counted at 8)


def _share(counts) -> list[float]:
    """Share of decode steps at batch 1..HIST_MAX."""
    c = np.asarray(counts, float)[1:]
    return [round(float(x), 3) for x in c / max(c.sum(), 1)]


# ------------------------------------------------------------------ steps, tagged by arm
def block_records(setting: dict) -> list[dict]:
    kind, records = load_records(setting["experiment"])
    if kind != "blocks":
        raise ValueError(f"{setting['experiment']}: expected the router's block records, got {kind}")
    return records


def tagged_steps(setting: dict, settle_s: float, window_s: float = 1.0) -> list[dict]:
    """Every decode step with a complete interval, tagged with its block's arm:
    {arm, block, server, batch, sum_distinct, mean_distinct, other_rate, interval_s}. Intervals
    across which the batch shrank are left out (the server may have sat idle:
    engine_dynamics.server_steps); `other_rate` is the steps per second the other decode
    servers started in the `window_s` before this one (the shared host's regressor)."""
    records = block_records(setting)
    spans = sorted((float(b["start_unix_s"]) + settle_s, float(b["end_unix_s"] or 0) or float("inf"), b["block"], b["arm"])
                   for b in records)
    starts = np.array([s[0] for s in spans])
    servers = ed.server_steps(setting)
    out = []
    for si, sv in enumerate(servers):
        rate = sum((np.searchsorted(o["t"], sv["t0"]) - np.searchsorted(o["t"], sv["t0"] - window_s)) / window_s
                   for oi, o in enumerate(servers) if oi != si)
        mean_d = sv["sum_distinct"] / setting["layers"]
        for j, t in enumerate(sv["t0"]):
            i = int(np.searchsorted(starts, t, side="right")) - 1
            if i < 0 or not (t < spans[i][1] and t + sv["interval"][j] <= spans[i][1]):
                continue
            out.append({"arm": spans[i][3], "block": spans[i][2], "server": si, "batch": int(sv["batch"][j]),
                        "sum_distinct": float(sv["sum_distinct"][j]), "mean_distinct": float(mean_d[j]),
                        "other_rate": float(np.asarray(rate)[j]) if np.ndim(rate) else 0.0,
                        "interval_s": float(sv["interval"][j])})
    return out


# ------------------------------------------------------------------ 1. the fit
def fit_step(steps: list[dict]) -> tuple[dict, SharedHost, dict]:
    """The line and the shared host (eldr_sglang/sim/host.py) fitted on these steps."""
    return fit_shared_host([s["batch"] for s in steps], [s["sum_distinct"] for s in steps],
                           [s["other_rate"] for s in steps], [s["interval_s"] for s in steps])


def step_errors(fit: dict, host: SharedHost | None, steps: list[dict]) -> dict:
    """Median absolute relative error of the model's step (line and shared host, without the
    random scatter and stalls), and the mean measured against the mean modelled with its
    stalls and scatter at their expected values."""
    if not steps:
        return {"steps": 0}
    y = np.array([s["interval_s"] for s in steps])
    r = np.array([s["other_rate"] for s in steps])
    p = predict(fit, host, [s["batch"] for s in steps], [s["sum_distinct"] for s in steps], r)
    rel = np.abs(p - y) / y
    out = {"steps": int(y.size), "median_abs_error": float(np.median(rel)), "mean_measured_ms": float(y.mean() * 1e3),
           "mean_predicted_ms": float(p.mean() * 1e3)}
    if host is not None:  # E[step] = p * E[scatter] + P(stall) * E[excess], per rate bin
        k = np.searchsorted(host.rate_edges, r, side="right") - 1
        scatter = float(np.mean(host.scatter))
        haz = np.asarray(host.hazard_per_s)[k]
        exc = np.array([np.mean(q) for q in host.excess_s])[k]
        mean = p * scatter + -np.expm1(-haz * p * scatter) * exc
        out["mean_expected_ms"] = float(mean.mean() * 1e3)
    return out


def split_train(steps: list[dict], balancer: str = "round_robin") -> tuple[list, list]:
    """Round robin's steps of every other round-robin block train; the rest are held out."""
    rr_blocks = sorted({s["block"] for s in steps if s["arm"] == balancer})
    train_blocks = set(rr_blocks[0::2])
    return [s for s in steps if s["block"] in train_blocks], [s for s in steps if s["block"] not in train_blocks]


def write_calibration(path: Path, fit: dict, model_dir: str, source: str, host: SharedHost | None = None) -> None:
    """The fit as a CPU calibration the simulator reads: per batch B, a_s = 0, b_s = per
    expert, other_s = fixed + per_request * B (exactly the fitted line at every B written);
    with `host`, its shared-host section (`eldr simulate --calibration` applies it)."""
    from eldr_sglang import io_safe
    from eldr_sglang.models import get_model

    m = get_model(model_dir)
    shape = {"hidden": m.hidden_size, "intermediate_per_rank": m.moe_intermediate_size, "experts": m.num_experts,
             "top_k": m.top_k, "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
             "head_dim": m.head_dim, "vocab": m.vocab_size}
    entries = [{"model": m.name, "hardware": "cpu", "batch": b, "a_s": 0.0, "b_s": fit["per_expert_s"],
                "other_s": fit["fixed_s"] + fit["per_request_s"] * b, **shape} for b in range(1, 257)]
    doc = {"format": FORMAT, "kind": "engine_step_fit", "fit": fit, "source": source,
           "note": "fitted on real SGLang 0.5.23's decode steps under round robin (benchmarks/sim_vs_engine.py); "
                   "step = fixed + per_request * batch + per_expert * sum over MoE layers of distinct experts",
           "entries": entries}
    if host is not None:
        doc["host"] = host.to_dict()
    io_safe.write_text(path, json.dumps(doc, indent=1), what="--calibration-out")


# ------------------------------------------------------------------ 2 and 3. the simulator
def distinct_by_batch(batch, distinct) -> dict[int, tuple[float, int]]:
    out: dict[int, list] = {}
    for b, d in zip(batch, distinct):
        out.setdefault(int(b), []).append(float(d))
    return {b: (float(np.mean(v)), len(v)) for b, v in out.items()}


def matched_distinct(sim: dict, eng: dict) -> tuple[float, float]:
    """(simulated, engine) mean distinct per layer-step over the batch sizes both have, each
    weighted by the engine's steps at it."""
    common = [b for b in eng if b in sim]
    w = np.array([eng[b][1] for b in common], float)
    return (float(np.dot(w, [sim[b][0] for b in common]) / w.sum()),
            float(np.dot(w, [eng[b][0] for b in common]) / w.sum()))


def simulate_setting(setting: dict, calibration: Path, requests: int, repeats: int, host: SharedHost | None = None) -> dict:
    """Per arm: the simulated TPOT p50, its change against round robin, and distinct by batch
    (with `host`, the decode workers share the host CPU as the engine's did)."""
    import real_cpu_sim as rcs
    from eldr_sglang.sim.cluster import ClusterConfig
    from eldr_sglang.sim.runner import parse_policies, run_comparison
    from eldr_sglang.workload import replay_workload

    arms = setting["arms"]
    specs = parse_policies(",".join(sim_label(a, setting) for a in arms))
    em, source, replay = rcs._setup(setting["trace"], setting["centroids"], calibration, setting["model_dir"], 2)
    conc = setting["concurrency"]
    tpot: dict[str, list] = {a: [] for a in arms}
    steps: dict[str, list] = {a: [[], []] for a in arms}
    batch_mean: dict[str, list] = {a: [] for a in arms}
    hist = {a: np.zeros(HIST_MAX + 1, np.int64) for a in arms}
    try:
        for rep in range(repeats):
            wl = replay_workload(replay, requests=requests, order="shuffle", output_len=setting["output_len"],
                                 arrival="closed", concurrency=conc, seed=rep)
            _, res = run_comparison(replay, wl, specs, em, ClusterConfig(num_decode=2, num_prefill=1, host=host, host_seed=rep),
                                    centroids=setting["centroids"], seed=rep, keep_results=True)
            for arm, spec in zip(arms, specs):
                r = res[spec.label]
                tpot[arm].append(rcs._tpot(r, conc))
                steps[arm][0].extend(r.step_batch.tolist())
                steps[arm][1].extend(r.step_distinct.tolist())
                batch_mean[arm].append(float(np.mean(r.step_batch)))
                hist[arm] += np.bincount(np.minimum(r.step_batch, HIST_MAX), minlength=HIST_MAX + 1)
    finally:
        if hasattr(source, "close"):
            source.close()
    p50 = {a: float(np.median(np.concatenate(v))) for a, v in tpot.items()}
    return {a: {"tpot_p50_ms": p50[a] * 1e3, "change_vs_round_robin": p50[a] / p50["round_robin"] - 1,
                "mean_batch": float(np.mean(batch_mean[a])), "batch_share": _share(hist[a]),
                "distinct_by_batch": distinct_by_batch(*steps[a])} for a in arms}


# ------------------------------------------------------------------ the whole comparison
def analyse(run: dict, settle_s: float, calibration_out: Path | None, requests: int, repeats: int, log) -> dict:
    settings = run["settings"]
    tagged = {s["name"]: tagged_steps(s, settle_s) for s in settings}
    train, held = [], {}
    for name, steps in tagged.items():
        tr, ho = split_train(steps)
        train += [s for s in tr if s["arm"] == "round_robin"]
        held[name] = ho
    fit, host, diag = fit_step(train)
    log(f"fit on {len(train)} round-robin steps ({fit['steps']} not stalling): fixed {fit['fixed_s'] * 1e3:.2f} ms, "
        f"per request {fit['per_request_s'] * 1e3:.3f} ms, per expert {fit['per_expert_s'] * 1e3:.3f} ms; "
        f"shared host: {host.steal_s * 1e3:.2f} ms per step of the other server, stalls "
        f"{diag['stall_share_of_time']:.0%} of the time")
    errors = {name: {arm: step_errors(fit, host, [s for s in held[name] if s["arm"] == arm]) for arm in st["arms"]}
              for name, st in ((s["name"], s) for s in settings)}
    cal = calibration_out
    if cal is None:
        import tempfile

        cal = Path(tempfile.mkdtemp()) / "engine_step_fit_cpu.json"
    write_calibration(cal, fit, settings[0]["model_dir"], source=str(run.get("source", "real_cpu_switchback.py")), host=host)
    out = {"fit": fit, "host": {"steal_s": host.steal_s, "rate_edges": list(host.rate_edges),
                                "hazard_per_s": list(host.hazard_per_s), **diag},
           "calibration": str(cal), "step_errors": errors, "settings": {},
           "engine_dynamics": {s["name"]: ed.analyse_setting(s, fit) for s in settings}}
    for s in settings:
        name = s["name"]
        blocks, short = blocks_from_records(block_records(s), min_requests=5)
        sim = simulate_setting(s, cal, requests, repeats, host)
        sim_line = simulate_setting(s, cal, requests, repeats, None)  # the same line, no shared host
        arms = {}
        for arm in s["arms"]:
            eng = distinct_by_batch([t["batch"] for t in tagged[name] if t["arm"] == arm],
                                    [t["mean_distinct"] for t in tagged[name] if t["arm"] == arm])
            sd, e_d = matched_distinct(sim[arm]["distinct_by_batch"], eng)
            row = {"distinct_sim": sd, "distinct_engine": e_d, "distinct_error": sd / e_d - 1,
                   "mean_batch_sim": sim[arm]["mean_batch"],
                   "mean_batch_engine": float(np.mean([t["batch"] for t in tagged[name] if t["arm"] == arm])),
                   "sim_tpot_p50_ms": sim[arm]["tpot_p50_ms"],
                   "batch_share_engine": _share(np.bincount(np.minimum([t["batch"] for t in tagged[name] if t["arm"] == arm],
                                                                       HIST_MAX), minlength=HIST_MAX + 1)),
                   "batch_share_sim": sim[arm]["batch_share"]}
            if arm != "round_robin":
                try:
                    c = compare(blocks, (arm, "round_robin"), "p50")
                except ValueError as exc:  # too few usable blocks: say so in the result
                    row["error"] = str(exc)
                    arms[arm] = row
                    continue
                row.update(value=c["diff"], ci_low=c["ci_low"], ci_high=c["ci_high"], blocks_per_arm=min(c["blocks"]),
                           engine_geo_mean_ms=[g * 1e3 for g in c["geo_mean_s"]], sim=sim[arm]["change_vs_round_robin"],
                           sim_line=sim_line[arm]["change_vs_round_robin"])
                row["sim_inside"] = bool(c["ci_low"] - 0.02 <= row["sim"] <= c["ci_high"] + 0.02)
            arms[arm] = row
        out["settings"][name] = {"locality": s["locality"], "blocks_left_out": short, "arms": arms,
                                 "clients": s["clients"]}
        log(f"{name}: " + "; ".join(f"{a} {r.get('value', 0):+.3f} sim {r.get('sim', 0):+.3f}" for a, r in arms.items()))
    loc, ctl = out["settings"].get("locality", {}).get("arms", {}), out["settings"].get("control", {}).get("arms", {})
    out["step_time_error_median"] = max(e["median_abs_error"] for arms in errors.values() for e in arms.values()
                                        if e.get("steps"))
    out["distinct_error_max"] = max(abs(r["distinct_error"]) for st in out["settings"].values() for r in st["arms"].values())
    sw = {}
    for key, arms, arm in (("eldr", loc, "eldr/none"), ("default", loc, "locality/0.05"), ("control", ctl, "locality/0.05")):
        if arm in arms and "value" in arms[arm]:
            r = arms[arm]
            sw[key] = {k: r[k] for k in ("value", "ci_low", "ci_high", "sim", "sim_line", "blocks_per_arm", "sim_inside")}
    out["switchback"] = sw
    return out


def table(res: dict) -> list[str]:
    f, h = res["fit"], res["host"]
    lines = [f"Step model fitted on round robin's decode steps ({f['steps']} not stalling): "
             f"(fixed {f['fixed_s'] * 1e3:.2f} ms + {f['per_request_s'] * 1e3:.3f} ms per request + "
             f"{f['per_expert_s'] * 1e3:.3f} ms per distinct expert summed over MoE layers) / "
             f"(1 - {h['steal_s'] * 1e3:.2f} ms x the other server's steps per second); stalls "
             f"{h['stall_share_of_time']:.0%} of round robin's time, hazard "
             + ", ".join(f"{z:.1f}/s from {e:.0f} steps/s" for e, z in zip(h["rate_edges"], h["hazard_per_s"])), "",
             "| setting | arm | held-out steps | median abs error | mean measured ms | mean modelled ms (no stalls) | "
             "mean expected ms (with stalls) |", "|---|---|---|---|---|---|---|"]
    for name, arms in res["step_errors"].items():
        for arm, e in arms.items():
            if e.get("steps"):
                lines.append(f"| {name} | {arm} | {e['steps']} | {e['median_abs_error']:.3f} | "
                             f"{e['mean_measured_ms']:.1f} | {e['mean_predicted_ms']:.1f} | {e.get('mean_expected_ms', 0):.1f} |")
    lines += ["", "| setting | arm | distinct/layer-step engine | simulated | error | batch engine | batch sim | "
                  "TPOT p50 change vs RR, engine (95% CI) | blocks/arm | simulated, shared host | sim inside CI +-2 pt | "
                  "simulated, line alone |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, st in res["settings"].items():
        for arm, r in st["arms"].items():
            ch = (f"{r['value']:+.1%} ({r['ci_low']:+.1%} .. {r['ci_high']:+.1%}) | {r['blocks_per_arm']} | "
                  f"{r['sim']:+.1%} | {'yes' if r['sim_inside'] else 'NO'} | {r['sim_line']:+.1%}" if "value" in r
                  else f"{r.get('error', 'baseline')} | | | |")
            lines.append(f"| {name} | {arm} | {r['distinct_engine']:.2f} | {r['distinct_sim']:.2f} | "
                         f"{r['distinct_error']:+.1%} | {r['mean_batch_engine']:.2f} | {r['mean_batch_sim']:.2f} | {ch} |")
    lines += ["", "Share of decode steps at batch 1, 2, ... 8 (8: 8 or more), engine against simulator (shared host):", "",
              "| setting | arm | engine | simulated |", "|---|---|---|---|"]
    for name, st in res["settings"].items():
        for arm, r in st["arms"].items():
            lines.append(f"| {name} | {arm} | {' '.join(f'{x:.2f}' for x in r['batch_share_engine'])} | "
                         f"{' '.join(f'{x:.2f}' for x in r['batch_share_sim'])} |")
    lines += ["", f"step_time_error_median (worst setting and arm): {res['step_time_error_median']:.3f}; "
                  f"distinct_error_max: {res['distinct_error_max']:.3f}", "", "## What the engine's steps do",
              "", *ed.table(res["engine_dynamics"])]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, metavar="WORK", help="the work directory real_cpu_switchback.py kept")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds left out at each block's start (default 3)")
    ap.add_argument("--requests", type=int, default=1500, help="simulated requests per repeat (default 1500)")
    ap.add_argument("--repeats", type=int, default=3, help="simulated repeats, one seed each (default 3)")
    ap.add_argument("--calibration-out", metavar="PATH", help="write the fitted step model as a calibration file")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--md", metavar="PATH")
    a = ap.parse_args(argv)
    for p in (a.json, a.md, a.calibration_out):
        if p and Path(p).exists():
            ap.error(f"{p} exists; move it away first (nothing is overwritten)")
    run_file = Path(a.run) / "run.json"
    if not run_file.exists():
        ap.error(f"{run_file} does not exist: run benchmarks/real_cpu_switchback.py --keep {a.run} first")
    run = json.loads(run_file.read_text())

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    try:
        res = analyse(run, a.settle, Path(a.calibration_out) if a.calibration_out else None, a.requests, a.repeats, log)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lines = table(res)
    print("\n".join(lines))
    from eldr_sglang import io_safe

    if a.json:
        io_safe.write_json(res, a.json, indent=1)
    if a.md:
        io_safe.write_text(a.md, "\n".join(lines) + "\n", what="--md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
