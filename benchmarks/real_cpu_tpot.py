"""TPOT measured on a real engine: real SGLang 0.5.23 on this CPU, a CONSTRUCTED MoE with domain
locality, every decode policy through the ELDR router, timed by SGLang's own benchmark client.

    python benchmarks/real_cpu_tpot.py --json benchmarks/results/real_cpu_tpot.json \
        --md benchmarks/results/real_cpu_tpot.md

The model (eldr_sglang/testing/sglang_cpu/locality_model.py) is built from a seed: D domains
over disjoint token ranges whose tokens route mostly to their domain's experts (the knob
`locality`, 0 = the uniform control), with bf16 experts heavy enough that SGLang's CPU MoE
path (`moe_forward_native`: one F.linear pair per expert that has tokens) dominates a decode
step. It shows the mechanism end to end (collect -> fit -> route -> decode -> TPOT), not
DeepSeek-V3's gain.

Per locality setting:
1. a non-PD reference server (pinned to core 0, --enable-return-routed-experts, the decode-side
   step log on) checks the model with the engine itself: the prefill-to-decode expert
   correlation per domain, the distinct experts per layer of domain-pure against mixed
   batches, and the MoE share of a decode step; then `eldr collect` records the calibration
   trace (prompt counts + decode routing) and the server stops;
2. `eldr fit` fits one centroid per decode worker on that trace;
3. one patched prefill (--enable-eldr-signature --enable-eldr-late-binding) and two decode
   servers, each decode pinned to its own core, with the step log on (test-only CPU shim:
   eldr_sglang/testing/sglang_cpu/step_log.py counts, inside the server, the distinct experts
   every decode step's batch touched);
4. for each repeat, for each concurrency, for each policy in turn (interleaved A B C ... A B C),
   a fresh router and `python -m sglang.benchmark.serving --pd-separated` on a domain-mixed
   prompt set (the same shuffled set for every policy of a repeat). The first `concurrency`
   requests of each run are dropped as warm-up.

Reported per policy and cell: TPOT p50/p99, ITL mean/p99, output tok/s, and the distinct
experts per MoE layer per decode step measured in the decode servers; a bootstrap confidence
interval (requests resampled within each repeat) for the default policy's TPOT p50 change
against the best balancer of the cell. Time is measured on 2 cores: the decodes own one core
each, the prefill, router and client share them.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from eldr_sglang import io_safe
from eldr_sglang.defaults import DEFAULT_LOAD_FACTOR, DEFAULT_POLICY
from eldr_sglang.testing.sglang_cpu import locality_model as lm
from eldr_sglang.testing.sglang_cpu.cluster import wait_ready
from eldr_sglang.testing.sglang_cpu.harness import Harness
from eldr_sglang.testing.sglang_cpu.step_log import read_steps

REPO = Path(__file__).resolve().parent.parent
BALANCERS = ["random", "round_robin", "shortest_queue", "power_of_two"]
LOCALITY_POLICIES = ["eldr", "eldr/0.05", "locality/0.05"]
DEFAULT_LABEL = f"{DEFAULT_POLICY}/{DEFAULT_LOAD_FACTOR:g}"


def router_args(policy: str, centroids: Path) -> list[str]:
    """Router flags of a policy label: eldr = the paper's rule (no load cap), name/F = capped."""
    name, _, factor = policy.partition("/")
    if name in BALANCERS:
        return ["--disagg-router", name]
    return ["--disagg-router", name, "--eldr-centroids", str(centroids), "--no-eldr-drift",
            "--eldr-load-factor", factor or "none"]


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def routed_rows(resp: dict, layers: int, top_k: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(resp["meta_info"]["routed_experts"]), "<i4").reshape(-1, layers, top_k)


def counts(rows: np.ndarray, experts: int) -> np.ndarray:
    out = np.zeros((rows.shape[1], experts))
    for layer in range(rows.shape[1]):
        np.add.at(out[layer], rows[:, layer].ravel(), 1)
    return out


