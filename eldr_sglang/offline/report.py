"""Quality report of a fit: balance, objective, cosines, Spearman rho, decode locality, purity.

Domain labels are read here, and only here, to score a fit that never saw them.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from eldr_sglang._core import band_sizes
from eldr_sglang.offline.layers import overlap_distance, sample_pairs, spearman
from eldr_sglang.traces import Trace


_BLOCK_ROWS = 4096


def cosine_stats(S, assign: np.ndarray, centroids: np.ndarray) -> dict:
    """Exact mean pairwise cosine within and across clusters (from cluster sums), and the
    mean cosine of a point to its own centroid."""
    K = centroids.shape[0]
    N = S.shape[0]
    sums = np.zeros((K, S.shape[1]), dtype=np.float64)
    sq = np.empty(N, dtype=np.float64)
    own = np.empty(N, dtype=np.float64)
    # in row blocks: a float64 copy of a dense S (or centroids[assign]) would be N x D
    for a in range(0, N, _BLOCK_ROWS):
        b = min(N, a + _BLOCK_ROWS)
        blk, asg = S[a:b], assign[a:b]
        blk64 = blk.astype(np.float64)  # a block: the sums below are float64 throughout
        onehot = sp.csr_matrix((np.ones(b - a), (asg, np.arange(b - a))), shape=(K, b - a))
        part = onehot @ blk64
        sums += part.toarray() if sp.issparse(part) else part
        if sp.issparse(blk):
            sq[a:b] = np.asarray(blk64.multiply(blk64).sum(axis=1)).ravel()
        else:
            sq[a:b] = np.einsum("ij,ij->i", blk64, blk64)
        own[a:b] = np.asarray(blk64 @ centroids.T.astype(np.float64))[np.arange(b - a), asg]
    sizes = np.bincount(assign, minlength=K).astype(np.float64)
    self_k = np.bincount(assign, weights=sq, minlength=K)
    intra_sum = float(((sums**2).sum(axis=1) - self_k).sum())
    intra_pairs = float((sizes * (sizes - 1)).sum())
    tot = sums.sum(axis=0)
    all_sum = float(tot @ tot - sq.sum())
    inter_sum = all_sum - intra_sum
    inter_pairs = float(N * (N - 1)) - intra_pairs
    cc = centroids.astype(np.float64) @ centroids.astype(np.float64).T
    off = cc[~np.eye(K, dtype=bool)] if K > 1 else np.array([np.nan])
    return {
        "mean_intra_cluster_cosine": intra_sum / intra_pairs if intra_pairs else float("nan"),
        "mean_inter_cluster_cosine": inter_sum / inter_pairs if inter_pairs else float("nan"),
        "mean_point_centroid_cosine": float(own.mean()),
        "mean_centroid_centroid_cosine": float(off.mean()),
    }


def baseline_stats(S, centroids: np.ndarray, tau: float) -> dict:
    """Routing statistics of the calibration set, kept in the centroid file's provenance so
    the router can later tell when live traffic has drifted away from the fit."""
    K = centroids.shape[0]
    dots = np.asarray(S @ centroids.T, dtype=np.float64)
    d = 1.0 - dots
    dstar = d.min(axis=1)
    nearest = d.argmin(axis=1)
    band = band_sizes(d, float(tau))  # the router's own band bound (Rust), every worker eligible
    return {
        "n": int(S.shape[0]),
        "mean_d_star": float(dstar.mean()),
        "std_d_star": float(dstar.std()),
        "p50_d_star": float(np.percentile(dstar, 50)),
        "p90_d_star": float(np.percentile(dstar, 90)),
        "p99_d_star": float(np.percentile(dstar, 99)),
        "nearest_share": (np.bincount(nearest, minlength=K) / len(nearest)).round(6).tolist(),
        "mean_band_size": float(band.mean()),
    }


def signature_rho(S, profiles: np.ndarray, rng: np.random.Generator, n_pairs: int = 20000) -> dict:
    """Spearman rho between signature distance (1 - cos) and decode expert-overlap distance."""
    n = S.shape[0]
    if n < 3:
        return {"spearman_rho": float("nan"), "n_pairs": 0}
    a, b = sample_pairs(n, n_pairs, rng)
    if sp.issparse(S):
        cos = np.asarray(S[a].multiply(S[b]).sum(axis=1)).ravel()
    else:
        cos = (S[a] * S[b]).sum(axis=1)
    rho = spearman(1.0 - cos, overlap_distance(profiles, a, b))
    return {"spearman_rho": rho, "n_pairs": int(len(a))}


def _distinct_per_step(steps: np.ndarray, num_experts: int) -> np.ndarray:
    """steps [S, B, L, k] ids -> distinct experts per layer per step [S, L]."""
    S_, B, L, k = steps.shape
    key = (np.arange(S_)[:, None, None, None] * L + np.arange(L)[None, None, :, None]) * num_experts + steps
    used = np.zeros(S_ * L * num_experts, dtype=bool)  # a presence table: no sort
    used[key.ravel()] = True
    return used.reshape(S_, L, num_experts).sum(axis=2)


def decode_locality(
    trace: Trace,
    requests: np.ndarray,
    assign: np.ndarray,
    rng: np.random.Generator,
    batch_sizes=(4, 16, 64),
    steps: int = 256,
) -> dict:
    """Expected distinct experts per MoE layer in one decode step of a batch of B requests
    drawn from one cluster, against B requests drawn at random from all of them.

    Each request in a step contributes one of its decode tokens, drawn at random (decode
    tokens are what the decode worker runs). Lower is better: fewer expert weights read."""
    K = int(assign.max()) + 1
    off = trace.req_offsets
    pl = trace.prefill_len.astype(np.int64)
    dlen = off[requests + 1] - off[requests] - pl[requests]
    ok = dlen > 0
    req, asg, dlen = requests[ok], assign[ok], dlen[ok]
    out: dict = {"batch_sizes": [], "requests_with_decode": int(len(req))}
    if len(req) == 0:
        return out
    E = trace.num_experts
    members = [np.flatnonzero(asg == c) for c in range(K)]
    rows_all = []
    for B in batch_sizes:
        if min(len(m) for m in members) < B:
            continue
        per_cluster = max(1, steps // K)
        cl = np.repeat(np.arange(K), per_cluster)
        pick = np.stack([rng.choice(members[c], size=B, replace=False) for c in cl])  # [S, B]
        rnd = np.stack([rng.choice(len(req), size=B, replace=False) for _ in range(len(cl))])

        def ids_of(p):
            tok = (rng.random(p.shape) * dlen[p]).astype(np.int64)
            rows = off[req[p]] + pl[req[p]] + tok
            return trace.expert_ids[rows].astype(np.int64)  # [S, B, L, k]

        dc = _distinct_per_step(ids_of(pick), E).mean(axis=1)  # mean over layers, per step
        dr = _distinct_per_step(ids_of(rnd), E).mean(axis=1)
        rows_all.append(
            {
                "batch_size": int(B),
                "cluster_distinct_per_layer": float(dc.mean()),
                "random_distinct_per_layer": float(dr.mean()),
                "reduction": float(1.0 - dc.mean() / dr.mean()) if dr.mean() > 0 else float("nan"),
                "steps": int(len(cl)),
            }
        )
    out["batch_sizes"] = rows_all
    return out


def _purity_of_codes(lab: np.ndarray, n_labels: int, assign: np.ndarray, K: int) -> float:
    table = np.bincount(assign.astype(np.int64) * n_labels + lab, minlength=K * n_labels).reshape(K, n_labels)
    return float(table.max(axis=1).sum() / len(assign))


def purity(labels: np.ndarray, assign: np.ndarray) -> float:
    """Share of requests that carry their cluster's most common label."""
    names, lab = np.unique(labels, return_inverse=True)
    return _purity_of_codes(lab, len(names), assign, int(assign.max()) + 1)


