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
   a fresh router and SGLang's own client, `sglang.benchmark.serving --pd-separated` (its
   entry point called in this process: --client), on a domain-mixed prompt set (the same
   shuffled set for every policy of a repeat). The first `concurrency` requests of each run are
   dropped as warm-up; the router's own TPOT/TTFT histograms are read beside the client's.

Reported per policy and cell: TPOT p50/p99, ITL mean/p99, output tok/s, and the distinct
experts per MoE layer per decode step measured in the decode servers; a bootstrap confidence
interval (repeats resampled, then requests within them) for the default policy's TPOT p50
change against the best balancer of the cell; with --calibration, each run's machine pace and
the speed-normalized TPOT. Time is measured on 2 cores: the decodes own one core each, the
prefill (at nice --prefill-nice), router and client share them.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import contextlib
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


def _by_batch(servers: list) -> dict:
    """Per batch size, over the decode steps of each server (in order):
    {"B": [sum of per-step mean distinct experts per layer, steps, sum of MoE ms, [step interval ms]]}.
    A step's interval is the time to the same server's next step (the whole step: MoE, the rest
    of the forward, the scheduler, any stall); a server's last step has none."""
    out: dict = {}
    for steps in servers:
        for j, st in enumerate(steps):
            cell = out.setdefault(str(st.tokens), [0.0, 0, 0.0, []])
            cell[0] += float(np.mean(st.distinct))
            cell[1] += 1
            cell[2] += st.moe_s * 1e3
            if j + 1 < len(steps):
                cell[3].append((steps[j + 1].t0 - st.t0) * 1e3)
    return out


def _pool(runs: list) -> dict:
    out: dict = {}
    for r in runs:
        for b, (dist, n, moe, gaps) in r["by_batch"].items():
            c = out.setdefault(b, [0.0, 0, 0.0, []])
            c[0] += dist
            c[1] += n
            c[2] += moe
            c[3] = c[3] + gaps
    return out


def matched_ratio(pol_runs: list, base_runs: list, what: str = "distinct") -> float:
    """A policy's decode steps over the baseline's at equal batch size (batches of 2 or more,
    each size weighted by the fewer of the two step counts), so a policy is credited for its
    batches' composition, not for running smaller batches. what: "distinct" (mean distinct
    experts per layer), "moe" (mean MoE time, timed inside the engine) or "step" (median step
    interval: the per-token time a batch's requests see, without the rare stalls that the
    median leaves out)."""
    a, b = _pool(pol_runs), _pool(base_runs)
    common = [k for k in a if k in b and int(k) >= 2 and a[k][1] >= 3 and b[k][1] >= 3
              and (what != "step" or (len(a[k][3]) >= 3 and len(b[k][3]) >= 3))]
    if not common:
        return float("nan")
    w = {k: min(a[k][1], b[k][1]) for k in common}

    def stat(c):
        return {"distinct": c[0] / c[1], "moe": c[2] / c[1], "step": float(np.median(c[3])) if c[3] else 0.0}[what]
    return sum(w[k] * stat(a[k]) for k in common) / sum(w[k] * stat(b[k]) for k in common)