# ------------------------------------------------------------------ the engine's own checks
def engine_checks(h: Harness, srv, geo: lm.Geometry, rng, output_len: int, prompt_len: int) -> dict:
    """Correlation, pure-vs-mixed distinct experts and the MoE share, from the reference server."""
    L, K, E, D = (geo.spec[k] for k in ("layers", "top_k", "experts", "domains"))
    owner = np.array(geo.owner)
    corr, own_prompt, own_decode = {d: [] for d in range(D)}, [], []
    jobs = [(d, lm.domain_prompt(geo, d, prompt_len, rng)) for d in range(D) for _ in range(6)]
    gen = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    for d, text in jobs:
        r = post_json(srv.url + "/generate", {"text": text, "sampling_params": gen, "return_routed_experts": True})
        rows, n = routed_rows(r, L, K), r["meta_info"]["prompt_tokens"]
        cp, cd = counts(rows[:n], E).ravel(), counts(rows[n:], E).ravel()
        corr[d].append(float(np.corrcoef(cp, cd)[0, 1]))
        own_prompt.append(np.mean([owner[layer][rows[:n, layer]] == d for layer in range(L)]))
        own_decode.append(np.mean([owner[layer][rows[n:, layer]] == d for layer in range(L)]))

    def batch(domains: list[int]) -> tuple[list, float]:
        """Send one batch at once; the steps whose batch held all of it, and their MoE share."""
        log = h.step_log(srv.name)
        start = log.stat().st_size if log.exists() else 0
        with cf.ThreadPoolExecutor(len(domains)) as ex:
            list(ex.map(lambda d: post_json(srv.url + "/generate", {"text": lm.domain_prompt(geo, d, prompt_len, rng),
                                                                     "sampling_params": gen}), domains))
        steps = _steps_since(log, start, L)
        full = [s for s in steps if s.tokens == len(domains)]
        share = [a.moe_s / (b.t0 - a.t0) for a, b in zip(steps, steps[1:])
                 if a.tokens == b.tokens == len(domains) and 0 < b.t0 - a.t0 < 1.0]
        return full, float(np.median(share)) if share else float("nan")

    b = 8
    pure, share_pure = batch([0] * b)
    mixed, share_mixed = batch([i % D for i in range(b)])
    return {
        "prefill_decode_correlation": {str(d): round(float(np.mean(v)), 3) for d, v in corr.items()},
        "own_expert_share": {"target": geo.own_share_target, "prompt": round(float(np.mean(own_prompt)), 3),
                             "decode": round(float(np.mean(own_decode)), 3)},
        "distinct_per_layer_batch8": {"domain_pure": round(_mean_distinct(pure), 2),
                                      "mixed": round(_mean_distinct(mixed), 2)},
        "moe_share_of_step": {"domain_pure": round(share_pure, 3), "mixed": round(share_mixed, 3)},
    }


def _steps_since(log: Path, start: int, layers: int):
    tmp = Path(tempfile.mkstemp(suffix=".steps")[1])
    try:
        with open(log, "rb") as fh:
            fh.seek(start)
            tmp.write_bytes(fh.read())
        return read_steps(tmp, layers)
    finally:
        tmp.unlink()


def _mean_distinct(steps) -> float:
    return float(np.mean([np.mean(s.distinct) for s in steps])) if steps else float("nan")


def _by_batch(steps) -> dict:
    """{batch size: [sum of per-step mean distinct experts per layer, steps]}."""
    out: dict = {}
    for st in steps:
        cell = out.setdefault(str(st.tokens), [0.0, 0])
        cell[0] += float(np.mean(st.distinct))
        cell[1] += 1
    return out


def matched_distinct_ratio(pol_runs: list, base_runs: list) -> float:
    """Distinct experts per layer per step of a policy over the baseline's, at equal batch size
    (batches of 2 or more, each size weighted by the fewer of the two step counts), so a policy is
    credited for its batches' composition, not for running smaller batches."""
    def pool(runs):
        out: dict = {}
        for r in runs:
            for b, (tot, n) in r["by_batch"].items():
                c = out.setdefault(b, [0.0, 0])
                c[0] += tot
                c[1] += n
        return out
    a, b = pool(pol_runs), pool(base_runs)
    common = [k for k in a if k in b and int(k) >= 2 and a[k][1] >= 3 and b[k][1] >= 3]
    if not common:
        return float("nan")
    w = {k: min(a[k][1], b[k][1]) for k in common}
    num = sum(w[k] * a[k][0] / a[k][1] for k in common)
    den = sum(w[k] * b[k][0] / b[k][1] for k in common)
    return num / den


