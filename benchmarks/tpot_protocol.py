"""The TPOT study under the strict protocol and the cost-model sensitivity band (run through
benchmarks/tpot_study.py; see its docstring and eldr_sglang/sim/protocol.py).

Sized for a 2-core machine shared with four other jobs (about 40 minutes in all): K = 8 decode
workers only; under the default cost model every protocol cell (closed loop at 8 and 32
clients per worker, one open-loop rate, both orders, both output modes where recorded), under
the other two variants the fixed-output closed-loop cells; 2 splits of the main workloads, 1 of
the side studies. What that cuts is listed in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from eldr_sglang.defaults import default_policy_label  # noqa: E402
from eldr_sglang.testing.provenance import code_state, describe  # noqa: E402
from eldr_sglang.sim.cost_model import SENSITIVITY_VARIANTS, paper_fixed_cost, sensitivity_model  # noqa: E402
from eldr_sglang.models import get_model  # noqa: E402
from eldr_sglang.sim.profiles import get_hardware  # noqa: E402
from eldr_sglang.sim.protocol import (  # noqa: E402
    BOUND_LABELS, FIXED_OUTPUT_LEN, OPEN_LOAD, OPEN_REFERENCE_CLIENTS, STRICT_MIN_REQUESTS, STRICT_POLICIES, WARMUP_FRAC,
    Cell, random_splits, run_protocol, strict_cells, summarize, versus_best,
)
from eldr_sglang.sim.report import LOAD_BALANCERS, write_json  # noqa: E402
from eldr_sglang.sim.runner import paper_check  # noqa: E402

SHARED = Path(os.environ.get("ELDR_SHARED_TRACES", ROOT.parent / "shared" / "traces"))
CANDIDATES = ("eldr", "eldr/0.05", "locality/0.05")
K = 8
SYN_REQUESTS = 1200


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def _synth(model: str, uniform: bool = False):
    from eldr_sglang.traces.synth import generate

    return generate(model=model, requests=SYN_REQUESTS, domains=8, uniform=uniform, seed=0, prompt_len=(64, 256),
                    output_len=FIXED_OUTPUT_LEN)


ALL_VARIANTS = tuple(SENSITIVITY_VARIANTS)
TWO_VARIANTS = ALL_VARIANTS[:2]


def _cells(full: list[Cell], variants) -> dict:
    """Every cell under the default model; the fixed-output closed-loop ones under the others."""
    band = [c for c in full if c.loop == "closed" and c.output == "fixed"]
    return {v: (full if v == "default" else band) for v in variants}


def plan(splits: int) -> list[dict]:
    """The study's workloads: name, trace maker, hardware, EP, context, cells, splits, variants."""
    one_closed = [Cell("shuffle", "closed", 32.0, "fixed"), Cell("trace", "closed", 32.0, "fixed")]
    real = SHARED / "gptoss20b.npz"
    w = []
    if real.exists():
        from eldr_sglang.traces import load_trace

        w.append(dict(name="gptoss20b-real", make=lambda: load_trace(real), hardware="h100", ep=1, context=None,
                      cells=_cells(strict_cells(recorded=True), ALL_VARIANTS), splits=splits, variants=ALL_VARIANTS, skewed=True,
                      note="real GPT-OSS-20B routing (generated tokens; the first quarter stands in for the prompt)"))
        w.append(dict(name="gptoss20b-real-ctx2k", make=lambda: load_trace(real), hardware="h100", ep=1, context=2048,
                      cells=one_closed, splits=1, variants=TWO_VARIANTS, skewed=True,
                      note="the real trace with every simulated context set to 2048 tokens (attention load; routing unchanged)"))
    else:
        log(f"skipping the real trace: {real} not found")
    w += [
        dict(name="deepseek-v3-synth", make=lambda: _synth("deepseek-v3"), hardware="h200", ep=1, context=None,
             cells=_cells(strict_cells(recorded=False), ALL_VARIANTS), splits=splits, variants=ALL_VARIANTS, skewed=True,
             note="synthetic domain-skewed DeepSeek-V3 routing (calibrated generator), 8xH200 TP"),
        dict(name="deepseek-v3-synth-ep8", make=lambda: _synth("deepseek-v3"), hardware="h200", ep=8, context=None,
             cells={"default": one_closed + [Cell("shuffle", "open", OPEN_LOAD, "fixed")], "paper-fixed": one_closed},
             splits=1, variants=TWO_VARIANTS, skewed=True,
             note="the same, experts on 8 EP ranks (slowest rank + NVLink all-to-all)"),
        dict(name="qwen3-30b-a3b-synth", make=lambda: _synth("qwen3-30b-a3b"), hardware="h200", ep=1, context=None,
             cells=_cells(strict_cells(recorded=False), ALL_VARIANTS), splits=splits, variants=ALL_VARIANTS, skewed=True,
             note="synthetic domain-skewed Qwen3-30B-A3B routing, 1xH200"),
        dict(name="deepseek-v3-uniform", make=lambda: _synth("deepseek-v3", uniform=True), hardware="h200", ep=1, context=None,
             cells=one_closed, splits=1, variants=ALL_VARIANTS[:1], skewed=False,
             note="uniform control: experts drawn uniformly, no locality to find"),
    ]
    return w


