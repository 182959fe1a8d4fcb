"""The strict study protocol: a comparison of routing policies that cannot flatter.

An audit of the first TPOT study found that its headline gains came from the protocol, not the
policy: too few requests (one wrap of a 351-request half swung a cell from +17% to -6%), one
fit/eval split, trace-order arrivals only, closed loop only, and recorded output lengths
(short-output domains parked on quiet workers cut median TPOT by a quarter with flat
throughput). Under this protocol every comparison

- replays at least `STRICT_MIN_REQUESTS` requests (held-out ones, wrapping around) and drops the
  first `WARMUP_FRAC` of arrivals from the latency statistics;
- is repeated over several fit/eval splits (the centroids never see the evaluated requests),
  and reports the spread;
- runs in shuffled and in trace order, closed loop and open loop (Poisson at a fixed fraction
  of shortest_queue's measured capacity, the same rate for every policy), with fixed and
  (where the trace records them) recorded output lengths;
- shows mean ITL, output throughput, p50 and p99 TPOT side by side, against the best load
  balancer of the same cell, beside two bounds: `perfect_overlap` (every layer of every step
  touches top_k experts: no routing can do better) and `clairvoyant` (ELDR fed signatures from
  the decode rows, which a router cannot know).

Used by benchmarks/tpot_study.py and `eldr simulate --protocol strict`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np

from eldr_sglang.sim.cluster import ClusterConfig
from eldr_sglang.sim.report import LOAD_BALANCERS, pct_change
from eldr_sglang.sim.runner import PolicySpec, parse_policies, run_comparison
from eldr_sglang.workload import replay_workload

STRICT_MIN_REQUESTS = 2000
WARMUP_FRAC = 0.1
FIXED_OUTPUT_LEN = 128
# Open loop: Poisson arrivals at this fraction of shortest_queue's closed-loop request
# throughput at OPEN_REFERENCE_CLIENTS clients per worker (measured on the same requests).
OPEN_LOAD = 0.85
OPEN_REFERENCE_CLIENTS = 32
BOUND_LABELS = ("perfect_overlap", "clairvoyant/0.05")
STRICT_POLICIES = "random,round_robin,shortest_queue,power_of_two,eldr,eldr/0.05,locality/0.05"

METRIC_KEYS = ("tpot_ms", "ttft_ms", "itl_ms", "throughput_tok_s", "unique_experts_per_layer_step",
               "expert_locality", "load_imbalance", "mean_batch", "requests")


@dataclass(frozen=True)
class Cell:
    order: str  # "shuffle" or "trace"
    loop: str  # "closed" or "open"
    load: float  # closed: clients per decode worker; open: fraction of shortest_queue's capacity
    output: str  # "fixed" (FIXED_OUTPUT_LEN tokens) or "recorded"

    def label(self) -> str:
        ld = f"{self.load:g}/worker" if self.loop == "closed" else f"{self.load:g}xcap"
        return f"{self.order},{self.loop}@{ld},{self.output}"


def strict_cells(loads=(8, 32), recorded: bool = True, orders=("shuffle", "trace"), open_loop: bool = True) -> list[Cell]:
    outs = ("fixed", "recorded") if recorded else ("fixed",)
    cells = []
    for o in orders:
        for out in outs:
            cells += [Cell(o, "closed", float(c), out) for c in loads]
            if open_loop:
                cells.append(Cell(o, "open", OPEN_LOAD, out))
    return cells


def random_splits(num_requests: int, n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """n seeded random halves: (fit requests, eval requests), both sorted (trace order)."""
    out = []
    for s in range(n):
        perm = np.random.default_rng(seed + s).permutation(num_requests)
        half = num_requests // 2
        out.append((np.sort(perm[:half]), np.sort(perm[half:])))
    return out


def eval_sequence(eval_idx: np.ndarray, order: str, n: int, seed: int) -> np.ndarray:
    """At least n requests from the held-out set: in trace order (wrapping around), or shuffled
    (a fresh permutation per pass, so no fixed neighbour pattern repeats)."""
    eval_idx = np.asarray(eval_idx)
    reps = -(-max(n, len(eval_idx)) // len(eval_idx))
    if order == "trace":
        return np.tile(eval_idx, reps)[: max(n, len(eval_idx))]
    if order != "shuffle":
        raise ValueError(f"order must be 'shuffle' or 'trace', got {order!r}")
    rng = np.random.default_rng(seed)
    return np.concatenate([eval_idx[rng.permutation(len(eval_idx))] for _ in range(reps)])[: max(n, len(eval_idx))]


def _slim(m: dict) -> dict:
    # paged experts (expert-offload mode): hit rate, page-ins per step, reuse, per worker
    return {k: m[k] for k in METRIC_KEYS} | ({"paged": m["paged"]} if "paged" in m else {})


def run_cell(replay, eval_idx, specs: list[PolicySpec], model, K: int, cell: Cell, *, centroids: str | None,
             signatures=None, requests: int = STRICT_MIN_REQUESTS, seed: int = 0, capacity: dict | None = None,
             context_len: int | None = None, clairvoyant=None) -> dict:
    """Every spec on one cell; returns {label: metrics} plus "_workload"."""
    if requests < STRICT_MIN_REQUESTS:
        raise ValueError(f"the strict protocol needs at least {STRICT_MIN_REQUESTS} requests, got {requests}")
    idx = eval_sequence(eval_idx, cell.order, requests, seed)
    out_len = FIXED_OUTPUT_LEN if cell.output == "fixed" else None
    cfg = ClusterConfig(num_decode=K)
    common = dict(requests=idx, order="trace", output_len=out_len, seed=seed, context_len=context_len)
    if cell.loop == "closed":
        wl = replay_workload(replay, arrival="closed", concurrency=int(cell.load * K), **common)
    else:
        key = (cell.order, cell.output)
        cap = None if capacity is None else capacity.get(key)
        if cap is None:
            ref = replay_workload(replay, arrival="closed", concurrency=OPEN_REFERENCE_CLIENTS * K, **common)
            m, _ = run_comparison(replay, ref, parse_policies("shortest_queue"), model, cfg, seed=seed)
            mm = m["shortest_queue"]
            cap = mm["requests"] / mm["duration_s"]
            if capacity is not None:
                capacity[key] = cap
        wl = replay_workload(replay, arrival="poisson", rate=cell.load * cap, **common)
    pols, _ = run_comparison(replay, wl, specs, model, cfg, centroids=centroids, seed=seed, signatures=signatures,
                             warmup_frac=WARMUP_FRAC, clairvoyant=clairvoyant)
    res = {n: _slim(m) for n, m in pols.items()}
    res["_workload"] = wl.describe()
    return res


def versus_best(cell_res: dict, label: str) -> dict:
    """`label` against the best load balancer of the cell, per metric (negative = faster for
    times; for throughput, positive = more tokens/s), and the bounds' gaps."""
    p = cell_res
    lbs = [b for b in LOAD_BALANCERS if b in p]
    e = p[label]
    out = {}
    for key, stat in (("tpot_ms", "p50"), ("tpot_ms", "p99"), ("tpot_ms", "mean"), ("itl_ms", "mean")):
        best = min(p[b][key][stat] for b in lbs)
        out[f"{key.split('_')[0]}_{stat}"] = pct_change(e[key][stat], best)
    out["throughput"] = pct_change(e["throughput_tok_s"], max(p[b]["throughput_tok_s"] for b in lbs))
    out["best_lb_p50"] = min(lbs, key=lambda b: p[b]["tpot_ms"]["p50"])
    return out