# ------------------------------------------------------------------ one benchmark run
def bench_run(h: Harness, router_url: str, model: Path, data: Path, n: int, conc: int, out_len: int, seed: int,
              out: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", router_url,
           "--pd-separated", "--model", str(model), "--tokenizer", str(model), "--dataset-name", "custom",
           "--dataset-path", str(data), "--sharegpt-output-len", str(out_len), "--num-prompts", str(n),
           "--request-rate", "inf", "--max-concurrency", str(conc), "--seed", str(seed), "--disable-tqdm",
           "--warmup-requests", "1", "--output-file", str(out), "--output-details"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO, env=h.env)
    if p.returncode != 0 or not out.exists():
        raise SystemExit(f"sglang.benchmark.serving failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()][-1]


def request_tpots(res: dict, drop: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(TPOT per request, every ITL) after dropping the first `drop` requests; and failures."""
    tp, itl, failed = [], [], 0
    for i, (n, its, err) in enumerate(zip(res["output_lens"], res["itls"], res["errors"])):
        if err or n < 2:
            failed += bool(err)
            continue
        if i < drop:
            continue
        tp.append(sum(its) / (n - 1))
        itl += list(its)
    return np.array(tp), np.array(itl), failed


def domain_purity(texts: list[str], geo: lm.Geometry) -> float:
    """Share of generated texts whose tokens all lie in one domain (greedy decoding stays)."""
    ok = 0
    for t in texts:
        doms = {lm.domain_of_token(geo, int(x)) for x in re.findall(r"<t(\d+)>", t)}
        ok += len(doms) == 1 and -1 not in doms
    return ok / max(len(texts), 1)


# ------------------------------------------------------------------ statistics
def change_ci(a: list[np.ndarray], b: list[np.ndarray], rng, n_boot: int = 2000) -> tuple[float, float, float]:
    """p50(a)/p50(b) - 1 with a percentile bootstrap CI; requests resampled within each repeat."""
    point = np.median(np.concatenate(a)) / np.median(np.concatenate(b)) - 1
    boots = np.empty(n_boot)
    for i in range(n_boot):
        ra = np.concatenate([x[rng.integers(0, len(x), len(x))] for x in a])
        rb = np.concatenate([x[rng.integers(0, len(x), len(x))] for x in b])
        boots[i] = np.median(ra) / np.median(rb) - 1
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(point), float(lo), float(hi)


def summarize(cell: dict, rng) -> dict:
    """Per-policy statistics of one (locality, concurrency) cell and the default's change."""
    rows = {}
    for pol, runs in cell.items():
        tp = np.concatenate([r["tpot"] for r in runs])
        itl = np.concatenate([r["itl"] for r in runs])
        rows[pol] = {
            "tpot_p50_ms": float(np.median(tp) * 1e3), "tpot_p99_ms": float(np.percentile(tp, 99) * 1e3),
            "itl_mean_ms": float(itl.mean() * 1e3), "itl_p99_ms": float(np.percentile(itl, 99) * 1e3),
            "output_tok_s": float(np.mean([r["output_throughput"] for r in runs])),
            "distinct_per_layer_step": float(np.mean([r["distinct"] for r in runs])),
            "batch_per_step": float(np.mean([r["batch"] for r in runs])),
            "requests": int(len(tp)), "failed": int(sum(r["failed"] for r in runs)),
            "domain_pure_outputs": float(np.mean([r["purity"] for r in runs])),
        }
    if "round_robin" in cell and all("by_batch" in r for runs in cell.values() for r in runs):
        for pol in rows:
            rows[pol]["distinct_vs_round_robin_equal_batch"] = matched_distinct_ratio(cell[pol], cell["round_robin"]) - 1
    bal = [p for p in BALANCERS if p in rows]
    best = min(bal, key=lambda p: rows[p]["tpot_p50_ms"]) if bal else None
    out = {"policies": rows, "best_balancer": best}
    if best:
        for pol in rows:
            rows[pol]["p50_vs_best_balancer"] = rows[pol]["tpot_p50_ms"] / rows[best]["tpot_p50_ms"] - 1
            rows[pol]["p99_vs_best_balancer"] = rows[pol]["tpot_p99_ms"] / rows[best]["tpot_p99_ms"] - 1
        if DEFAULT_LABEL in cell:
            v, lo, hi = change_ci([r["tpot"] for r in cell[DEFAULT_LABEL]], [r["tpot"] for r in cell[best]], rng)
            out["default_vs_best_balancer_p50"] = {"value": v, "ci_low": lo, "ci_high": hi}
    return out


# ------------------------------------------------------------------ one locality setting
def run_setting(h: Harness, a, locality: float, policies: list[str], log) -> dict:
    t0 = time.monotonic()
    model = h.locality_model(locality, seed=a.seed)
    geo = lm.load_geometry(model)
    L, K, E, D = (geo.spec[k] for k in ("layers", "top_k", "experts", "domains"))
    rng = np.random.default_rng(a.seed)
    work = h.workdir / f"loc{locality:g}"
    work.mkdir(parents=True, exist_ok=True)
    log(f"== locality {locality:g}: model built ({time.monotonic() - t0:.0f} s)")

    ref = h.start(f"reference-{locality:g}", model, ["--enable-return-routed-experts", "--random-seed", "0"],
                  env=h.step_log_env(f"reference-{locality:g}"), cpus={0})
    try:
        wait_ready([ref], 900)
        startup = {"reference": round(ref.ready_s or 0)}
        checks = engine_checks(h, ref, geo, rng, a.output_len, a.input_len)
        log(f"   engine checks: {json.dumps(checks)}")
        calib = work / "calibration.jsonl"
        calib.write_text("".join(json.dumps({"prompt": lm.domain_prompt(geo, i % D, a.input_len, rng), "domain": str(i % D)})
                                 + "\n" for i in range(a.calibration_prompts)))
        trace = work / "trace.npz"
        _run([sys.executable, "-m", "eldr_sglang", "collect", str(calib), "--url", ref.url, "--out", str(trace),
              "--num-hidden-layers", str(L), "--top-k", str(K), "--num-experts", str(E), "--max-new-tokens",
              str(a.output_len), "--ignore-eos", "--keep-decode", str(a.calibration_prompts), "--no-progress"])
    finally:
        h.stop([ref])
    centroids = work / "centroids.eldr"
    _run([sys.executable, "-m", "eldr_sglang", "fit", str(trace), "--workers", "2", "--layers", "all",
          "--out", str(centroids), "--quiet"])
    log(f"   collected {a.calibration_prompts} prompts and fitted 2 centroids ({time.monotonic() - t0:.0f} s)")

    prefill, boot, decodes = h.start_pd(model, 2, prefill_extra=["--enable-eldr-signature", "--enable-eldr-late-binding"],
                                        decode_step_log=True, decode_cpus=[{0}, {1}], prefix=f"l{locality:g}-")
    cells: dict = {}
    try:
        wait_ready([prefill, *decodes], 900)
        startup.update({s.name: round(s.ready_s or 0) for s in (prefill, *decodes)})
        data = work / "prompts.jsonl"  # domain-mixed; the client shuffles it with the run's seed
        data.write_text("".join(json.dumps({"conversations": [
            {"content": lm.domain_prompt(geo, int(rng.integers(D)), a.input_len, rng)}, {"content": "<t600>" * 4}]})
            + "\n" for _ in range(a.num_prompts)))
        # a fresh cluster's first run pays one-off costs (lazy initialisation, first KV transfers):
        # one discarded run of the first policy warms it before anything is measured
        one_policy_run(h, a, policies[0], centroids, prefill, boot, decodes, model, data, max(a.concurrencies),
                       -1, geo, work)
        log(f"   cluster warm-up run done ({time.monotonic() - t0:.0f} s)")
        for rep in range(a.repeats):
            for conc in a.concurrencies:
                order = policies[rep % len(policies):] + policies[:rep % len(policies)]
                for pol in order:
                    run = one_policy_run(h, a, pol, centroids, prefill, boot, decodes, model, data, conc, rep, geo,
                                         work)
                    cells.setdefault(str(conc), {}).setdefault(pol, []).append(run)
                    log(f"   rep {rep} conc {conc:3d} {pol:<15} TPOT p50 {np.median(run['tpot']) * 1e3:7.1f} ms  "
                        f"distinct/layer/step {run['distinct']:5.2f}  batch {run['batch']:4.1f}  "
                        f"failed {run['failed']}  routes {_short_routes(run['routes'])}")
    finally:
        h.stop([prefill, *decodes])
    summary = {c: summarize(cell, np.random.default_rng(a.seed + 1)) for c, cell in cells.items()}
    raw = {c: {p: [{"tpot_ms": [round(x * 1e3, 3) for x in r["tpot"]], "distinct": r["distinct"], "batch": r["batch"],
                    "output_throughput": r["output_throughput"], "routes": r["routes"]} for r in runs]
                for p, runs in cell.items()}
           for c, cell in cells.items()}
    return {"locality": locality, "engine_layers": L, "geometry": {"beta": geo.beta, "own_share_target": geo.own_share_target},
            "engine_checks": checks, "startup_s": startup, "cells": summary, "raw": raw,
            "trace": str(trace), "centroids": str(centroids), "model_dir": str(model),
            "decode_step_logs": [str(h.step_log(d.name)) for d in decodes], "seconds": round(time.monotonic() - t0)}


def one_policy_run(h, a, pol, centroids, prefill, boot, decodes, model, data, conc, rep, geo, work) -> dict:
    router = h.start_router(f"router-{pol.replace('/', '_')}", [(prefill.url, boot)], [d.url for d in decodes],
                            [*router_args(pol, centroids), "--request-timeout-secs", "600",
                             "--eldr-signature-timeout-secs", "60", "--log-level", "warning"])
    try:
        wait_ready([router], 120)
        starts = [h.step_log(d.name).stat().st_size if h.step_log(d.name).exists() else 0 for d in decodes]
        out = work / f"run-{'warmup' if rep < 0 else rep}-{conc}-{pol.replace('/', '_')}.jsonl"
        out.unlink(missing_ok=True)
        res = bench_run(h, router.url, model, data, a.num_prompts, conc, a.output_len, a.seed + 1000 + rep, out)
        steps = [s for d, st in zip(decodes, starts) for s in _steps_since(h.step_log(d.name), st, geo.spec["layers"])]
        routes = router_routes(router.url)
    finally:
        h.stop([router])
    tp, itl, failed = request_tpots(res, drop=conc)
    return {"tpot": tp, "itl": itl, "failed": failed + (a.num_prompts - int(res.get("completed", 0))),
            "output_throughput": float(res["output_throughput"]),
            "distinct": _mean_distinct(steps), "batch": float(np.mean([s.tokens for s in steps])) if steps else 0.0,
            "by_batch": _by_batch(steps), "purity": domain_purity(res.get("generated_texts", []), geo), "routes": routes}


def _short_routes(routes: dict) -> str:
    return ", ".join(f"{k.split('{', 1)[1].rstrip('}') if '{' in k else k}={v:g}" for k, v in routes.items())


ROUTE_METRICS = ("eldr_router_decode_routes_total", "eldr_router_fallbacks_total")


def router_routes(url: str) -> dict:
    """The router's decode-route and fallback counters ({'name{labels}': count}): shows that a
    locality policy really routed by signature (reason band/locality) rather than fell back."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(ROUTE_METRICS) and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            if float(val):
                out[key] = float(val)
    return out


def _run(cmd) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout + p.stderr


# ------------------------------------------------------------------ report
def _checks_lines(s: dict) -> list[str]:
    lines = [f"\n## locality {s['locality']:g}: the engine's own checks (reference server)\n"]
    ck = s.get("engine_checks")
    if not ck:
        return lines + ["- not recorded"]
    own, dis, share = ck["own_expert_share"], ck["distinct_per_layer_batch8"], ck["moe_share_of_step"]
    return lines + [
        f"- own-expert share of top-k picks: target {own['target']:.3f}, prompt {own['prompt']:.3f}, decode {own['decode']:.3f}",
        "- prefill-to-decode expert correlation per domain: "
        + ", ".join(f"{d}: {v:.2f}" for d, v in ck["prefill_decode_correlation"].items()),
        f"- distinct experts per layer, batch of 8: domain-pure {dis['domain_pure']:.2f}, mixed {dis['mixed']:.2f}",
        f"- MoE share of a decode step (batch 8): domain-pure {share['domain_pure']:.2f}, mixed {share['mixed']:.2f}",
        f"- server start-up (s): {s.get('startup_s', 'not recorded')}",
    ]


def table(result: dict) -> list[str]:
    lines = []
    for s in result["settings"]:
        lines += _checks_lines(s)
        for server, terms in s.get("cost_model_terms", {}).items():
            lines.append(f"\ncost model term by term against {server}'s logged steps (medians):\n")
            lines.append("| batch | steps | MoE measured ms | MoE model ms | rest of step measured ms | other_s model ms |")
            lines.append("|---|---|---|---|---|---|")
            for b, t in terms.items():
                lines.append(f"| {b} | {t['steps']} | {t['moe_measured_ms']:.1f} | {t['moe_model_ms']:.1f} | "
                             f"{t['other_measured_ms']:.1f} | {t['other_model_ms']:.1f} |")
        for conc, cell in s["cells"].items():
            own = s.get("engine_checks", {}).get("own_expert_share", {}).get("prompt")
            lines.append(f"\nlocality {s['locality']:g}" + (f" (own-expert share {own:.2f})" if own is not None else "")
                         + f", concurrency {conc}; best balancer: {cell['best_balancer']}")
            lines.append("| policy | TPOT p50 ms | TPOT p99 ms | p50 vs best bal. | p99 vs best bal. | simulated p50 vs best bal. | "
                         "ITL mean ms | ITL p99 ms | out tok/s | distinct experts / layer / step (simulated) | "
                         "distinct vs round_robin at equal batch | batch | requests | failed |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for pol, r in cell["policies"].items():
                sim = f"{r['sim_p50_vs_best_balancer']:+.1%}" if "sim_p50_vs_best_balancer" in r else "-"
                sim_d = f" ({r['sim_distinct_per_layer_step']:.2f})" if "sim_distinct_per_layer_step" in r else ""
                lines.append(f"| {pol} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | {r['p50_vs_best_balancer']:+.1%} | "
                             f"{r['p99_vs_best_balancer']:+.1%} | {sim} | {r['itl_mean_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
                             f"{r['output_tok_s']:.1f} | {r['distinct_per_layer_step']:.2f}{sim_d} | "
                             f"{r.get('distinct_vs_round_robin_equal_batch', float('nan')):+.1%} | {r['batch_per_step']:.1f} | "
                             f"{r['requests']} | {r['failed']} |")
            d = cell.get("default_vs_best_balancer_p50")
            if d:
                lines.append(f"\n{DEFAULT_LABEL} vs {cell['best_balancer']}: TPOT p50 {d['value']:+.1%} "
                             f"(95% bootstrap CI {d['ci_low']:+.1%} .. {d['ci_high']:+.1%})")
    return lines


# ------------------------------------------------------------------ rebuilding from a kept run
RUN_GAP_S = 30.0  # decode servers idle this long between two runs (router restart + client start-up)


def rebuild_setting(work: Path, locality: float, a, policies: list[str]) -> dict:
    """A setting's results from a work directory kept with --keep (the run files, the decode
    step logs, the engine checks logged to stderr are not kept: pass them separately), for a run
    stopped before it wrote its JSON. The decode steps are split into runs at the idle gaps
    (> RUN_GAP_S) that the router restart and the client start-up leave between runs; the split
    must give at least one segment per run file, in the order the runs were made, or nothing is
    rebuilt (a run stopped mid-way leaves one segment more, which is dropped)."""
    from eldr_sglang.testing.sglang_cpu.step_log import read_steps

    model = work / "models" / f"locality-{locality:g}-{a.seed}-"
    geo = lm.load_geometry(model)
    L = geo.spec["layers"]
    sdir = work / f"loc{locality:g}"
    order = []
    for rep in range(a.repeats):
        for conc in a.concurrencies:
            rot = policies[rep % len(policies):] + policies[:rep % len(policies)]
            order += [(rep, conc, pol) for pol in rot]
    files = [sdir / f"run-{rep}-{conc}-{pol.replace('/', '_')}.jsonl" for rep, conc, pol in order]
    done = [f for f in files if f.exists()]
    if files[:len(done)] != done:
        raise SystemExit(f"{sdir}: the run files are not a prefix of the run order")
    order = order[:len(done)]
    drop = getattr(a, "drop_runs", 0)
    warm = 1 if list(sdir.glob("run-warmup-*.jsonl")) else 0  # the script's discarded warm-up run comes first
    segments = []
    for i in range(2):
        steps = read_steps(work / "logs" / f"l{locality:g}-decode{i}.steps", L)
        cuts = [j + 1 for j in range(len(steps) - 1) if steps[j + 1].t0 - steps[j].t0 > RUN_GAP_S]
        segs = [steps[b:e] for b, e in zip([0, *cuts], [*cuts, len(steps)])]
        if len(segs) < warm + len(order):
            raise SystemExit(f"decode{i}: {len(segs)} step segments for {warm + len(order)} runs; cannot attribute steps to runs")
        segments.append(segs[warm:warm + len(order)])  # a last, unfinished run leaves one more segment
    cells: dict = {}
    for k, ((rep, conc, pol), f) in enumerate(zip(order, done)):
        if k < drop:
            continue
        res = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()][-1]
        steps = segments[0][k] + segments[1][k]
        tp, itl, failed = request_tpots(res, drop=conc)
        cells.setdefault(str(conc), {}).setdefault(pol, []).append({
            "tpot": tp, "itl": itl, "failed": failed + (a.num_prompts - int(res.get("completed", 0))),
            "output_throughput": float(res["output_throughput"]), "distinct": _mean_distinct(steps),
            "batch": float(np.mean([st.tokens for st in steps])) if steps else 0.0, "by_batch": _by_batch(steps),
            "purity": domain_purity(res.get("generated_texts", []), geo), "routes": {}})
    summary = {c: summarize(cell, np.random.default_rng(a.seed + 1)) for c, cell in cells.items()}
    return {"locality": locality, "engine_layers": L, "geometry": {"beta": geo.beta, "own_share_target": geo.own_share_target},
            "cells": summary, "runs": len(order), "trace": str(sdir / "trace.npz"), "centroids": str(sdir / "centroids.eldr"),
            "model_dir": str(model), "decode_step_logs": [str(work / "logs" / f"l{locality:g}-decode{i}.steps") for i in range(2)],
            "rebuilt_from": str(work), "dropped_as_warmup": [f"rep {r} conc {c} {p}" for r, c, p in order[:drop]]}


# ------------------------------------------------------------------ the simulator beside it
def add_simulation(result: dict, calibration: Path, log) -> None:
    """Put the simulator's prediction (benchmarks/real_cpu_sim.py: the same trace, centroids,
    workers, concurrencies and output length, timed by this machine's CPU calibration) beside
    each measured cell, with the per-term check of the cost model against the logged steps."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_cpu_sim", Path(__file__).with_name("real_cpu_sim.py"))
    real_cpu_sim = importlib.util.module_from_spec(spec)  # the sibling benchmark script, loaded by path
    sys.modules["real_cpu_sim"] = real_cpu_sim
    spec.loader.exec_module(real_cpu_sim)

    from eldr_sglang.testing.sglang_cpu.step_log import read_steps

    cfg, worst = result["config"], 0.0
    for s in result["settings"]:
        work = Path(s["trace"]).parent.parent  # runs written before these fields: the --keep layout
        s.setdefault("model_dir", str(work / "models" / f"locality-{s['locality']:g}-{cfg['seed']}-"))
        s.setdefault("engine_layers", json.loads((Path(s["model_dir"]) / "config.json").read_text())["num_hidden_layers"])
        s.setdefault("decode_step_logs", [str(work / "logs" / f"l{s['locality']:g}-decode{i}.steps") for i in range(2)])
        pred = real_cpu_sim.predict(s["trace"], s["centroids"], calibration, s["model_dir"], workers=2,
                                    concurrencies=cfg["concurrencies"], output_len=cfg["output_len"],
                                    policies=",".join(cfg["policies"].split(",")), seed=cfg["seed"])
        for conc, cell in s["cells"].items():
            sim = pred["cells"][conc]["policies"]
            for pol, row in cell["policies"].items():
                if pol in sim and "p50_vs_best_balancer" in sim[pol]:
                    row["sim_p50_vs_best_balancer"] = sim[pol]["p50_vs_best_balancer"]
                    row["sim_tpot_p50_ms"] = sim[pol]["tpot_p50_ms"]
                    row["sim_distinct_per_layer_step"] = sim[pol]["distinct_per_layer_step"]
                    worst = max(worst, abs(row["sim_p50_vs_best_balancer"] - row["p50_vs_best_balancer"]) * 100)
        s["cost_model_terms"] = {  # per decode server: its steps in order, so the gaps between them are real
            Path(path).stem: {str(b): v for b, v in real_cpu_sim.step_terms(
                read_steps(Path(path), s["engine_layers"]), calibration, s["model_dir"]).items()}
            for path in s["decode_step_logs"] if Path(path).exists()}
        log(f"   simulated locality {s['locality']:g}")
    result["sim_abs_error_points"] = round(worst, 2)
    result["calibration"] = str(calibration)