# ------------------------------------------------------------------ one benchmark run
def bench_run(h: Harness, router_url: str, model: Path, data: Path, n: int, conc: int, out_len: int, seed: int,
              out: Path, in_process: bool = True) -> dict:
    """One run of SGLang's own client (`sglang.benchmark.serving --pd-separated`) through the
    router. in_process: call its command-line entry point in this process (the same code; it
    spares every run the client's ~10-40 s import on 2 busy cores); else a subprocess."""
    argv = ["--backend", "sglang", "--base-url", router_url,
            "--pd-separated", "--model", str(model), "--tokenizer", str(model), "--dataset-name", "custom",
            "--dataset-path", str(data), "--sharegpt-output-len", str(out_len), "--num-prompts", str(n),
            "--request-rate", "inf", "--max-concurrency", str(conc), "--seed", str(seed), "--disable-tqdm",
            "--warmup-requests", "1", "--output-file", str(out), "--output-details"]
    if in_process:
        _client_in_process(argv, out.with_suffix(".client.log"))
    else:
        p = subprocess.run([sys.executable, "-m", "sglang.benchmark.serving", *argv], capture_output=True, text=True,
                           timeout=1800, cwd=REPO, env=h.env)
        if p.returncode != 0:
            raise SystemExit(f"sglang.benchmark.serving failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    if not out.exists():
        raise SystemExit(f"sglang.benchmark.serving wrote no {out}")
    return [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()][-1]


def _client_in_process(argv: list[str], log: Path) -> None:
    from sglang.benchmark import serving  # imported once, by the first run

    saved = sys.argv
    with open(log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        sys.argv = ["sglang.benchmark.serving", *argv]
        try:
            serving.cli_main()
        except SystemExit as e:  # argparse errors and the client's own exits
            if e.code not in (None, 0):
                raise SystemExit(f"sglang.benchmark.serving failed ({e.code}); its output: {log}") from None
        finally:
            sys.argv = saved


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
    """p50(a)/p50(b) - 1 with a two-level percentile bootstrap CI: repeats are resampled (a's and
    b's run of one repeat together: they shared its prompt set and its stretch of machine time),
    then requests within each chosen run. Run-to-run variation on this machine is larger than
    request-to-request, so resampling requests alone would give far too narrow an interval."""
    point = np.median(np.concatenate(a)) / np.median(np.concatenate(b)) - 1
    n = min(len(a), len(b))
    boots = np.empty(n_boot)
    for i in range(n_boot):
        reps = rng.integers(0, n, n) if n > 1 else [0]
        ra = np.concatenate([a[j][rng.integers(0, len(a[j]), len(a[j]))] for j in reps])
        rb = np.concatenate([b[j][rng.integers(0, len(b[j]), len(b[j]))] for j in reps])
        boots[i] = np.median(ra) / np.median(rb) - 1
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(point), float(lo), float(hi)


def _router_gap(runs: list, metric: str) -> float | None:
    """Mean over runs of router mean / client mean - 1 for ttft or tpot (None if not recorded)."""
    gaps = [r["router_vs_client"][f"router_mean_{metric}_ms"] / r["router_vs_client"][f"client_mean_{metric}_ms"] - 1
            for r in runs if r.get("router_vs_client", {}).get(f"router_mean_{metric}_ms")
            and r["router_vs_client"].get(f"client_mean_{metric}_ms")]
    return float(np.mean(gaps)) if gaps else None


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
            "router_vs_client_tpot": _router_gap(runs, "tpot"), "router_vs_client_ttft": _router_gap(runs, "ttft"),
        }
    if "round_robin" in cell and all("by_batch" in r for runs in cell.values() for r in runs):
        for pol in rows:
            for what, key in (("distinct", "distinct"), ("moe", "moe_ms"), ("step", "step_ms")):
                rows[pol][f"{key}_vs_round_robin_equal_batch"] = matched_ratio(cell[pol], cell["round_robin"], what) - 1
    bal = [p for p in BALANCERS if p in rows]
    best = min(bal, key=lambda p: rows[p]["tpot_p50_ms"]) if bal else None
    out = {"policies": rows, "best_balancer": best}
    if bal and all(r.get("speed") for runs in cell.values() for r in runs):
        # TPOT over the run's machine pace (see real_cpu_sim.speed_factor): the machine's speed
        # varied up to 3x between runs, for every policy alike
        norm = {p: [r["tpot"] / r["speed"] for r in runs] for p, runs in cell.items()}
        for p in rows:
            rows[p]["tpot_p50_speed_normalized_ms"] = float(np.median(np.concatenate(norm[p])) * 1e3)
            rows[p]["speed_factors"] = [round(r["speed"], 3) for r in cell[p]]
        nbest = min(bal, key=lambda p: rows[p]["tpot_p50_speed_normalized_ms"])
        out["best_balancer_speed_normalized"] = nbest
        for p in rows:
            rows[p]["p50_speed_normalized_vs_best_balancer"] = (rows[p]["tpot_p50_speed_normalized_ms"]
                                                                / rows[nbest]["tpot_p50_speed_normalized_ms"] - 1)
        if DEFAULT_LABEL in cell:
            v, lo, hi = change_ci(norm[DEFAULT_LABEL], norm[nbest], rng)
            out["default_vs_best_balancer_p50_speed_normalized"] = {"value": v, "ci_low": lo, "ci_high": hi}
    if best:
        for pol in rows:
            rows[pol]["p50_vs_best_balancer"] = rows[pol]["tpot_p50_ms"] / rows[best]["tpot_p50_ms"] - 1
            rows[pol]["p99_vs_best_balancer"] = rows[pol]["tpot_p99_ms"] / rows[best]["tpot_p99_ms"] - 1
        if DEFAULT_LABEL in cell:
            v, lo, hi = change_ci([r["tpot"] for r in cell[DEFAULT_LABEL]], [r["tpot"] for r in cell[best]], rng)
            out["default_vs_best_balancer_p50"] = {"value": v, "ci_low": lo, "ci_high": hi}
    return out


# ------------------------------------------------------------------ one locality setting
def collect_trace(ref, geo: lm.Geometry, work: Path, a, rng) -> Path:
    """`eldr collect` of `a.calibration_prompts` domain prompts (domains in turn) against a running
    reference server, decode routing kept: WORK/trace.npz."""
    L, K, E, D = (geo.spec[k] for k in ("layers", "top_k", "experts", "domains"))
    calib = work / "calibration.jsonl"
    calib.write_text("".join(json.dumps({"prompt": lm.domain_prompt(geo, i % D, a.input_len, rng), "domain": str(i % D)})
                             + "\n" for i in range(a.calibration_prompts)))
    trace = work / "trace.npz"
    _run([sys.executable, "-m", "eldr_sglang", "collect", str(calib), "--url", ref.url, "--out", str(trace),
          "--num-hidden-layers", str(L), "--top-k", str(K), "--num-experts", str(E), "--max-new-tokens",
          str(a.output_len), "--ignore-eos", "--keep-decode", str(a.calibration_prompts), "--no-progress"])
    return trace


def fit_centroids(trace: Path, work: Path) -> Path:
    """`eldr fit` of one centroid per decode worker (2) over all layers: WORK/centroids.eldr."""
    centroids = work / "centroids.eldr"
    _run([sys.executable, "-m", "eldr_sglang", "fit", str(trace), "--workers", "2", "--layers", "all",
          "--out", str(centroids), "--quiet"])
    return centroids


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
        trace = collect_trace(ref, geo, work, a, rng)
    finally:
        h.stop([ref])
    centroids = fit_centroids(trace, work)
    log(f"   collected {a.calibration_prompts} prompts and fitted 2 centroids ({time.monotonic() - t0:.0f} s)")

    prefill, boot, decodes = h.start_pd(model, 2, prefill_extra=["--enable-eldr-signature", "--enable-eldr-late-binding"],
                                        decode_step_log=True, decode_cpus=[{0}, {1}], prefix=f"l{locality:g}-",
                                        prefill_nice=a.prefill_nice)
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
                    "output_throughput": r["output_throughput"], "routes": r["routes"],
                    "router_vs_client": r.get("router_vs_client"), "speed": r.get("speed")} for r in runs]
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
        res = bench_run(h, router.url, model, data, a.num_prompts, conc, a.output_len, a.seed + 1000 + rep, out,
                        in_process=a.client == "inprocess")
        servers = [_steps_since(h.step_log(d.name), st, geo.spec["layers"]) for d, st in zip(decodes, starts)]
        steps = [s for srv in servers for s in srv]
        metrics = scrape_metrics(router.url)
        routes = router_routes(metrics)
    finally:
        h.stop([router])
    tp, itl, failed = request_tpots(res, drop=conc)
    return {"tpot": tp, "itl": itl, "failed": failed + (a.num_prompts - int(res.get("completed", 0))),
            "output_throughput": float(res["output_throughput"]),
            "distinct": _mean_distinct(steps), "batch": float(np.mean([s.tokens for s in steps])) if steps else 0.0,
            "by_batch": _by_batch(servers), "purity": domain_purity(res.get("generated_texts", []), geo), "routes": routes,
            "router_vs_client": router_vs_client(metrics, res),
            "speed": _real_cpu_sim().speed_factor(steps, _calibrated(a.calibration, model)) if a.calibration else None}


