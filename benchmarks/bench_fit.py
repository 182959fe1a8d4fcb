"""Benchmark of the offline fit: exact balanced assignment and balanced spherical K-means.

    python benchmarks/bench_fit.py                      # all cases (the 1M case takes minutes)
    python benchmarks/bench_fit.py --cases hungarian,deepseek --json out.json

Cases:
  hungarian  our exact solver vs scipy linear_sum_assignment on replicated centroid columns
             (the paper's step), N <= 2000 where Hungarian still fits: time and objective gap.
  deepseek   N=100k requests, K=8, DeepSeek-V3 shape (58 MoE layers x 256 experts, top-8),
             default middle band (29 layers, D=7424), sparse CSR signatures: whole fit.
  gptoss     N=1M requests, K=64, GPT-OSS-20B shape (24 x 32, top-4), middle band (D=384).
  Each K-means case is also run as plain (unbalanced) spherical K-means from the same
  seeding, to show the balance it loses (cluster size max/min) and the objective it gains.

Signatures are generated here, not read from a trace: per-request prefill expert counts of
a domain-skewed workload (domains with Dirichlet per-layer expert preferences plus shared
generalists, lognormal prompt lengths), weighted by a smoothed IDF and L2-normalised. This
is the matrix `eldr fit` clusters; the timings cover what `eldr fit` does after the
streaming signature pass (k-means++ restarts, balanced Lloyd iterations, the exact
assignments), not trace I/O. The signature pass is timed separately (`signatures` case)
when the Rust extension is built.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import scipy.sparse as sp

from eldr_sglang.offline.balanced_assignment import balanced_assign, hungarian_balanced
from eldr_sglang.offline.balanced_kmeans import spherical_kmeans

SHAPES = {
    # name: (moe layers, experts, top_k)
    "deepseek-v3": (58, 256, 8),
    "gpt-oss-20b": (24, 32, 4),
}


def middle(L: int) -> np.ndarray:
    lo = L // 4
    return np.arange(lo, L - lo)


def make_signatures(n, shape, *, domains=16, median_prompt=32, seed=0, chunk=20000, dense=False):
    """Domain-skewed prefill-count signatures on the middle band, CSR [n, |band|*E] float32."""
    L, E, k = SHAPES[shape]
    layers = middle(L)
    rng = np.random.default_rng(seed)
    n_gen = max(1, E // 16)
    prefs = rng.dirichlet(np.full(E, 0.08), size=(domains, len(layers)))  # specialists
    gen = np.zeros(E)
    gen[rng.choice(E, n_gen, replace=False)] = 1.0 / n_gen
    prefs = 0.75 * prefs + 0.25 * gen  # generalists everyone uses
    dom_p = rng.dirichlet(np.full(domains, 2.0))
    blocks = []
    df = np.zeros(len(layers) * E)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        dom = rng.choice(domains, size=m, p=dom_p)
        plen = np.clip(rng.lognormal(np.log(median_prompt), 0.8, size=m), 2, 4096).astype(np.int64)
        cols = []
        for j in range(len(layers)):
            # k picks per token, as independent draws from the domain's layer preference
            cols.append(rng.multinomial(plen * k, prefs[dom, j]).astype(np.float32))
        C = np.concatenate(cols, axis=1)
        blocks.append(sp.csr_matrix(C))
        df += (C > 0).sum(axis=0)
    S = sp.vstack(blocks, format="csr")
    idf = (np.log((n + 1) / (df + 1)) + 1).astype(np.float32)
    S = sp.csr_matrix(S.multiply(idf[None, :]), dtype=np.float32)
    norms = np.sqrt(np.asarray(S.multiply(S).sum(axis=1)).ravel())
    S = sp.csr_matrix(sp.diags((1 / norms).astype(np.float32)) @ S, dtype=np.float32)
    density = S.nnz / (S.shape[0] * S.shape[1])
    if dense:
        S = S.toarray()
    return S, density


def sizes_str(a, K):
    s = np.bincount(a, minlength=K)
    return int(s.min()), int(s.max())


def bench_hungarian(rows):
    rng = np.random.default_rng(0)
    for n, K in [(500, 8), (1000, 8), (2000, 8), (2000, 64), (1999, 7)]:
        X, _ = make_signatures(n, "gpt-oss-20b", seed=n + K, dense=True)
        M = X[rng.choice(n, K, replace=False)]
        C = -(X.astype(np.float64) @ M.T.astype(np.float64))
        t = time.perf_counter()
        a, _, info = balanced_assign(C)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        _, h_obj = hungarian_balanced(C)
        t_h = time.perf_counter() - t
        rel = abs(info.objective - h_obj) / abs(h_obj)
        lo, hi = sizes_str(a, K)
        rows.append(
            {
                "case": "hungarian",
                "N": n,
                "K": K,
                "ours_s": t_ours,
                "hungarian_s": t_h,
                "objective_ours": info.objective,
                "objective_hungarian": h_obj,
                "rel_gap": rel,
                "sizes_min_max": [lo, hi],
                "certified_optimal": info.optimal,
            }
        )
        print(
            f"  hungarian N={n:5d} K={K:3d}: ours {t_ours * 1e3:8.1f} ms  hungarian {t_h * 1e3:9.1f} ms  "
            f"objective gap {rel:.1e}  sizes {lo}..{hi}  certified {info.optimal}",
            flush=True,
        )


def bench_kmeans(rows, case, n, K, shape, n_init, plain=True, cache=None):
    t = time.perf_counter()
    path = os.path.join(cache, f"sig_{shape}_{n}.npz") if cache else None
    if path and os.path.exists(path):
        X = sp.load_npz(path).tocsr()
        density = X.nnz / (X.shape[0] * X.shape[1])
    else:
        X, density = make_signatures(n, shape, seed=1)
        if path:
            sp.save_npz(path, X, compressed=False)
    t_gen = time.perf_counter() - t
    L, E, _ = SHAPES[shape]
    dense_note = "sparse CSR"
    if density >= 0.25 and X.shape[0] * X.shape[1] * 4 <= 4 << 30:  # as eldr fit does
        X = X.toarray()
        dense_note = "dense (as eldr fit densifies at >= 25%)"
    print(
        f"  {case}: N={n} K={K} {shape} middle band D={X.shape[1]} density {density:.3f} ({dense_note}); "
        f"generated in {t_gen:.1f} s",
        flush=True,
    )
    t = time.perf_counter()
    res = spherical_kmeans(X, K, seed=0, n_init=n_init, balanced=True)
    t_bal = time.perf_counter() - t
    lo, hi = sizes_str(res.assignment, K)
    h = [x for x in res.history if x["run"].startswith("final")] or res.history
    row = {
        "case": case,
        "N": n,
        "K": K,
        "shape": shape,
        "D": int(X.shape[1]),
        "density": density,
        "storage": dense_note,
        "n_init": n_init,
        "restarts_on_subsample": res.restarts_on_subsample,
        "balanced_fit_s": t_bal,
        "assign_s": res.assign_seconds,
        "iterations_final": res.iterations,
        "assignments": len(res.history),
        "all_certified_optimal": all(x["optimal"] for x in res.history),
        "cycles_final_mean": float(np.mean([x["cycles"] for x in h])),
        "sweeps_final_mean": float(np.mean([x["sweeps"] for x in h])),
        "balanced_objective": res.objective,
        "balanced_sizes_min_max": [lo, hi],
    }
    print(
        f"    balanced  : {t_bal:7.1f} s total ({res.assign_seconds:.1f} s in exact assignments, "
        f"{len(res.history)} assignments, all certified optimal: {row['all_certified_optimal']}); "
        f"objective {res.objective:.2f}  sizes {lo}..{hi}",
        flush=True,
    )
    if plain:
        t = time.perf_counter()
        pl = spherical_kmeans(X, K, seed=0, n_init=n_init, balanced=False)
        t_pl = time.perf_counter() - t
        plo, phi = sizes_str(pl.assignment, K)
        row.update(
            {
                "plain_fit_s": t_pl,
                "plain_objective": pl.objective,
                "plain_sizes_min_max": [plo, phi],
                "plain_max_over_mean": phi / (n / K),
            }
        )
        print(
            f"    plain     : {t_pl:7.1f} s total; objective {pl.objective:.2f} "
            f"({100 * (pl.objective / res.objective - 1):+.2f}% vs balanced)  sizes {plo}..{phi} "
            f"(largest cluster {phi / (n / K):.2f}x the balanced size)",
            flush=True,
        )
    rows.append(row)


def bench_signatures(rows):
    try:
        from eldr_sglang.offline.signatures import compute_signatures, make_spec
        from eldr_sglang.traces import Trace
    except ImportError as exc:  # pragma: no cover
        print(f"  signatures: skipped ({exc})")
        return
    try:
        import eldr_sglang._core  # noqa: F401
    except ImportError:
        print("  signatures: skipped (Rust extension not built)")
        return
    L, E, k = SHAPES["deepseek-v3"]
    rng = np.random.default_rng(0)
    R = 2000
    plen = np.clip(rng.lognormal(np.log(256), 0.8, size=R), 8, 4096).astype(np.int64)
    T = int(plen.sum())
    ids = rng.integers(0, E, size=(T, L, k), dtype=np.int16)  # values only matter for counts
    off = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(plen, out=off[1:])
    tr = Trace(ids, off, plen.astype(np.int32), {"model": "bench", "num_layers": L, "num_experts": E, "top_k": k})
    w = np.zeros(L, dtype=np.float32)
    w[middle(L)] = 1
    spec = make_spec(w, np.ones((L, E), dtype=np.float32))
    t = time.perf_counter()
    S, valid = compute_signatures(tr, spec)
    dt = time.perf_counter() - t
    rows.append({"case": "signatures", "requests": R, "tokens": T, "seconds": dt, "tokens_per_s": T / dt})
    print(
        f"  signatures: {R} requests, {T} prefill tokens, DeepSeek-V3 shape, streamed in chunks: "
        f"{dt:.2f} s ({T / dt / 1e6:.2f} M tokens/s)",
        flush=True,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="hungarian,signatures,deepseek,gptoss")
    ap.add_argument("--restarts", type=int, default=4, help="k-means++ restarts (eldr fit default: 4)")
    ap.add_argument("--deepseek-n", type=int, default=100_000)
    ap.add_argument("--gptoss-n", type=int, default=1_000_000)
    ap.add_argument("--no-plain", action="store_true", help="skip the plain K-means comparison")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--cache", help="directory to keep generated signature matrices in between runs")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    print(f"bench_fit on {platform.machine()} with {os.cpu_count()} CPUs, numpy {np.__version__}", flush=True)
    rows: list[dict] = []
    for c in cases:
        if c == "hungarian":
            bench_hungarian(rows)
        elif c == "signatures":
            bench_signatures(rows)
        elif c == "deepseek":
            bench_kmeans(rows, "deepseek", args.deepseek_n, 8, "deepseek-v3", args.restarts, not args.no_plain, args.cache)
        elif c == "gptoss":
            bench_kmeans(rows, "gptoss", args.gptoss_n, 64, "gpt-oss-20b", args.restarts, not args.no_plain, args.cache)
        else:
            ap.error(f"unknown case {c!r}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpus": os.cpu_count(), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