def strict_main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="TPOT study under the strict protocol and the cost-model sensitivity band")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--parts", default=str(ROOT / "benchmarks" / "results" / "protocol_parts"),
                    help="directory for each workload's raw runs (JSON), written as each finishes")
    ap.add_argument("--workloads", default="", help="comma list of workload names (default: all)")
    ap.add_argument("--splits", type=int, default=2, help="fit/eval splits of the main workloads (default 2)")
    ap.add_argument("--requests", type=int, default=STRICT_MIN_REQUESTS)
    ap.add_argument("--render", action="store_true", help="only merge the saved parts into the report")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="a sentence about how the saved parts were produced, printed in the report")
    args = ap.parse_args(argv)
    parts = Path(args.parts)
    parts.mkdir(parents=True, exist_ok=True)
    if not args.render:
        want = {x.strip() for x in args.workloads.split(",") if x.strip()}
        known = [w["name"] for w in plan(args.splits)]
        if want - set(known):
            raise SystemExit(f"unknown workloads {sorted(want - set(known))}; known: {', '.join(known)}")
        for w in plan(args.splits):
            if want and w["name"] not in want:
                continue
            run_workload(w, args, parts)
    res = merge(parts)
    if args.note:
        res["meta"]["note"] = args.note
    if not res["workloads"]:
        raise SystemExit(f"no saved runs in {parts}")
    out = Path(args.out)
    write_json(summary_json(res), out / "tpot_study_protocol.json")
    md = render(res)
    (out / "tpot_study_protocol.md").write_text(md)
    print(md)
    log(f"wrote {out / 'tpot_study_protocol.md'}")
    return 0


def run_workload(w: dict, args, parts: Path) -> None:
    t0 = time.perf_counter()
    code = describe(code_state())  # before the run: later edits to the tree must not be credited to it
    trace = w["make"]()
    model, hw = get_model(trace.model), get_hardware(w["hardware"])
    models = {}
    for v in w["variants"]:
        kw = {"ep": w["ep"]} if w["ep"] > 1 else {}
        if w["ep"] > 1:
            kw["tp"] = w["ep"]
        models[v] = sensitivity_model(v, model, hw, **kw)
    em0 = models[w["variants"][0]]
    log(f"== {w['name']}: {trace.num_requests} requests, {model.name} on {hw.name} tp={em0.tp} ep={em0.ep}; "
        f"{w['splits']} splits x {len(models)} variants")
    recs = run_protocol(trace, models, K, w["cells"], random_splits(trace.num_requests, w["splits"], args.seed),
                        requests=args.requests, seed=args.seed, context_len=w["context"], log=log)
    doc = {"name": w["name"], "note": w["note"], "skewed": w["skewed"], "context_len": w["context"],
           "models": {v: m.describe() for v, m in models.items()}, "paper_check": paper_check(em0),
           "trace_requests": trace.num_requests, "splits": w["splits"],
           "cells": [c.label() for c in (w["cells"]["default"] if isinstance(w["cells"], dict) else w["cells"])],
           "runtime_s": round(time.perf_counter() - t0, 1), "code": code, "records": recs}
    write_json(doc, parts / f"{w['name']}.json")
    log(f"   {w['name']} done in {doc['runtime_s']:.0f} s")


