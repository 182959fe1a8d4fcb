"""Reports of simulation runs: a readable table, JSON, and plots (matplotlib, lazily)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from eldr_sglang.sim.policies import BASELINES as LOAD_BALANCERS  # the Rust list's balancers


def _f(x: float, nd: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def pct_change(new: float, old: float) -> float:
    return (new / old - 1.0) * 100.0 if old and not math.isnan(old) else float("nan")


def best_balancer(policies: dict[str, dict]) -> str | None:
    """The baseline every dTPOT is against: the load balancer (random, round_robin,
    shortest_queue, power_of_two) with the lowest median TPOT among those present."""
    lbs = [p for p in policies if p in LOAD_BALANCERS]
    return min(lbs, key=lambda p: policies[p]["tpot_ms"]["p50"]) if lbs else None


def format_table(policies: dict[str, dict], title: str | None = None) -> str:
    """One row per policy; the last columns compare each policy with the best load balancer
    (lowest median TPOT among random/round_robin/shortest_queue/power_of_two present)."""
    best = best_balancer(policies)
    vs = f" vs {best}" if best else ""
    head = [
        "policy", "TPOT mean", "TPOT p50", "TPOT p99", "TTFT p50", "TTFT p99", "ITL p99",
        "tok/s", "experts/layer/step", "locality", "reuse", "imbal", f"dTPOT p50{vs}", f"dTPOT p99{vs}",
    ]
    rows = []
    for name, m in policies.items():
        t = m["tpot_ms"]
        d50 = d99 = "-"
        if best is not None and name != best:
            b = policies[best]["tpot_ms"]
            d50 = f"{pct_change(t['p50'], b['p50']):+.1f}%"
            d99 = f"{pct_change(t['p99'], b['p99']):+.1f}%"
        rows.append([
            name, _f(t["mean"]), _f(t["p50"]), _f(t["p99"]), _f(m["ttft_ms"]["p50"], 1), _f(m["ttft_ms"]["p99"], 1),
            _f(m["itl_ms"]["p99"]), f"{m['throughput_tok_s']:.0f}", _f(m["unique_experts_per_layer_step"]),
            _f(m["expert_locality"], 3), _f(m["expert_reuse_ratio"]), _f(m["load_imbalance"]), d50, d99,
        ])
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    out = []
    if title:
        out.append(title)
    out.append(line(head))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in rows)
    out.append("times in ms; locality = distinct experts / expectation for randomly mixed batches of the same size "
               "(1 = none); imbal = max/mean requests per worker; dTPOT = change vs the best load balancer"
               + (f" ({best})" if best else ""))
    if all("paged" in m for m in policies.values()) and policies:
        out.append(format_paged(policies))
    return "\n".join(out)


def format_paged(policies: dict[str, dict]) -> str:
    """Paged experts (simulated SGLang --enable-paged-experts): hit rate, page-ins per step and
    reuse (token-expert selections per page-in), pooled and per decode worker."""
    out = ["paged experts (hit rate / page-ins per step / selections per page-in; per worker hit rates):"]
    width = max(len(n) for n in policies)
    for name, m in policies.items():
        p = m["paged"]
        ws = " ".join(f"{w['hit_rate']:.3f}" for w in p["per_worker"])
        out.append(f"  {name.ljust(width)}  {p['hit_rate']:.3f} / {p['page_ins_per_step']:.1f} / {_f(p['reuse'])}   [{ws}]")
    return "\n".join(out)


def format_workers(policies: dict[str, dict]) -> str:
    """Per-worker load: requests served, mean batch and busy fraction of each decode worker."""
    out = ["per-worker load (requests / mean batch / busy %):"]
    width = max(len(n) for n in policies)
    for name, m in policies.items():
        cells = [f"{w['requests']}/{w['mean_batch']:.0f}/{100 * w['busy_frac']:.0f}" for w in m["per_worker"]]
        out.append(f"  {name.ljust(width)}  " + "  ".join(cells))
    return "\n".join(out)


def markdown_table(policies: dict[str, dict]) -> str:
    best = best_balancer(policies)
    lines = [
        "| policy | TPOT mean | TPOT p50 | TPOT p99 | TTFT p50 | tok/s | experts/layer/step | locality | reuse | dTPOT p50 vs best LB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in policies.items():
        t = m["tpot_ms"]
        d = "-" if best is None or name == best else f"{pct_change(t['p50'], policies[best]['tpot_ms']['p50']):+.1f}%"
        lines.append(
            f"| {name} | {_f(t['mean'])} | {_f(t['p50'])} | {_f(t['p99'])} | {_f(m['ttft_ms']['p50'], 1)} | "
            f"{m['throughput_tok_s']:.0f} | {_f(m['unique_experts_per_layer_step'])} | {_f(m['expert_locality'], 3)} | {_f(m['expert_reuse_ratio'])} | {d} |"
        )
    return "\n".join(lines)


def json_summary(policies: dict[str, dict], meta: dict | None = None) -> dict:
    """{"policies": {name: metrics}, "meta": {...}} (per-worker detail kept)."""
    return {"policies": policies, "meta": meta or {}}


def write_json(obj: dict, path: str | Path, inputs=()) -> None:
    """Strict JSON (NaN as null), written atomically (eldr_sglang.io_safe); `inputs`:
    (label, path) pairs it must not overwrite."""
    from eldr_sglang import io_safe

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    io_safe.write_json(obj, path, inputs=inputs)


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'eldr-sglang[plot]'") from None
    return plt


_COLORS = {
    "random": "#999999", "round_robin": "#7f7f7f", "shortest_queue": "#1f77b4", "power_of_two": "#17becf",
    "eldr": "#d62728", "eldr/bounded": "#ff7f0e", "oracle": "#2ca02c",
}


def _color(name: str):
    """Colour of a policy label ('eldr@0.2' is eldr's; 'eldr/0.05' is bounded ELDR's)."""
    base = name.split("@")[0]
    if "/" in name:
        base = base.split("/")[0] + "/bounded"
    return _COLORS.get(base, "#8c564b")


def _save(plt, fig, path: str | Path, title: str, rect=(0, 0, 1, 1)) -> None:
    """Every plot here is of simulated runs: the title says so."""
    title = f"simulated: {title}" if title else "simulated"
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=rect)
    from eldr_sglang.io_safe import atomic_output

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_output(path, "wb", what="plot") as fh:
            fig.savefig(fh, format=path.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)


def plot_runs(policies: dict[str, dict], step_distinct: dict[str, np.ndarray], path: str | Path, title: str = "") -> None:
    """Two panels: TPOT p50/p99 per policy; distribution of distinct experts per MoE layer
    per decode step."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    names = list(policies)
    x = np.arange(len(names))
    a.bar(x - 0.2, [policies[n]["tpot_ms"]["p50"] for n in names], 0.4, label="p50", color=[_color(n) for n in names])
    a.bar(x + 0.2, [policies[n]["tpot_ms"]["p99"] for n in names], 0.4, label="p99", color=[_color(n) for n in names], alpha=0.5)
    a.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    a.set_ylabel("TPOT (ms)")
    a.set_title("TPOT (solid p50, light p99)", fontsize=9)
    lo = min(policies[n]["tpot_ms"]["p50"] for n in names)
    a.set_ylim(lo * 0.8, None)
    for n in names:
        d = np.asarray(step_distinct.get(n, []))
        if d.size:
            b.hist(d, bins=40, histtype="step", label=n, color=_color(n), density=True)
    b.set_xlabel("distinct experts per MoE layer in a decode step")
    b.set_ylabel("density")
    b.legend(fontsize=7)
    b.set_title("experts touched per step", fontsize=9)
    _save(plt, fig, path, title)


def plot_sweep(sweep: dict[str, list[tuple[float, dict]]], path: str | Path, xlabel: str = "load", title: str = "") -> None:
    """TPOT p50 (solid) and p99 (dashed) against load for each policy, plus distinct experts."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    for name, pts in sweep.items():
        xs = [p[0] for p in pts]
        a.plot(xs, [p[1]["tpot_ms"]["p50"] for p in pts], "-o", ms=3, label=name, color=_color(name))
        a.plot(xs, [p[1]["tpot_ms"]["p99"] for p in pts], "--", lw=0.8, color=_color(name))
        b.plot(xs, [p[1]["unique_experts_per_layer_step"] for p in pts], "-o", ms=3, label=name, color=_color(name))
    a.set_xlabel(xlabel)
    a.set_ylabel("TPOT ms (solid p50, dashed p99)")
    b.set_xlabel(xlabel)
    b.set_ylabel("distinct experts / MoE layer / step")
    # one legend below both panels, so it covers no curve
    handles, labels = a.get_legend_handles_labels()
    rows = (len(labels) + 4) // 5
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=7, frameon=False)
    _save(plt, fig, path, title, rect=(0, 0.05 + 0.05 * rows, 1, 1))
