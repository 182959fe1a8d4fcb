"""What the real engine's decode steps do that a fitted line does not: stalls, the step time
by batch, and round robin's imbalance as a block goes on (issue 34's search for the
structural cause of the simulator's miss).

    python benchmarks/engine_dynamics.py --run WORK [--json PATH]

WORK is what benchmarks/real_cpu_switchback.py --keep WORK kept; the step line is read from
its fit (`--calibration`, default the committed benchmarks/results/engine_step_fit_cpu.json).
benchmarks/sim_vs_engine.py runs the same analysis and puts it in its result.

- **Steps by batch.** A decode step's interval runs to the same server's next step. Intervals
  across which the batch shrank are left out: the server may have emptied and sat idle.
  Per batch size: the mean interval, the time per request (mean interval / batch), and the
  fitted line. A line whose per-request time falls with the batch says an unbalanced pair of
  workers gets through less per step; the engine's column says whether it does.
- **Stalls.** A step over twice the fitted line is a stall; its excess is interval - line.
  Per batch: the share of steps that stall and the stall excess per step; overall, the share
  of the servers' time that is stall excess, how much of it overlaps a prefill forward (the
  prefill shares the cores), and the lag-1 autocorrelation of each 1 s window's stall share
  (0: stalls come i.i.d., not in episodes).
- **The other server.** The mean step by this server's batch and the other server's batch at
  its start: on a shared host a step slows as the other server steps faster.
- **Imbalance within a block.** |batch of decode 0 - batch of decode 1|, sampled every 10 ms,
  averaged per second of the arm's blocks: a balancer holds it flat; a rule that lets
  imbalance grow shows it rising after the block starts from the previous arm's state.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from eldr_sglang.experiment import load_records
from eldr_sglang.testing.sglang_cpu.step_log import read_steps

STALL_FACTOR = 2.0  # a step over this many times the fitted line is a stall
BATCH_MAX = 8  # batch sizes 1..8 in the tables (8: 8 or more)
IDLE_GAP_S = 0.6  # a server with no step for this long counts as holding no request


def _line(fit: dict, batch, sum_distinct) -> np.ndarray:
    return fit["fixed_s"] + fit["per_request_s"] * np.asarray(batch, float) + fit["per_expert_s"] * np.asarray(sum_distinct, float)


def server_steps(setting: dict) -> list[dict]:
    """Per decode server: its steps' start (unix s), batch, summed distinct and interval, the
    intervals across which the batch shrank (possible idle) dropped."""
    out = []
    for path in setting["step_logs"]:
        st = read_steps(Path(path), setting["layers"])
        t = np.array([s.t0 for s in st]) + setting["clock_offset_s"]
        b = np.array([s.tokens for s in st])
        d = np.array([float(sum(s.distinct)) for s in st])
        keep = b[1:] >= b[:-1]
        out.append({"t": t, "b": b, "t0": t[:-1][keep], "batch": b[:-1][keep], "sum_distinct": d[:-1][keep],
                    "interval": np.diff(t)[keep]})
    return out


def prefill_spans(setting: dict) -> np.ndarray:
    """The prefill's forwards as [start, end] (unix s): its first MoE layer's start to its last
    layer's end."""
    path = setting.get("prefill_step_log")
    if not path or not Path(path).exists():
        return np.zeros((0, 2))
    raw = np.loadtxt(path, ndmin=2)
    spans: list[list[float]] = []
    for t, layer, _tok, _d, us in raw:
        if layer == 0 or not spans:
            spans.append([t, t + us * 1e-6])
        else:
            spans[-1][1] = max(spans[-1][1], t + us * 1e-6)
    return np.asarray(spans) + setting["clock_offset_s"]


def _overlap(spans: np.ndarray, a: float, b: float) -> float:
    i = int(np.searchsorted(spans[:, 1], a)) if len(spans) else 0
    tot = 0.0
    while i < len(spans) and spans[i, 0] < b:
        tot += max(0.0, min(b, spans[i, 1]) - max(a, spans[i, 0]))
        i += 1
    return tot