def merge(parts: Path) -> dict:
    order = [w["name"] for w in plan(2)]
    docs = {}
    for f in sorted(parts.glob("*.json")):
        d = json.loads(f.read_text())
        docs[d["name"]] = d
    names = [n for n in order if n in docs] + [n for n in docs if n not in order]
    meta = {"command": "python benchmarks/tpot_study.py  (strict protocol; parts merged with --render)",
            "K": K, "requests_min": STRICT_MIN_REQUESTS, "warmup_frac": WARMUP_FRAC, "fixed_output_len": FIXED_OUTPUT_LEN,
            "open_load": OPEN_LOAD, "open_reference_clients": OPEN_REFERENCE_CLIENTS, "policies": STRICT_POLICIES,
            "bounds": list(BOUND_LABELS), "paper_fixed_cost_us": round(paper_fixed_cost() * 1e6, 3),
            "runtime_s": round(sum(docs[n]["runtime_s"] for n in names), 1)}
    return {"meta": meta, "workloads": {n: docs[n] for n in names}}


def summary_json(res: dict) -> dict:
    """The report's numbers without the raw runs (those stay in the parts directory)."""
    chosen, score = choose_default(res)
    return {"meta": res["meta"],
            "default": {"supported": chosen, "score": [dict(zip(("candidate", "runs_losing", "runs", "median_p50", "median_p99"), r))
                                                       for r in score]},
            "workloads": {n: {k: w[k] for k in ("note", "skewed", "context_len", "models", "paper_check", "splits", "cells",
                                                 "runtime_s", "code")}
                          | {"summary": summarize(w["records"], list(CANDIDATES) + list(BOUND_LABELS))}
                          for n, w in res["workloads"].items()}}


def _pct(x) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x:+.1f}%"


def _sp(s: dict) -> str:
    return f"{_pct(s['median'])} ({_pct(s['min'])}..{_pct(s['max'])})"


def choose_default(res: dict) -> tuple[str, list[tuple]]:
    """The rule, fixed before the numbers: over every run of every skewed workload and every
    cost-model variant, the candidate with the fewest runs worse than the best load balancer on
    p50 or p99 TPOT; ties by the median p50 change. Returns (label, score table)."""
    rows = []
    for lab in CANDIDATES:
        d = [versus_best(r["policies"], lab) for w in res["workloads"].values() if w["skewed"] for r in w["records"]]
        loses = sum(x["tpot_p50"] > 0 or x["tpot_p99"] > 0 for x in d)
        rows.append((lab, loses, len(d), float(np.median([x["tpot_p50"] for x in d])), float(np.median([x["tpot_p99"] for x in d]))))
    best = min(rows, key=lambda r: (r[1], r[3]))
    return best[0], rows


def headline(res: dict) -> list[str]:
    """The README's table: per workload, each candidate's median p50 / p99 change against the
    best load balancer under the default model, and the range of those medians over the band."""
    L = ["| workload (K = 8) | runs | eldr (paper's rule) p50 / p99 | eldr/0.05 p50 / p99 | locality/0.05 p50 / p99 | perfect-overlap bound p50 |",
         "|---|---|---|---|---|---|"]
    for name, w in res["workloads"].items():
        summ = summarize(w["records"], list(CANDIDATES) + ["perfect_overlap"])
        variants = {r["variant"] for r in w["records"]}
        common = set.intersection(*({r["cell"] for r in w["records"] if r["variant"] == v} for v in variants))
        summ_c = summarize([r for r in w["records"] if r["cell"] in common], list(CANDIDATES))

        def cell(lab):
            d = summ[lab].get("default") or next(iter(summ[lab].values()))
            byv = summ_c[lab]
            p50s = [v["tpot_p50"]["median"] for v in byv.values()]
            p99s = [v["tpot_p99"]["median"] for v in byv.values()]
            band = f" (band {_pct(min(p50s))}..{_pct(max(p50s))} / {_pct(min(p99s))}..{_pct(max(p99s))})" if len(byv) > 1 else ""
            return f"{_pct(d['tpot_p50']['median'])} / {_pct(d['tpot_p99']['median'])}" + band

        L.append(f"| {name} | {len(w['records'])} | {cell('eldr')} | {cell('eldr/0.05')} | {cell('locality/0.05')} | "
                 f"{_pct(summ['perfect_overlap'].get('default', next(iter(summ['perfect_overlap'].values())))['tpot_p50']['median'])} |")
    return L


def render(res: dict) -> str:
    L = _preamble(res["meta"])
    chosen, default = _default_section(res)
    L += default + _headline_section(res) + _summary_section(res)
    for name, w in res["workloads"].items():
        L += _workload_section(name, w)
    L += _losses_section(res, chosen)
    return "\n".join(L) + "\n"