def domain_purity(labels: np.ndarray, assign: np.ndarray, rng: np.random.Generator, draws: int = 200) -> dict:
    """Purity of the fit and of random partitions with the same cluster sizes. The labels are
    encoded once (sorting 100k strings 200 times took longer than the whole K-means)."""
    names, lab = np.unique(labels, return_inverse=True)
    K = int(assign.max()) + 1
    p = _purity_of_codes(lab, len(names), assign, K)
    rand = np.array([_purity_of_codes(lab, len(names), rng.permutation(assign), K) for _ in range(draws)])
    return {
        "purity": p,
        "random_partition_purity_mean": float(rand.mean()),
        "random_partition_purity_std": float(rand.std()),
        "random_partition_purity_max": float(rand.max()),
        "random_draws": draws,
        "majority_share": float(np.bincount(lab).max() / len(labels)),
    }


def format_report(rep: dict) -> str:
    """Human-readable report (the JSON form holds everything)."""
    lines = []
    add = lines.append
    add(f"ELDR fit: {rep['model']}  workers K={rep['workers']}  tau={rep['tau']}")
    add(
        f"  requests: {rep['n_requests']} calibration, {rep['n_fitted']} with a usable signature"
        + (f" ({rep['n_without_signature']} without, not clustered)" if rep["n_without_signature"] else "")
    )
    ls = rep["layers"]
    add(f"  layers ({ls['mode']}): {_ranges(ls['selected'])}  -> signature dim {rep['dim']}")
    if ls.get("auto"):
        a = ls["auto"]
        add(
            f"    auto: greedy order {a['order']}; Spearman rho {a['selection_rho']:.4f} on the selection half, "
            f"{a['heldout_rho']:.4f} held-out (middle band {a['middle_heldout_rho']:.4f}, all {a['all_heldout_rho']:.4f})"
        )
    add(f"  cluster_sizes: {rep['cluster_sizes']}  (balanced: {rep['balanced']})")
    km = rep["kmeans"]
    add(
        f"  objective: {rep['objective']:.6f}  (mean {rep['objective'] / max(rep['n_fitted'], 1):.6f} per request; "
        f"{km['iterations']} iterations, restarts {['%.4f' % o for o in km['restart_objectives']]}"
        + (f" on a {km['restarts_on_subsample']}-request subsample" if km.get("restarts_on_subsample") else "")
        + ", "
        f"assignment optimal: {km['optimal_assignment']})"
    )
    c = rep["cosine"]
    add(
        f"  cosine: intra-cluster {c['mean_intra_cluster_cosine']:.4f}  inter-cluster {c['mean_inter_cluster_cosine']:.4f}  "
        f"point-centroid {c['mean_point_centroid_cosine']:.4f}  centroid-centroid {c['mean_centroid_centroid_cosine']:.4f}"
    )
    r = rep["signature_rho"]
    if r.get("n_pairs"):
        add(f"  Spearman rho (signature distance vs decode expert-overlap distance): {r['spearman_rho']:.4f} over {r['n_pairs']} pairs")
    else:
        add("  Spearman rho: not computed (no decode tokens)")
    dl = rep["decode_locality"]
    for row in dl.get("batch_sizes", []):
        red = row["reduction"]
        add(
            f"  distinct experts/layer per decode step, batch {row['batch_size']:>3}: cluster "
            f"{row['cluster_distinct_per_layer']:.2f} vs random {row['random_distinct_per_layer']:.2f} "
            f"({abs(100 * red):.1f}% {'fewer' if red >= 0 else 'more'} with the clusters)"
        )
    if rep.get("domain_purity"):
        d = rep["domain_purity"]
        add(
            f"  domain purity: {d['purity']:.4f} vs random partition {d['random_partition_purity_mean']:.4f} "
            f"± {d['random_partition_purity_std']:.4f} (max of {d['random_draws']}: {d['random_partition_purity_max']:.4f}); "
            f"labels used only to score"
        )
    b = rep["baseline"]
    add(
        f"  baseline for drift: mean d* {b['mean_d_star']:.4f} (p90 {b['p90_d_star']:.4f}), mean band size "
        f"{b['mean_band_size']:.2f}, nearest-centroid shares {[round(x, 3) for x in b['nearest_share']]}"
    )
    sec = rep["seconds"]
    add(
        f"  time: {sec['total']:.1f} s (signatures {sec['signatures']:.1f}, layer selection {sec['layer_selection']:.1f}, "
        f"k-means {sec['kmeans']:.1f})"
    )
    return "\n".join(lines)


def _ranges(layers: list[int]) -> str:
    if not layers:
        return "-"
    out, start, prev = [], layers[0], layers[0]
    for x in layers[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if x is not None:
            start = prev = x
    return ",".join(out)