_MODELS: dict = {}


def _calibrated(calibration, model_dir):
    key = (str(calibration), str(model_dir))
    if key not in _MODELS:
        _MODELS[key] = _real_cpu_sim().calibrated_model(calibration, model_dir)
    return _MODELS[key]


def _short_routes(routes: dict) -> str:
    return ", ".join(f"{k.split('{', 1)[1].rstrip('}') if '{' in k else k}={v:g}" for k, v in routes.items())


ROUTE_METRICS = ("eldr_router_decode_routes_total", "eldr_router_fallbacks_total")


def scrape_metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def _metric_total(text: str, name: str) -> float:
    """Sum of one Prometheus series over all its label sets."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rpartition(" ")[2])
    return total


def router_vs_client(text: str, res: dict) -> dict:
    """The router's own TTFT/TPOT means (its histograms' sum/count over the run: a fresh router
    per run) beside the client's (sglang.benchmark.serving), both over every request of the run."""
    out = {"client_mean_ttft_ms": res.get("mean_ttft_ms"), "client_mean_tpot_ms": res.get("mean_tpot_ms")}
    for m in ("ttft", "tpot"):
        n = _metric_total(text, f"eldr_router_{m}_seconds_count")
        out[f"router_mean_{m}_ms"] = _metric_total(text, f"eldr_router_{m}_seconds_sum") / n * 1e3 if n else None
        out[f"router_{m}_count"] = n
    return out