def _preamble(m: dict) -> list[str]:
    """What was simulated, under which cost models and protocol, and what was cut."""
    return ["# TPOT study under the strict protocol (simulated)", "",
         "**Everything here is simulated**: a discrete-event PD cluster whose decode steps are timed by a roofline "
         "model (docs/simulator.md). No GPU measured any of it. The cost model's structure is uncertain, so every "
         "number is shown under three execution models (the *sensitivity band*):", "",
         "- `default`: the roofline with public-spec constants (predicts 7.6x for 16 -> 128 experts at DeepSeek-V3 shape);",
         f"- `paper-fixed`: plus a per-MoE-layer fixed cost of {m['paper_fixed_cost_us']:.1f} us, solved in closed form so that "
         "DeepSeek-V3 on 8xH200 reproduces the ELDR paper's measured 4.7x (taken from the paper's measurement, not fitted to any policy);",
         "- `paper-fixed+overhead`: that plus a 2 ms step overhead instead of 0.5 ms (a slower serving stack).", "",
         f"Protocol (eldr_sglang/sim/protocol.py): K = {m['K']} decode workers; at least {m['requests_min']} held-out requests per run "
         f"(wrapping around), the first {m['warmup_frac']:.0%} of arrivals dropped from latency statistics; fit/eval splits are seeded "
         "random halves (centroids never see the evaluated requests); arrivals shuffled and in trace order; closed loop at 8 and "
         f"32 clients per worker and open loop (Poisson at {m['open_load']}x shortest_queue's measured capacity at "
         f"{m['open_reference_clients']}/worker, the same rate for every policy); outputs fixed at {m['fixed_output_len']} tokens, and "
         "recorded lengths where the trace has them (the real trace only). Bounds: `perfect_overlap` (every layer of every step "
         "touches top_k experts) and `clairvoyant/0.05` (bounded ELDR fitted and routed on decode-row signatures).", "",
         "Policies: the four load balancers (random, round_robin, shortest_queue, power_of_two), `eldr` (the paper's band rule, "
         "tau 0.1), `eldr/0.05` (band rule with bounded loads, F = 0.05), `locality/0.05` (the locality-aware balancer: least "
         "D_w + (B_w+1)*Delta_w under the same cap). Changes are against the best load balancer *of the same run* "
         "(negative = faster; for throughput, positive = more tokens/s).", "",
         "**Cut to fit a 2-core machine shared with four other jobs (about 40 min of study time):** K = 4 and 16; more than two "
         "closed-loop loads; more than one open-loop rate; a third split for the main workloads (side studies have one); under the "
         "paper-fixed and paper-fixed+overhead variants, the open-loop and recorded-length cells (they run the fixed-output "
         "closed-loop cells only); the paper-fixed+overhead variant on the EP and 2k-context side studies; on the EP side study "
         "the 8-clients-per-worker and trace-order open-loop cells (closed loop at 32/worker in both orders, open loop shuffled); "
         "recorded output "
         "lengths on the synthetic traces (they record one length). "
         f"Runtime of what ran: {m['runtime_s']:.0f} s.", ""] + ([f"Provenance: {m['note']}", ""] if m.get("note") else [])


def _default_section(res: dict) -> tuple[str, list[str]]:
    """The rule that picks the router's default, its scores and the pick."""
    chosen, score = choose_default(res)
    L = ["## The router's default", "",
          "Rule (fixed before reading the numbers): over every run of every skewed workload, in every cost-model variant, the "
          "candidate that loses to the best load balancer (on p50 or p99 TPOT) in the fewest runs; ties by median p50.", "",
          "| candidate | runs losing on p50 or p99 | median p50 vs best LB | median p99 vs best LB |", "|---|---|---|---|"]
    for lab, loses, n, p50, p99 in score:
        L.append(f"| {lab} | {loses} of {n} | {_pct(p50)} | {_pct(p99)} |")
    L += ["", f"Supported default: **{chosen}**. The router's default is `eldr_sglang.defaults` "
          f"(`{default_policy_label()}` at the commit that wrote this file).", ""]
    return chosen, L


def _headline_section(res: dict) -> list[str]:
    L = ["## Headline (the README's table)", "",
          "Median over runs (splits x cells) of the change against the best load balancer of each run, under the default "
          "cost model; in brackets, the range of that median over the cost-model variants, taken over the cells every variant ran "
          "(p50 range / p99 range).", ""]
    L += headline(res) + [""]
    return L