def by_batch(servers: list[dict], fit: dict) -> list[dict]:
    """Per batch size: steps, mean interval, time per request, the line, stall share and
    stall excess per step (ms)."""
    b = np.concatenate([s["batch"] for s in servers])
    y = np.concatenate([s["interval"] for s in servers])
    line = _line(fit, b, np.concatenate([s["sum_distinct"] for s in servers]))
    rows = []
    for B in range(1, BATCH_MAX + 1):
        m = (b == B) if B < BATCH_MAX else (b >= B)
        if m.sum() < 20:
            continue
        stall = m & (y > STALL_FACTOR * line)
        rows.append({"batch": B, "steps": int(m.sum()), "mean_ms": float(y[m].mean() * 1e3),
                     "per_request_ms": float((y[m] / b[m]).mean() * 1e3), "line_ms": float(line[m].mean() * 1e3),
                     "stall_share": float(stall.sum() / m.sum()),
                     "stall_excess_per_step_ms": float((y - line)[stall].sum() / m.sum() * 1e3)})
    return rows


def stalls(servers: list[dict], fit: dict, spans: np.ndarray) -> dict:
    """Stall excess as a share of the servers' time, its overlap with prefill forwards against
    the normal steps', and the lag-1 autocorrelation of 1 s windows' stall share."""
    out = {"per_server": []}
    for s in servers:
        line = _line(fit, s["batch"], s["sum_distinct"])
        y = s["interval"]
        st = y > STALL_FACTOR * line
        excess = np.where(st, y - line, 0.0)
        span = float(s["t"][-1] - s["t"][0])
        ov_st = sum(_overlap(spans, a, a + d) for a, d in zip(s["t0"][st], y[st]))
        ov_no = sum(_overlap(spans, a, a + d) for a, d in zip(s["t0"][~st], y[~st]))
        win = np.clip(((s["t0"] - s["t0"][0]) // 1.0).astype(int), 0, None)
        share = np.bincount(win, excess)
        ok = share.size > 3 and share[:-1].std() > 0 and share[1:].std() > 0
        ac = float(np.corrcoef(share[:-1], share[1:])[0, 1]) if ok else 0.0  # no stalls: none correlated
        out["per_server"].append({"stall_share_of_time": float(excess.sum() / span), "stalls_per_s": float(st.sum() / span),
                                  "excess_p50_ms": float(np.median((y - line)[st]) * 1e3) if st.any() else 0.0,
                                  "prefill_overlap_in_stalls": float(ov_st / max(y[st].sum(), 1e-12)),
                                  "prefill_overlap_in_normal_steps": float(ov_no / max(y[~st].sum(), 1e-12)),
                                  "window_autocorr_lag1": ac})
    return out


def imbalance_by_second(setting: dict, servers: list[dict], block_s: float) -> dict[str, list[float]]:
    """Per arm: mean |b0 - b1| in each second of its blocks (10 ms samples)."""
    if len(servers) != 2:
        return {}
    _, records = load_records(setting["experiment"])
    secs = int(block_s)
    out: dict[str, list[float]] = {}
    for arm in setting["arms"]:
        acc, n = np.zeros(secs), 0
        for r in records:
            if r["arm"] != arm or not r.get("end_unix_s"):
                continue
            ts = float(r["start_unix_s"]) + np.arange(0, secs, 0.01)
            held = []
            for s in servers:
                j = np.maximum(np.searchsorted(s["t"], ts) - 1, 0)
                held.append(np.where(ts - s["t"][j] > IDLE_GAP_S, 0, s["b"][j]))
            acc += np.abs(held[0] - held[1]).reshape(secs, -1).mean(axis=1)
            n += 1
        if n:
            out[arm] = [round(float(x), 3) for x in acc / n]
    return out


def by_other_batch(servers: list[dict], min_steps: int = 40) -> dict[str, float]:
    """Mean step interval (ms) by this server's batch and the other server's batch at the step's
    start ('own,other'; cells with fewer than `min_steps` steps left out): the shared host's
    signature is a step that slows as the other server steps faster (smaller batches)."""
    if len(servers) != 2:
        return {}
    cells: dict[str, list] = {}
    for k in (0, 1):
        me, ot = servers[k], servers[1 - k]
        j = np.maximum(np.searchsorted(ot["t"], me["t0"]) - 1, 0)
        other = np.where(me["t0"] - ot["t"][j] > IDLE_GAP_S, 0, ot["b"][j])
        for b, o, y in zip(me["batch"], other, me["interval"]):
            cells.setdefault(f"{min(int(b), BATCH_MAX)},{min(int(o), BATCH_MAX)}", []).append(y)
    return {key: round(float(np.mean(v)) * 1e3, 1) for key, v in sorted(cells.items()) if len(v) >= min_steps}


def analyse_setting(setting: dict, fit: dict) -> dict:
    servers = server_steps(setting)
    res = {"by_batch": by_batch(servers, fit), "stalls": stalls(servers, fit, prefill_spans(setting)),
           "imbalance_by_second": imbalance_by_second(setting, servers, float(setting.get("block_s", 10))),
           "step_ms_by_own_and_other_batch": by_other_batch(servers)}
    return res


def table(res: dict) -> list[str]:
    lines = []
    for name, r in res.items():
        rows = r["by_batch"]
        lines += [f"{name}: decode steps by batch (all arms)", "",
                  "| batch | steps | mean interval ms | per request ms | fitted line ms | steps stalling | stall excess per step ms |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['batch']} | {x['steps']} | {x['mean_ms']:.1f} | {x['per_request_ms']:.1f} | {x['line_ms']:.1f} | "
                  f"{x['stall_share']:.3f} | {x['stall_excess_per_step_ms']:.1f} |" for x in rows]
        lines += ["", "| server | stall share of time | stalls/s | excess p50 ms | prefill overlap in stalls | "
                      "in normal steps | 1 s window autocorr |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {i} | {s['stall_share_of_time']:.3f} | {s['stalls_per_s']:.2f} | {s['excess_p50_ms']:.0f} | "
                  f"{s['prefill_overlap_in_stalls']:.3f} | {s['prefill_overlap_in_normal_steps']:.3f} | "
                  f"{s['window_autocorr_lag1']:+.3f} |" for i, s in enumerate(r["stalls"]["per_server"])]
        cells = r.get("step_ms_by_own_and_other_batch") or {}
        if cells:
            lines += ["", "Mean step ms by this server's batch (rows) and the other server's batch at its start (columns; "
                          "- : under 40 steps)", "", "| own \\ other | " + " | ".join(str(o) for o in range(BATCH_MAX + 1)) + " |",
                      "|---|" + "---|" * (BATCH_MAX + 1)]
            for b in range(1, BATCH_MAX + 1):
                row = [str(cells.get(f"{b},{o}", "-")) for o in range(BATCH_MAX + 1)]
                if any(x != "-" for x in row):
                    lines.append(f"| {b} | " + " | ".join(row) + " |")
        if r["imbalance_by_second"]:
            lines += ["", "| arm | mean abs(batch0 - batch1), by second of its blocks |", "|---|---|"]
            lines += [f"| {arm} | {' '.join(f'{x:.2f}' for x in v)} |" for arm, v in r["imbalance_by_second"].items()]
        lines.append("")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, metavar="WORK", help="the work directory real_cpu_switchback.py kept")
    ap.add_argument("--calibration", default=str(Path(__file__).resolve().parent / "results" / "engine_step_fit_cpu.json"),
                    help="the fitted step line (sim_vs_engine.py --calibration-out)")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    if a.json and Path(a.json).exists():
        ap.error(f"{a.json} exists; move it away first (nothing is overwritten)")
    run_file = Path(a.run) / "run.json"
    if not run_file.exists():
        ap.error(f"{run_file} does not exist: run benchmarks/real_cpu_switchback.py --keep {a.run} first")
    try:
        fit = json.loads(Path(a.calibration).read_text())["fit"]
    except (OSError, ValueError, KeyError) as exc:
        ap.error(f"{a.calibration}: not a fitted step line ({exc})")
    run = json.loads(run_file.read_text())
    res = {s["name"]: analyse_setting(s, fit) for s in run["settings"]}
    print("\n".join(table(res)))
    if a.json:
        from eldr_sglang import io_safe

        io_safe.write_json(res, a.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