def router_routes(text: str) -> dict:
    """The router's decode-route and fallback counters ({'name{labels}': count}): shows that a
    locality policy really routed by signature (reason band/locality) rather than fell back."""
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
                         "distinct vs round_robin at equal batch | MoE ms vs round_robin at equal batch | "
                         "step ms vs round_robin at equal batch | batch | requests | failed |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for pol, r in cell["policies"].items():
                sim = f"{r['sim_p50_vs_best_balancer']:+.1%}" if "sim_p50_vs_best_balancer" in r else "-"
                sim_d = f" ({r['sim_distinct_per_layer_step']:.2f})" if "sim_distinct_per_layer_step" in r else ""
                lines.append(f"| {pol} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | {r['p50_vs_best_balancer']:+.1%} | "
                             f"{r['p99_vs_best_balancer']:+.1%} | {sim} | {r['itl_mean_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
                             f"{r['output_tok_s']:.1f} | {r['distinct_per_layer_step']:.2f}{sim_d} | "
                             f"{r.get('distinct_vs_round_robin_equal_batch', float('nan')):+.1%} | "
                             f"{r.get('moe_ms_vs_round_robin_equal_batch', float('nan')):+.1%} | "
                             f"{r.get('step_ms_vs_round_robin_equal_batch', float('nan')):+.1%} | {r['batch_per_step']:.1f} | "
                             f"{r['requests']} | {r['failed']} |")
            gaps = [(pol, r.get("router_vs_client_tpot"), r.get("router_vs_client_ttft"))
                    for pol, r in cell["policies"].items() if r.get("router_vs_client_tpot") is not None]
            if gaps:
                lines.append("\nthe router's own mean TPOT / TTFT (its histograms) against the client's, per policy: "
                             + "; ".join(f"{p} {t:+.1%} / {f:+.1%}" for p, t, f in gaps))
            d = cell.get("default_vs_best_balancer_p50")
            if d:
                lines.append(f"\n{DEFAULT_LABEL} vs {cell['best_balancer']}: TPOT p50 {d['value']:+.1%} "
                             f"(95% bootstrap CI {d['ci_low']:+.1%} .. {d['ci_high']:+.1%})")
            d = cell.get("default_vs_best_balancer_p50_speed_normalized")
            if d:
                lines.append(f"\nspeed-normalized (each run's TPOT over its machine pace): best balancer "
                             f"{cell['best_balancer_speed_normalized']}; per policy TPOT p50 ms (change; pace of each run): "
                             + "; ".join(f"{p} {r['tpot_p50_speed_normalized_ms']:.1f} ({r['p50_speed_normalized_vs_best_balancer']:+.1%}; "
                                         + ", ".join(f"{x:.2f}" for x in r["speed_factors"]) + ")"
                                         for p, r in cell["policies"].items()))
                lines.append(f"\n{DEFAULT_LABEL} vs {cell['best_balancer_speed_normalized']}, speed-normalized: TPOT p50 "
                             f"{d['value']:+.1%} (95% bootstrap CI {d['ci_low']:+.1%} .. {d['ci_high']:+.1%})")
    return lines