def spread(values) -> dict:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def fit_split(trace, fit_idx, K: int, tau: float, seed: int, path: str) -> str:
    from eldr_sglang.offline.fit import fit_trace

    fit = fit_trace(trace, workers=K, tau=tau, seed=seed, requests=fit_idx)
    fit.write(path)
    return path


def run_protocol(trace, models: dict, K: int, cells: list[Cell] | dict, splits: list[tuple[np.ndarray, np.ndarray]], *,
                 policies: str = STRICT_POLICIES, bounds: bool = True, requests: int = STRICT_MIN_REQUESTS,
                 tau: float = 0.1, seed: int = 0, context_len: int | None = None, log=None, tmpdir: str | None = None) -> list[dict]:
    """Every (split, cost-model variant, cell): fit on the split's fit half, evaluate the
    policies (and bounds) on its held-out half. `models` maps variant name -> ExecutionModel;
    `cells` is one list for every variant or {variant: cells}.
    Returns one record per run: {split, variant, cell, policies: {label: metrics}}."""
    from eldr_sglang.sim.policies import eldr_signatures
    from eldr_sglang.sim.replay import TraceReplay

    text = policies + ("," + ",".join(BOUND_LABELS) if bounds else "")
    specs = parse_policies(text, tau)
    replay = trace if isinstance(trace, TraceReplay) else TraceReplay(trace)
    dec_trace = TraceReplay(replay.decode_trace()) if bounds else None
    tmp = tmpdir or tempfile.mkdtemp(prefix="eldr-protocol-")
    records = []
    for si, (fit_idx, ev) in enumerate(splits):
        # replay request i is request source_requests[i] of the trace given (v2: of those that kept decode)
        cpath = fit_split(replay.source, replay.source_requests[np.asarray(fit_idx)], K, tau, seed + si,
                          os.path.join(tmp, f"split{si}-K{K}.eldr"))
        sigs = eldr_signatures(replay, cpath)
        clair = None
        if bounds:  # the same fit on the same split, but from the decode rows
            dpath = fit_split(dec_trace.trace, fit_idx, K, tau, seed + si, os.path.join(tmp, f"split{si}-K{K}-decode.eldr"))
            clair = (dpath, eldr_signatures(dec_trace, dpath))
        for vname, em in models.items():
            capacity: dict = {}
            for cell in (cells[vname] if isinstance(cells, dict) else cells):
                if cell.output == "recorded" and not has_recorded_lengths(replay, ev):
                    continue
                r = run_cell(replay, ev, specs, em, K, cell, centroids=cpath, signatures=sigs, requests=requests,
                             seed=seed + si, capacity=capacity, context_len=context_len, clairvoyant=clair)
                records.append({"split": si, "variant": vname, "cell": cell.label(), "K": K,
                                "context_len": context_len, "policies": r})
                if log:
                    d = versus_best(r, "eldr/0.05")
                    dl = versus_best(r, "locality/0.05") if "locality/0.05" in r else None
                    log(f"   split {si} {vname:21s} {cell.label():34s} eldr/0.05 p50 {d['tpot_p50']:+.1f}% p99 {d['tpot_p99']:+.1f}%"
                        + (f" | locality/0.05 p50 {dl['tpot_p50']:+.1f}% p99 {dl['tpot_p99']:+.1f}%" if dl else ""))
    return records


def has_recorded_lengths(replay, idx) -> bool:
    """Whether the requests' recorded output lengths vary (a synthetic trace of one fixed
    length has nothing to add over the fixed-length cells)."""
    lens = replay.recorded_output_len[np.asarray(idx)]
    return bool(lens.min() != lens.max())


def summarize(records: list[dict], labels: list[str]) -> dict:
    """Per policy label and variant: spread over (split x cell) of its change vs the best load
    balancer, the count of runs where it loses on p50 or p99, and the bounds' p50 gaps."""
    out: dict = {}
    for lab in labels:
        for v in sorted({r["variant"] for r in records}):
            rs = [r for r in records if r["variant"] == v and lab in r["policies"]]
            if not rs:
                continue
            ds = [versus_best(r["policies"], lab) for r in rs]
            out.setdefault(lab, {})[v] = {
                **{k: spread([d[k] for d in ds]) for k in ("tpot_p50", "tpot_p99", "tpot_mean", "itl_mean", "throughput")},
                "loses_p50": sum(d["tpot_p50"] > 0 for d in ds),
                "loses_p99": sum(d["tpot_p99"] > 0 for d in ds),
                "runs": len(ds),
            }
    return out