def headline(result: dict) -> dict:
    """The top-level fields: the default's change at strong locality and the higher concurrency
    (with its CI), the same change on the uniform control, the repeats behind them."""
    settings = result["settings"]
    strong = max(settings, key=lambda s: s["locality"])
    control = min(settings, key=lambda s: s["locality"])
    hi = str(max(int(c) for c in strong["cells"]))
    for k in ("default_vs_best_balancer_p50", "control_default_vs_best_balancer_p50"):
        result.pop(k, None)
    if "default_vs_best_balancer_p50" in strong["cells"].get(hi, {}):
        result["default_vs_best_balancer_p50"] = strong["cells"][hi]["default_vs_best_balancer_p50"]
    if control is not strong and "default_vs_best_balancer_p50" in control["cells"].get(hi, {}):
        result["control_default_vs_best_balancer_p50"] = control["cells"][hi]["default_vs_best_balancer_p50"]["value"]
    result["repeats"] = {f"{s['locality']:g}": s.get("repeats", result["config"]["repeats"]) for s in settings}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--localities", default="0.9,0", help="model locality knob settings (0 = uniform control)")
    ap.add_argument("--concurrencies", default="8,16", help="client concurrencies (total over the 2 decodes)")
    ap.add_argument("--policies", default=",".join(BALANCERS + LOCALITY_POLICIES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per run (the first `concurrency` dropped)")
    ap.add_argument("--input-len", type=int, default=24, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=24, help="output tokens (fixed, EOS ignored)")
    ap.add_argument("--calibration-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (also after each locality setting)")
    ap.add_argument("--md", metavar="PATH", help="write the tables as Markdown")
    ap.add_argument("--keep", metavar="DIR", help="work directory to keep (default: a temporary one)")
    ap.add_argument("--calibration", metavar="FILE", help="a CPU calibration (benchmarks/gpu_calibrate.py --device "
                    "cpu): put the simulator's predicted change beside each measured one")
    ap.add_argument("--add-simulation", metavar="RESULT", help="do not measure: read RESULT (this script's --json "
                    "of a run kept with --keep) and add the simulation (needs --calibration)")
    ap.add_argument("--combine", nargs="+", metavar="RESULT", help="do not measure: join the settings of several "
                    "results (e.g. one run per locality) into one")
    ap.add_argument("--rebuild", metavar="DIR", help="do not measure: rebuild a stopped run's results from its kept "
                    "work directory (same --localities/--concurrencies/--repeats/--num-prompts as the run)")
    ap.add_argument("--engine-checks-log", metavar="FILE", help="--rebuild: the run's stderr, for its engine checks")
    ap.add_argument("--run-json", metavar="FILE", help="--rebuild: the run's own --json, if it finished (its "
                    "engine checks, start-up times and peak memory are kept)")
    ap.add_argument("--drop-runs", type=int, default=0, metavar="N", help="--rebuild: leave out the first N runs (a "
                    "run made before the script warmed its cluster up pays the one-off start costs)")
    a = ap.parse_args()
    for out in (a.json, a.md):
        if out and Path(out).exists():
            ap.error(f"{out} exists; move it away first (nothing is overwritten)")
    if a.add_simulation:
        if not a.calibration:
            ap.error("--add-simulation needs --calibration")
        result = json.loads(Path(a.add_simulation).read_text())
        add_simulation(result, Path(a.calibration), lambda m: print(m, file=sys.stderr, flush=True))
        return report(headline(result), a)
    if a.combine:
        parts = [json.loads(Path(f).read_text()) for f in a.combine]
        result = dict(parts[0], settings=[s for r in parts for s in r["settings"]],
                      seconds=sum(r["seconds"] for r in parts),
                      peak_rss_gib=max((r["peak_rss_gib"] for r in parts if r["peak_rss_gib"] == r["peak_rss_gib"]),
                                       default=float("nan")))  # a rebuilt part has no peak (NaN)
        return report(headline(result), a)
    try:
        a.localities = [float(x) for x in a.localities.split(",")]
        a.concurrencies = [int(x) for x in a.concurrencies.split(",")]
    except ValueError:
        ap.error("--localities and --concurrencies take comma lists of numbers")
    if min(a.concurrencies) < 1 or a.repeats < 1 or a.num_prompts <= max(a.concurrencies) or a.output_len < 4:
        ap.error("need concurrencies >= 1, repeats >= 1, --num-prompts > the largest concurrency, --output-len >= 4")
    policies = a.policies.split(",")
    config = {k: v for k, v in vars(a).items() if k not in ("json", "md", "keep", "combine", "rebuild",
                                                            "add_simulation", "engine_checks_log", "drop_runs",
                                                            "run_json")}
    base = {"config": config, "constructed_model": True, "default_policy": DEFAULT_LABEL, "cpu": _cpu_name()}
    if a.rebuild:
        checks = []
        if a.engine_checks_log:
            checks = [json.loads(ln.split("engine checks:", 1)[1]) for ln in Path(a.engine_checks_log).read_text().splitlines()
                      if "engine checks:" in ln]
        settings = [rebuild_setting(Path(a.rebuild), loc, a, policies) for loc in a.localities]
        for st, ck in zip(settings, checks):
            st["engine_checks"] = ck
        peak = float("nan")
        if a.run_json:  # the run's own JSON (it finished): keep what only the live run could record
            own = {f"{x['locality']:g}": x for x in json.loads(Path(a.run_json).read_text())["settings"]}
            peak = json.loads(Path(a.run_json).read_text()).get("peak_rss_gib", peak)
            for st in settings:
                for k in ("engine_checks", "startup_s"):
                    if k in own.get(f"{st['locality']:g}", {}):
                        st[k] = own[f"{st['locality']:g}"][k]
        return report(headline(dict(base, settings=settings, peak_rss_gib=peak, seconds=0)), a)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.monotonic()
    settings: list = []
    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(Path(a.keep or tmp))
        try:
            for loc in a.localities:
                settings.append(run_setting(h, a, loc, policies, log))
                if a.json:  # a checkpoint: a later setting that fails keeps this one
                    part = dict(base, settings=settings, peak_rss_gib=round(h.memory.peak / 2**30, 2),
                                seconds=round(time.monotonic() - t0), complete=False)
                    io_safe.write_text(a.json + ".partial", json.dumps(headline(part), indent=1), what="checkpoint")
            peak = h.memory.peak / 2**30
        finally:
            h.close()
    result = dict(base, settings=settings, peak_rss_gib=round(peak, 2), seconds=round(time.monotonic() - t0))
    if a.calibration:
        add_simulation(result, Path(a.calibration), log)
    if a.json:
        Path(a.json + ".partial").unlink(missing_ok=True)
    return report(headline(result), a)


def report(result: dict, a) -> int:
    lines = table(result)
    lines.append(f"\npeak RSS sum of the servers {result['peak_rss_gib']:.2f} GiB; measured in {result['seconds']} s")
    print("\n".join(lines))
    if a.json:
        io_safe.write_text(a.json, json.dumps(result, indent=1), what="--json")
    if a.md:
        io_safe.write_text(a.md, "\n".join(lines) + "\n", what="--md")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
