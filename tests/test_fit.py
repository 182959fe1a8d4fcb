"""Offline fit: signatures, layers, IDF, fit quality on the real trace, centroid round trip,
the `eldr fit` / `eldr inspect` commands and their errors on bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

core = pytest.importorskip("eldr_sglang._core", reason="the Rust extension is not built")

from eldr_sglang.cli import main  # noqa: E402
from eldr_sglang.offline.fit import fit_trace  # noqa: E402
from eldr_sglang.offline.layers import PairScorer, parse_layers, sample_pairs  # noqa: E402
from eldr_sglang.offline.signatures import (  # noqa: E402
    compute_idf,
    compute_signatures,
    document_frequency,
    make_spec,
    raw_signatures,
)
from eldr_sglang.traces import Trace, save_trace  # noqa: E402


def toy_trace(n_req=60, L=6, E=16, k=2, domains=3, seed=0, prefill=(5, 20), decode=(3, 12)) -> Trace:
    """Requests of `domains` kinds; each kind prefers its own experts at every layer."""
    rng = np.random.default_rng(seed)
    pref = rng.dirichlet(np.full(E, 0.3), size=(domains, L))  # [D, L, E]
    ids, offs, pls, dom = [], [0], [], []
    for r in range(n_req):
        d = r % domains
        p, q = int(rng.integers(*prefill)), int(rng.integers(*decode))
        T = p + q
        tok = np.empty((T, L, k), dtype=np.int16)
        for l in range(L):
            for t in range(T):
                tok[t, l] = rng.choice(E, size=k, replace=False, p=pref[d, l])
        ids.append(tok)
        offs.append(offs[-1] + T)
        pls.append(p)
        dom.append(f"d{d}")
    return Trace(
        expert_ids=np.concatenate(ids),
        req_offsets=np.array(offs, dtype=np.int64),
        prefill_len=np.array(pls, dtype=np.int32),
        meta={"model": "toy", "num_layers": L, "num_experts": E, "top_k": k},
        domain=np.array(dom),
    )


@pytest.fixture(scope="module")
def toy():
    return toy_trace()


# --- signatures ------------------------------------------------------------------------


def test_streaming_is_chunk_independent_and_matches_single_requests(toy):
    L, E = toy.num_layers, toy.num_experts
    rng = np.random.default_rng(1)
    spec = make_spec(parse_layers("middle", L), rng.random((L, E)).astype(np.float32) + 0.5)
    big, v1 = compute_signatures(toy, spec, chunk_tokens=1 << 20)
    small, v2 = compute_signatures(toy, spec, chunk_tokens=7)  # forces many chunks, some of one request
    assert sp.issparse(big) and big.shape == (toy.num_requests, spec.dim)
    assert np.array_equal(v1, v2) and v1.all()
    assert np.array_equal(big.toarray(), small.toarray())
    for r in (0, 17, toy.num_requests - 1):
        one = spec.from_topk(np.ascontiguousarray(toy.prefill_ids(r)))
        np.testing.assert_allclose(big[r].toarray().ravel(), one, rtol=1e-6, atol=1e-7)
    sub = np.array([5, 2, 40])
    s_sub, _ = compute_signatures(toy, spec, sub, chunk_tokens=9)
    np.testing.assert_array_equal(s_sub.toarray(), big[sub].toarray())


def test_request_without_prefill_is_invalid(toy):
    t = toy.subset(np.arange(10))
    t.prefill_len = t.prefill_len.copy()
    t.prefill_len[3] = 0
    raw, valid = raw_signatures(t)
    assert not valid[3] and valid.sum() == 9
    assert raw[3].nnz == 0


def test_idf_follows_the_formula(toy):
    raw, valid = raw_signatures(toy)
    df = document_frequency(raw, toy.num_layers, toy.num_experts)
    brute = np.zeros_like(df)
    for r in range(toy.num_requests):
        ids = toy.prefill_ids(r)
        for l in range(toy.num_layers):
            brute[l, np.unique(ids[:, l])] += 1
    assert np.array_equal(df, brute)
    n = toy.num_requests
    np.testing.assert_allclose(compute_idf(df, n, plus_one=False), np.log((n + 1) / (brute + 1)), rtol=1e-6)
    np.testing.assert_allclose(compute_idf(df, n), np.log((n + 1) / (brute + 1)) + 1, rtol=1e-6)


def test_pair_scorer_reweighting_equals_rust_signatures(toy):
    """Layer selection scores weightings by rescaling raw rows; that must agree with the
    signatures the Rust normalizer computes for the same weights."""
    raw, _ = raw_signatures(toy)
    df = document_frequency(raw, toy.num_layers, toy.num_experts)
    idf = compute_idf(df, toy.num_requests)
    a, b = sample_pairs(toy.num_requests, 200, np.random.default_rng(0))
    scorer = PairScorer(raw, idf.astype(np.float64), a, b, np.zeros(len(a)))
    w = np.array([0, 0.5, 1, 2, 0, 1], dtype=np.float32)
    S, _ = compute_signatures(toy, make_spec(w, idf))
    cos = np.asarray(S[a].multiply(S[b]).sum(axis=1)).ravel()
    np.testing.assert_allclose(scorer.distances(w), 1 - cos, atol=1e-5)


def test_parse_layers():
    assert parse_layers("middle", 24).nonzero()[0].tolist() == list(range(6, 18))
    assert parse_layers("all", 4).tolist() == [1, 1, 1, 1]
    assert parse_layers("1-2,5", 6).tolist() == [0, 1, 1, 0, 0, 1]
    assert parse_layers("0:0.5,3", 4).tolist() == [0.5, 0, 0, 1]
    for bad, msg in [("9", "out of range"), ("3-1", "backwards"), ("x", "cannot read"), ("0:0", "no layer")]:
        with pytest.raises(ValueError, match=msg):
            parse_layers(bad, 6)
    with pytest.raises(ValueError, match="NaN"):
        parse_layers(np.array([np.nan, 1.0]), 2)


# --- fit -------------------------------------------------------------------------------


def test_fit_is_balanced_deterministic_and_covers_requests(toy):
    r1 = fit_trace(toy, workers=4, seed=3)
    r2 = fit_trace(toy, workers=4, seed=3)
    assert np.array_equal(r1.centroids, r2.centroids)
    assert np.array_equal(r1.assignment, r2.assignment)
    assert sorted(np.bincount(r1.assignment).tolist()) == [15, 15, 15, 15]
    assert r1.report["balanced"] and r1.report["kmeans"]["optimal_assignment"]
    assert r1.centroids.shape == (4, r1.report["dim"]) and r1.centroids.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(r1.centroids, axis=1), 1, atol=1e-5)
    sub = fit_trace(toy, workers=3, requests=np.arange(0, 60, 2), seed=3)
    assert len(sub.assignment) == 30 and np.array_equal(sub.requests, np.arange(0, 60, 2))
    assert np.bincount(sub.assignment).tolist() == [10, 10, 10]


def test_fit_stopping_share_is_passed_on_and_recorded(toy):
    """change_tol reaches the K-means (a share of 1 stops every run after its first step,
    0 and rtol 0 only when nothing moves) and the provenance records it; the assignment
    stays exactly balanced and certified either way."""
    from eldr_sglang.defaults import FIT_CHANGE_TOL, FIT_SAMPLE_GROWTH

    one = fit_trace(toy, workers=4, seed=3, change_tol=1.0)
    assert one.report["kmeans"]["iterations"] == 1 and one.provenance["params"]["change_tol"] == 1.0
    assert one.report["kmeans"]["optimal_assignment"] and sorted(np.bincount(one.assignment).tolist()) == [15] * 4
    still = fit_trace(toy, workers=4, seed=3, change_tol=0.0, rtol=0.0)
    assert still.report["kmeans"]["iterations"] > 1 and still.report["objective"] <= one.report["objective"] + 1e-9
    params = fit_trace(toy, workers=4, seed=3).provenance["params"]
    assert params["change_tol"] == FIT_CHANGE_TOL and params["sample_growth"] == FIT_SAMPLE_GROWTH


def test_fit_report_fields(toy):
    rep = fit_trace(toy, workers=3, layers="auto", seed=0).report
    for key in ("cluster_sizes", "objective", "cosine", "signature_rho", "decode_locality", "domain_purity", "baseline"):
        assert key in rep, key
    assert rep["cosine"]["mean_intra_cluster_cosine"] > rep["cosine"]["mean_inter_cluster_cosine"]
    assert -1 <= rep["signature_rho"]["spearman_rho"] <= 1 and rep["signature_rho"]["n_pairs"] > 0
    auto = rep["layers"]["auto"]
    assert auto["order"] and -1 <= auto["heldout_rho"] <= 1
    # the toy domains are separable: clusters recover them
    assert rep["domain_purity"]["purity"] > rep["domain_purity"]["random_partition_purity_max"]


def test_centroid_file_round_trip(toy, tmp_path):
    res = fit_trace(toy, workers=4, tau=0.2, layers="1-4", seed=1, worker_names=["a", "b", "c", "d"])
    path = tmp_path / "c.eldr"
    res.write(path)
    cs = core.CentroidSet.open(str(path))
    assert cs.num_workers == 4 and cs.num_layers == toy.num_layers and cs.num_experts == toy.num_experts
    assert cs.worker_names == ["a", "b", "c", "d"]
    assert cs.tau == pytest.approx(0.2)
    np.testing.assert_allclose(cs.centroids(), res.centroids, atol=1e-6)
    np.testing.assert_array_equal(cs.layer_weights(), res.layer_weights)
    np.testing.assert_array_equal(cs.idf(), res.idf)
    prov = json.loads(cs.provenance_json)
    assert len(prov["trace_sha256"]) == 64
    assert prov["params"]["workers"] == 4 and prov["params"]["seed"] == 1
    assert prov["fit"]["cluster_sizes"] == res.report["cluster_sizes"]
    assert prov["baseline"]["mean_d_star"] == pytest.approx(res.report["baseline"]["mean_d_star"])
    # the router's spec from the file reproduces the fit's signatures
    S, _ = compute_signatures(toy, cs.spec())
    S0, _ = compute_signatures(toy, make_spec(res.layer_weights, res.idf))
    np.testing.assert_array_equal(S.toarray(), S0.toarray())


def test_real_trace_k4_domain_purity_beats_random(gptoss_trace):
    res = fit_trace(gptoss_trace, workers=4, seed=0)
    rep = res.report
    dp = rep["domain_purity"]
    print(
        f"\ngptoss20b K=4 middle: purity {dp['purity']:.4f} vs random partition "
        f"{dp['random_partition_purity_mean']:.4f} ± {dp['random_partition_purity_std']:.4f} "
        f"(max {dp['random_partition_purity_max']:.4f}); rho {rep['signature_rho']['spearman_rho']:.4f}"
    )
    assert rep["balanced"]
    assert max(rep["cluster_sizes"]) - min(rep["cluster_sizes"]) <= 1
    # "clearly above": beyond every one of the random draws and by 10 standard deviations
    assert dp["purity"] > dp["random_partition_purity_max"]
    assert dp["purity"] > dp["random_partition_purity_mean"] + 10 * dp["random_partition_purity_std"]
    # clustered decode batches touch fewer experts than random ones
    rows = rep["decode_locality"]["batch_sizes"]
    assert rows and all(r["cluster_distinct_per_layer"] < r["random_distinct_per_layer"] for r in rows)


# --- CLI -------------------------------------------------------------------------------


def test_cli_fit_and_inspect(toy, tmp_path, capsys):
    tr = tmp_path / "t.npz"
    save_trace(toy, tr)
    out, js = tmp_path / "c.eldr", tmp_path / "r.json"
    rc = main(["fit", str(tr), "--workers", "3", "--out", str(out), "--json", str(js), "--quiet", "--layers", "all"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "cluster_sizes: [20, 20, 20]" in text and "domain purity" in text
    rep = json.loads(js.read_text())
    assert rep["cluster_sizes"] == [20, 20, 20] and rep["layers"]["selected"] == list(range(6))
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "workers K=3" in text and "decode-2" in text
    assert main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_workers"] == 3 and summary["provenance"]["trace_file_sha256"]


def _write_raw_npz(path, ids, offsets, prefill, meta):
    np.savez(
        path,
        expert_ids=ids,
        req_offsets=np.asarray(offsets, dtype=np.int64),
        prefill_len=np.asarray(prefill, dtype=np.int32),
        meta_json=np.array(json.dumps({"format": "eldr-trace", "version": 1, **meta})),
    )


BAD_META = {"model": "toy", "num_layers": 2, "num_experts": 4, "top_k": 1}


@pytest.mark.parametrize(
    "case, args, message",
    [
        ("empty", [], "empty trace"),
        ("k_gt_n", ["--workers", "9"], "K > N"),
        ("layers", [], "layer mismatch"),
        ("topk", [], "top-k mismatch"),
        ("experts", [], "out of range"),
        ("nan", [], "integers"),
        ("layer_list", ["--layers", "5"], "out of range"),
    ],
)
def test_cli_bad_inputs_write_nothing(tmp_path, capsys, case, args, message):
    ids = np.zeros((6, 2, 1), dtype=np.int16)
    ids[:, 1, 0] = [0, 1, 2, 3, 0, 1]
    offsets, prefill, meta = [0, 2, 4, 6], [1, 1, 1], dict(BAD_META)
    if case == "empty":
        ids, offsets, prefill = ids[:0], [0], []
    elif case == "layers":
        meta["num_layers"] = 3
    elif case == "topk":
        meta["top_k"] = 2
    elif case == "experts":
        ids[4, 0, 0] = 4
    elif case == "nan":
        ids = ids.astype(np.float32)
        ids[0, 0, 0] = np.nan
    tr = tmp_path / "bad.npz"
    _write_raw_npz(tr, ids, offsets, prefill, meta)
    out, js = tmp_path / "c.eldr", tmp_path / "r.json"
    argv = ["fit", str(tr), "--workers", "2", "--out", str(out), "--json", str(js), "--quiet", *args]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1
    assert message in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz"]


def test_cli_missing_files(tmp_path, capsys):
    assert main(["fit", str(tmp_path / "nope.npz"), "--workers", "2", "--out", str(tmp_path / "c.eldr")]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nope.eldr")]) == 1
    err = capsys.readouterr().err
    assert "nope.eldr" in err and "Traceback" not in err
    assert main(["fit", str(tmp_path / "x.npz"), "--workers", "2", "--out", str(tmp_path / "no/dir/c.eldr")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_progress_leaves_no_stray_step_line(toy, capsys):
    """The steps' names (layer selection, scoring) are a status line the next step replaces
    and the end clears, not lines left in the output (`eldr fit: scoring` was)."""
    fit_trace(toy, workers=4, seed=3, layers="auto", progress=True)
    err = capsys.readouterr().err
    assert "eldr fit: scoring" not in err and "eldr fit: selecting layers" not in err, err