# ------------------------------------------------------------------ rebuilding from a kept run
def _split_runs(logs: list, per_run: int) -> list:
    """The decode servers' steps cut into runs: runs are made one after another, each of exactly
    `per_run` decode tokens over all servers, so in the servers' merged timeline run k ends where
    the running token count reaches (k + 1) * per_run. Returns, per run, each server's steps;
    None if the count steps over a boundary (the logs do not hold whole runs of that size)."""
    ev = sorted(((st.t0, i, st) for i, steps in enumerate(logs) for st in steps), key=lambda e: e[0])
    runs, cur, total = [], [[] for _ in logs], 0
    for _, i, st in ev:
        cur[i].append(st)
        total += st.tokens
        if total % per_run == 0:
            runs.append(cur)
            cur = [[] for _ in logs]
        elif total // per_run > len(runs):
            return None
    if any(cur):
        runs.append(cur)  # a run stopped mid-way
    return runs


def rebuild_setting(work: Path, locality: float, a, policies: list[str]) -> dict:
    """A setting's results from a work directory kept with --keep (the run files, the decode
    step logs, the engine checks logged to stderr are not kept: pass them separately), for a run
    stopped before it wrote its JSON, or to recompute a finished one. Each decode server's steps
    are split into runs at its longest idle gaps (the router restart and the client start-up
    between runs), in the order the runs were made; every run must then hold exactly its known
    number of decode tokens, or nothing is rebuilt (a run stopped mid-way leaves one segment
    more, which is dropped). --run-json: the router's own figures of the same runs are kept."""
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
    # Each run's decode tokens over both servers: every request and the client's one warm-up
    # request log output_len tokens in the decode step logs (measured: the runs of
    # 2026-12-03 split into exactly this many each)
    per_run = (a.num_prompts + 1) * a.output_len
    runs = warm + len(order)
    logs = [read_steps(work / "logs" / f"l{locality:g}-decode{i}.steps", L) for i in range(2)]
    split = _split_runs(logs, per_run)
    if split is None or len(split) < runs or any(sum(st.tokens for srv in split[k] for st in srv) != per_run
                                                 for k in range(runs)):
        raise SystemExit(f"{work}: the decode step logs do not split into {runs} runs of {per_run} decode tokens each; "
                         "cannot attribute steps to runs")
    split = split[warm:runs]  # a last, unfinished run leaves one more, which is dropped
    em = _calibrated(a.calibration, model) if getattr(a, "calibration", None) else None
    raw = {}
    if getattr(a, "run_json", None):  # the run's own records (router figures) of the same runs, in order
        for st in json.loads(Path(a.run_json).read_text())["settings"]:
            if f"{st['locality']:g}" == f"{locality:g}":
                raw = st.get("raw", {})
    cells: dict = {}
    for k, ((rep, conc, pol), f) in enumerate(zip(order, done)):
        if k < drop:
            continue
        res = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()][-1]
        steps = split[k][0] + split[k][1]
        tp, itl, failed = request_tpots(res, drop=conc)
        nth = sum(1 for r2, c2, p2 in order[:k] if (c2, p2) == (conc, pol))
        own = raw.get(str(conc), {}).get(pol, [])
        cells.setdefault(str(conc), {}).setdefault(pol, []).append({
            "tpot": tp, "itl": itl, "failed": failed + (a.num_prompts - int(res.get("completed", 0))),
            "output_throughput": float(res["output_throughput"]), "distinct": _mean_distinct(steps),
            "batch": float(np.mean([st.tokens for st in steps])) if steps else 0.0,
            "by_batch": _by_batch(split[k]),
            "purity": domain_purity(res.get("generated_texts", []), geo),
            "routes": own[nth]["routes"] if nth < len(own) else {},
            "router_vs_client": own[nth].get("router_vs_client") if nth < len(own) else None,
            "speed": _real_cpu_sim().speed_factor(steps, em) if em is not None else None})
    summary = {c: summarize(cell, np.random.default_rng(a.seed + 1)) for c, cell in cells.items()}
    return {"locality": locality, "engine_layers": L, "geometry": {"beta": geo.beta, "own_share_target": geo.own_share_target},
            "cells": summary, "runs": len(order), "trace": str(sdir / "trace.npz"), "centroids": str(sdir / "centroids.eldr"),
            "model_dir": str(model), "decode_step_logs": [str(work / "logs" / f"l{locality:g}-decode{i}.steps") for i in range(2)],
            "rebuilt_from": str(work), "dropped_as_warmup": [f"rep {r} conc {c} {p}" for r, c, p in order[:drop]]}