def _summary_section(res: dict) -> list[str]:
    L = ["## Summary", "",
          "Per workload, policy and cost-model variant: change against the best load balancer, median over runs (splits x cells) "
          "and range; runs losing on p50 / p99.", "",
          "| workload | policy | variant | TPOT p50 | TPOT p99 | mean ITL | throughput | loses p50 / p99 |", "|---|---|---|---|---|---|---|---|"]
    for name, w in res["workloads"].items():
        summ = summarize(w["records"], list(CANDIDATES) + list(BOUND_LABELS))
        for lab, byv in summ.items():
            for v, s in byv.items():
                L.append(f"| {name} | {lab} | {v} | {_sp(s['tpot_p50'])} | {_sp(s['tpot_p99'])} | {_sp(s['itl_mean'])} | "
                         f"{_sp(s['throughput'])} | {s['loses_p50']} / {s['loses_p99']} of {s['runs']} |")
    L.append("")
    return L


def _workload_section(name: str, w: dict) -> list[str]:
    """One workload's table: every cost-model variant and cell."""
    em = w["models"][next(iter(w["models"]))]
    L = [f"## {name}", "", f"{w['note']}; {em['model']} on {em['tp']}x{em['hardware']} (ep {em['ep']}) per decode worker"
          + (f", context {w['context_len']} tokens" if w.get("context_len") else "") + f"; {w['trace_requests']} trace requests, "
          f"{w['splits']} split(s); {w['paper_check']}. Runtime {w['runtime_s']:.0f} s.", "",
          "Median over splits (range when more than one) of the change against the best load balancer; absolute TPOT p50 "
          "of the best load balancer for scale; locality = distinct experts per step over random mixing (1 = none).", "",
          "| variant | cell | best LB p50 ms | eldr p50 / p99 | eldr/0.05 p50 / p99 / ITL / thr | locality/0.05 p50 / p99 / ITL / thr | perfect_overlap p50 | clairvoyant p50 | locality SQ / eldr/0.05 / locality/0.05 |",
          "|---|---|---|---|---|---|---|---|---|"]
    for v in w["models"]:
        for c in w["cells"]:
            rs = [r for r in w["records"] if r["variant"] == v and r["cell"] == c]
            if not rs:
                continue

            def med(lab, key):
                vals = [versus_best(r["policies"], lab)[key] for r in rs if lab in r["policies"]]
                if not vals:
                    return "-"
                s = f"{_pct(float(np.median(vals)))}"
                return s + (f" [{_pct(min(vals))}..{_pct(max(vals))}]" if len(vals) > 1 and key == "tpot_p50" else "")

            best = float(np.median([min(r["policies"][b]["tpot_ms"]["p50"] for b in LOAD_BALANCERS) for r in rs]))
            loc = [float(np.mean([r["policies"][p]["expert_locality"] for r in rs])) for p in ("shortest_queue", "eldr/0.05", "locality/0.05")]
            L.append(f"| {v} | {c} | {best:.2f} | {med('eldr', 'tpot_p50')} / {med('eldr', 'tpot_p99')} | "
                     f"{med('eldr/0.05', 'tpot_p50')} / {med('eldr/0.05', 'tpot_p99')} / {med('eldr/0.05', 'itl_mean')} / {med('eldr/0.05', 'throughput')} | "
                     f"{med('locality/0.05', 'tpot_p50')} / {med('locality/0.05', 'tpot_p99')} / {med('locality/0.05', 'itl_mean')} / {med('locality/0.05', 'throughput')} | "
                     f"{med('perfect_overlap', 'tpot_p50')} | {med('clairvoyant/0.05', 'tpot_p50')} | {loc[0]:.3f} / {loc[1]:.3f} / {loc[2]:.3f} |")
    L.append("")
    return L


def _losses_section(res: dict, chosen: str) -> list[str]:
    L = [f"## Every run where the supported default ({chosen}) loses to a load balancer", "",
          "| workload | variant | split | cell | p50 vs best LB | p99 vs best LB | mean ITL | throughput |", "|---|---|---|---|---|---|---|---|"]
    n_lose = 0
    for name, w in res["workloads"].items():
        for r in w["records"]:
            d = versus_best(r["policies"], chosen)
            if d["tpot_p50"] > 0 or d["tpot_p99"] > 0:
                n_lose += 1
                L.append(f"| {name} | {r['variant']} | {r['split']} | {r['cell']} | {_pct(d['tpot_p50'])} | {_pct(d['tpot_p99'])} | "
                         f"{_pct(d['itl_mean'])} | {_pct(d['throughput'])} |")
    total = sum(len(w["records"]) for w in res["workloads"].values())
    L += ["", f"{n_lose} of {total} runs (uniform control included)."]
    return L


if __name__ == "__main__":
    sys.exit(strict_main())