# ------------------------------------------------------------------ the simulator beside it
def _real_cpu_sim():
    """The sibling benchmark script benchmarks/real_cpu_sim.py, loaded by path (once)."""
    if "real_cpu_sim" not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location("real_cpu_sim", Path(__file__).with_name("real_cpu_sim.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["real_cpu_sim"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["real_cpu_sim"]


def add_simulation(result: dict, calibration: Path, log) -> None:
    """Put the simulator's prediction (benchmarks/real_cpu_sim.py: the same trace, centroids,
    workers, concurrencies and output length, timed by this machine's CPU calibration) beside
    each measured cell, with the per-term check of the cost model against the logged steps."""
    real_cpu_sim = _real_cpu_sim()
    from eldr_sglang.testing.sglang_cpu.step_log import read_steps

    cfg, worst, worst_norm = result["config"], 0.0, None
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
                    if "p50_speed_normalized_vs_best_balancer" in row:
                        worst_norm = max(worst_norm or 0.0, abs(row["sim_p50_vs_best_balancer"]
                                                                - row["p50_speed_normalized_vs_best_balancer"]) * 100)
        s["cost_model_terms"] = {  # per decode server: its steps in order, so the gaps between them are real
            Path(path).stem: {str(b): v for b, v in real_cpu_sim.step_terms(
                read_steps(Path(path), s["engine_layers"]), calibration, s["model_dir"]).items()}
            for path in s["decode_step_logs"] if Path(path).exists()}
        log(f"   simulated locality {s['locality']:g}")
    result["sim_abs_error_points"] = round(worst, 2)
    if worst_norm is not None:
        result["sim_abs_error_points_speed_normalized"] = round(worst_norm, 2)
    result["calibration"] = str(calibration)


def headline(result: dict) -> dict:
    """The top-level fields: the default's change at strong locality and the higher concurrency
    (with its CI), the same change on the uniform control, the repeats behind them."""
    settings = result["settings"]
    strong = max(settings, key=lambda s: s["locality"])
    control = min(settings, key=lambda s: s["locality"])
    hi = str(max(int(c) for c in strong["cells"]))
    for key in ("default_vs_best_balancer_p50", "default_vs_best_balancer_p50_speed_normalized"):
        result.pop(key, None)
        result.pop("control_" + key, None)
        if key in strong["cells"].get(hi, {}):
            result[key] = strong["cells"][hi][key]
        if control is not strong and key in control["cells"].get(hi, {}):
            result["control_" + key] = control["cells"][hi][key]["value"]
    result["repeats"] = {f"{s['locality']:g}": s.get("repeats", result["config"]["repeats"]) for s in settings}
    return result


def _parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--prefill-nice", type=int, default=10, metavar="N",
                    help="lower the prefill server's CPU priority by N (default 10): on 2 cores it shares the decodes' "
                         "cores, and in a real PD cluster prefill never takes decode compute; 0 = equal priority")
    ap.add_argument("--client", choices=("inprocess", "subprocess"), default="inprocess",
                    help="run sglang.benchmark.serving's entry point in this process (default: its import is paid "
                         "once) or as `python -m sglang.benchmark.serving` per run")
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
    return ap


def main() -> int:
    ap = _parser()
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
        peak, seconds = float("nan"), 0
        if a.run_json:  # the run's own JSON (it finished): keep what only the live run could record
            own = {f"{x['locality']:g}": x for x in json.loads(Path(a.run_json).read_text())["settings"]}
            peak = json.loads(Path(a.run_json).read_text()).get("peak_rss_gib", peak)
            seconds = json.loads(Path(a.run_json).read_text()).get("seconds", 0)
            for st in settings:
                for k in ("engine_checks", "startup_s"):
                    if k in own.get(f"{st['locality']:g}", {}):
                        st[k] = own[f"{st['locality']:g}"][k]
        return report(headline(dict(base, settings=settings, peak_rss_gib=peak, seconds=seconds)), a)

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
