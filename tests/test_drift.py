"""Drift detection, the signature reservoir, centroid remapping and online refits.

Every random stream is seeded; the statistical claims and their tolerances are stated where
they are asserted."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from scipy import stats

from eldr_sglang import _core
from eldr_sglang.drift import (
    DriftMonitor,
    RefitController,
    RefitError,
    SignatureReservoir,
    baseline_from_provenance,
    js_divergence,
    refit_file,
    remap_to_workers,
)

K = 8
BASE = {"mean_d_star": 0.12, "std_d_star": 0.05, "nearest_share": [1 / K] * K}


def _stream(rng, n, mean, std, shares):
    d = np.clip(rng.normal(mean, std, n), 0.0, 2.0)
    k = rng.choice(len(shares), size=n, p=np.asarray(shares) / np.sum(shares))
    return d, k


# ---------------------------------------------------------------------------------- monitor
def test_monitor_false_positive_rate_on_stationary_stream():
    """400 windows of 256 requests drawn from the baseline distribution itself. The window
    mean's s.d. is 1/sqrt(256) = 0.0625 baseline s.d., so d_shift never nears 1; the JS of a
    256-draw share vector against the truth is ~0.007 (measured max below 0.03), far below
    0.1. Measured: 0 of 400 windows out of profile. We assert <= 1% and never drift."""
    rng = np.random.default_rng(1)
    m = DriftMonitor(BASE, window=256)
    d, k = _stream(rng, 400 * 256, BASE["mean_d_star"], BASE["std_d_star"], BASE["nearest_share"])
    for x, y in zip(d, k):
        m.observe(float(x), int(y))
        assert not m.drifted()[0]
    assert m.windows_closed == 400
    assert m.windows_out / 400 <= 0.01, f"{m.windows_out} of 400 stationary windows out of profile"
    assert max(abs(x["d_shift"]) for x in m.windows()) < 0.5
    assert max(x["js"] for x in m.windows()) < 0.05


@pytest.mark.parametrize("kind", ["distance", "shares"])
def test_monitor_fires_on_shifted_stream(kind):
    rng = np.random.default_rng(2)
    m = DriftMonitor(BASE, window=256, patience=2)
    d, k = _stream(rng, 1024, BASE["mean_d_star"], BASE["std_d_star"], BASE["nearest_share"])
    if kind == "distance":  # traffic 1.5 s.d. farther from every centroid, same shares
        d2, k2 = _stream(rng, 4 * 256, BASE["mean_d_star"] + 1.5 * BASE["std_d_star"], BASE["std_d_star"], BASE["nearest_share"])
    else:  # same distances, traffic on half of the centroids
        d2, k2 = _stream(rng, 4 * 256, BASE["mean_d_star"], BASE["std_d_star"], [2, 2, 2, 2, 0.1, 0.1, 0.1, 0.1])
    for x, y in zip(d, k):
        m.observe(float(x), int(y))
    assert not m.drifted()[0]
    fired_at = None
    for i, (x, y) in enumerate(zip(d2, k2)):
        m.observe(float(x), int(y))
        if fired_at is None and m.drifted()[0]:
            fired_at = i + 1
    assert fired_at == 2 * 256, "drift must be reported exactly when the second shifted window closes"
    ok, why = m.drifted()
    assert ok and ("s.d." in why if kind == "distance" else "JS" in why)
    assert m.drift_since == 1024  # the first out-of-profile window began at the shift
    snap = m.snapshot()
    assert snap["drifted"] and snap["observations"] == 2048 and snap["out_of_profile_windows"] == 4


def test_one_bursty_window_is_not_drift():
    rng = np.random.default_rng(3)
    m = DriftMonitor(BASE, window=256, patience=2)
    for shares in ([1] * K, [30, 1, 1, 1, 1, 1, 1, 1], [1] * K, [1, 1, 1, 1, 1, 1, 1, 30], [1] * K):
        d, k = _stream(rng, 256, BASE["mean_d_star"], BASE["std_d_star"], shares)
        for x, y in zip(d, k):
            m.observe(float(x), int(y))
    assert [w["out_of_profile"] for w in m.windows()] == [False, True, False, True, False]
    assert not m.drifted()[0]


def test_monitor_decisions_generation_rebase_and_bad_baselines(tmp_path):
    C = np.eye(K, 16, dtype=np.float32)
    prov = {"baseline": {**BASE, "p90_d_star": 0.2}}
    path = str(tmp_path / "c.eldr")
    _core.write_centroids(path, C, np.ones(2, np.float32), np.ones((2, 8), np.float32), 0.1, None, json.dumps(prov))
    r = _core.Router(policy="eldr", centroids=path, reload_interval_ms=0)
    new_base = {**BASE, "mean_d_star": 0.5}
    m = DriftMonitor.from_centroid_set(r.centroid_set(), window=8, baseline_loader=lambda: {"baseline": new_base})
    sig = C[3]
    for _ in range(3):
        m.observe_decision(r.route_signature(sig, explain=True))
    m.observe_decision(r.route_signature(None, explain=True))
    assert m.observations == 3 and m.no_signature == 1 and m.generation == 1
    _core.write_centroids(path, C[::-1].copy(), np.ones(2, np.float32), np.ones((2, 8), np.float32), 0.1, None, json.dumps(prov))
    r.reload()
    m.observe_decision(r.route_signature(sig, explain=True))
    assert m.generation == 2 and m.rebases == 1 and m.snapshot()["baseline_mean_d_star"] == 0.5
    assert m.snapshot()["window_fill"] == 1  # the window restarted with the new centroids
    # with bounded loads the Decision's d_star is the minimum over eligible workers only;
    # the monitor must measure the distance to the nearest centroid of all
    r.load_factor = 0.0
    k = int(np.argmin(r.route_signature(sig, explain=True).distances))
    with r.acquire(k, 1), r.acquire(k, 1):
        dec = r.route_signature(sig, explain=True)
    assert dec.worker != k and dec.d_star > min(dec.distances)
    before, s0 = m.snapshot()["window_fill"], m._sum
    m.observe_decision(dec)
    assert m.snapshot()["window_fill"] == before + 1
    assert abs((m._sum - s0) - min(dec.distances)) < 1e-9
    with pytest.raises(ValueError, match="no drift baseline"):
        baseline_from_provenance("{}")
    with pytest.raises(ValueError, match="not JSON"):
        baseline_from_provenance("{oops")
    with pytest.raises(ValueError, match="nearest_share"):
        DriftMonitor({"mean_d_star": 0.1, "std_d_star": 0.1, "nearest_share": [0, 0]})
    assert js_divergence([1, 0], [1, 0]) == 0.0
    assert abs(js_divergence([1, 0], [0, 1]) - np.log(2)) < 1e-12


# -------------------------------------------------------------------------------- reservoir
def test_reservoir_inclusion_is_uniform_over_the_horizon():
    """capacity 64 in 8 buckets over a horizon of 512: after a 1000-item stream the horizon
    is items 512..999 (seven full buckets of 64 and one of 40) and each must be in the
    sample with probability 8/64. Over 300 seeded runs we count inclusions in 15 groups of
    ~32 items and apply a chi-square goodness-of-fit test; we require p > 0.001. We also
    require that nothing older than the horizon is ever returned."""
    T, runs = 1000, 300
    counts = np.zeros(T)
    for seed in range(runs):
        r = SignatureReservoir(1, capacity=64, horizon=512, buckets=8, seed=seed)
        for i in range(T):
            r.add([float(i)])
        s = r.sample(seed=seed).ravel().astype(int)
        assert len(s) == r.expected_sample_size() == 7 * 8 + 5  # 40 * 8/64 = 5 from the filling bucket
        assert len(np.unique(s)) == len(s)
        counts[s] += 1
    lo = 512
    assert counts[:lo].sum() == 0, "an item older than the horizon was sampled"
    obs = counts[lo:]
    groups = np.array_split(obs, 15)
    g_obs = np.array([g.sum() for g in groups])
    g_exp = np.array([len(g) * runs * 8 / 64 for g in groups])
    assert abs(g_obs.sum() - g_exp.sum()) < 1e-6  # fixed sample sizes: totals agree exactly
    p = stats.chisquare(g_obs, g_exp).pvalue
    assert p > 1e-3, f"inclusion not uniform over the horizon (chi-square p={p:.2g})"


def test_reservoir_makes_signatures_only_for_the_observations_it_stores():
    """add_lazy calls make_signature only when the draw (the Rust sampler's, the one the data
    plane uses per request) stores the observation: after the first fill most are skipped."""
    r = SignatureReservoir(dim=2, capacity=32, horizon=1024, buckets=4, seed=7)
    made = []
    stored = [r.add_lazy(lambda t=t: made.append(t) or np.array([t, 1.0])) for t in range(2000)]
    assert len(made) == sum(stored)
    # per bucket of 256 offers 8 + sum 8/(n+1), n = 8..255: about 35 (14%), ~270 of 2000
    assert 32 <= len(made) < 2000 // 4
    assert r.stats()["stored"] == 32 and r.stats()["total_seen"] == 2000


def test_reservoir_offers_handed_over_out_of_order_keep_what_stream_order_keeps():
    """The data plane's requests route concurrently, so their draws can reach the reservoir
    out of order; each slot must end with the offer of the highest index, as in stream
    order. A draw given back (a route that fell back) is the next one taken: no index is lost."""
    sampler = _core.ReservoirSampler(4, 16, seed=3)
    draws = [sampler.draw() for _ in range(200)]
    sampler.undo(*draws[-1])
    assert sampler.draw() == draws[-1] and sampler.draw()[0] == 200
    ordered, shuffled = (SignatureReservoir(dim=1, capacity=16, horizon=64, buckets=4) for _ in range(2))
    for i, slot in draws:
        ordered.offer(i, slot, lambda i=i: [float(i)])
    perm = np.arange(200).reshape(-1, 5)[:, ::-1].ravel()  # each run of 5 handed over backwards
    for j in perm:
        i, slot = draws[j]
        shuffled.offer(i, slot, lambda i=i: [float(i)])
    assert shuffled.stats() == ordered.stats()
    np.testing.assert_array_equal(shuffled.sample(seed=0), ordered.sample(seed=0))
    with pytest.raises(ValueError, match="no signature came"):
        ordered.offer(200, 0, lambda: None)


def test_drift_hook_stores_the_routes_own_signature(tmp_path):
    """route_counts(signature=True) hands the unit signature to the reservoir: the hook does
    not compute it again (no counts are given to it here)."""
    from eldr_sglang.router.drift_hook import DriftHook
    from eldr_sglang.sglang_ext.payload import decode_payload, encode_counts

    rng = np.random.default_rng(1)
    L, E = 6, 16
    w = np.ones(L, np.float32)
    idf = np.ones((L, E), np.float32)
    path = tmp_path / "c.eldr"
    prov = json.dumps({"baseline": {**BASE, "p90_d_star": 0.2}})
    _core.write_centroids(str(path), rng.random((K, L * E)).astype(np.float32), w, idf, 1.0, None, prov)
    router = _core.Router("eldr", centroids=str(path), reload_interval_ms=0)

    class PD:  # what DriftHook reads of the router service
        pass

    pd = PD()
    pd.router = router
    pd.cfg = type("Cfg", (), {"centroids": str(path)})()
    hook = DriftHook(pd, executor="inline", reservoir_capacity=64, reservoir_horizon=64)
    for _ in range(40):
        wire = decode_payload(encode_counts(rng.integers(0, 5, (L, E)), list(range(L)), 4))
        d = router.route_counts(wire, explain=True, signature=True)  # as the data plane routes with drift on
        assert d.unit_signature() is not None
        hook.on_route(d)  # no counts: only the decision's own signature can be stored
    assert hook.ctl.reservoir.stats()["stored"] == 40
    np.testing.assert_allclose(np.linalg.norm(hook.ctl.reservoir.sample(), axis=1), 1.0, rtol=1e-5)
    hook.close()
    # a data plane drawing for another shape would file its draws in the wrong slots: refused
    pd.dataplane = type("DP", (), {"reservoir_shape": (1, 64)})()
    with pytest.raises(ValueError, match="data plane draws for a reservoir of shape"):
        DriftHook(pd, executor="inline", reservoir_capacity=64, reservoir_horizon=64)
    pd.dataplane.reservoir_shape = (2, 2)  # 64 over 64 in 32 buckets
    DriftHook(pd, executor="inline", reservoir_capacity=64, reservoir_horizon=64).close()


def test_reservoir_last_and_bad_input():
    r = SignatureReservoir(2, capacity=16, horizon=64, buckets=4, seed=0)
    for i in range(100):
        r.add([i, 1.0])
    recent = r.sample(last=40)[:, 0]
    assert recent.size and recent.min() >= 60  # only buckets within the latest 40 observations
    assert r.stats()["stored"] <= 16 and r.stats()["total_seen"] == 100
    with pytest.raises(ValueError, match="dims"):
        r.add([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="horizon"):
        SignatureReservoir(4, capacity=64, horizon=32)
    with pytest.raises(ValueError, match="span"):  # the Rust draw's bound
        SignatureReservoir(4, capacity=64, horizon=2**31, buckets=2)
    assert SignatureReservoir(3).sample().shape == (0, 3)


def test_the_data_plane_draws_for_the_drift_options_reservoir():
    """plane_config hands the data plane the shape the drift hook's reservoir will have (from
    the same drift options); options that are no reservoir turn the feed off (the hook then
    refuses them with its own message, and routing goes on)."""
    from eldr_sglang.router.config import parse_config
    from eldr_sglang.router.config import plane_config

    argv = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--disagg-router", "eldr", "--eldr-centroids", "c.eldr"]
    cfg = parse_config(argv)
    conf = json.loads(plane_config(cfg, "http://127.0.0.1:3"))
    assert conf["reservoir"] == {"per_bucket": 128, "span": 512} and conf["signature_reservoir"] > 0
    assert (conf["reservoir"]["per_bucket"], conf["reservoir"]["span"]) == SignatureReservoir(2).shape
    cfg.drift = {"reservoir_capacity": 100, "reservoir_horizon": 50}
    conf = json.loads(plane_config(cfg, "http://127.0.0.1:3"))
    assert conf["reservoir"] is None and conf["signature_reservoir"] == 0
    cfg.drift = {"enabled": False}
    assert json.loads(plane_config(cfg, "http://127.0.0.1:3"))["reservoir"] is None


# ---------------------------------------------------------------------------------- remap
def test_remap_identity_and_permutation():
    rng = np.random.default_rng(4)
    C = rng.normal(size=(K, 32))
    C /= np.linalg.norm(C, axis=1, keepdims=True)
    perm, sim = remap_to_workers(C, C)
    assert perm.tolist() == list(range(K)) and np.allclose(sim, 1.0)
    p = rng.permutation(K)
    noisy = C[p] + 0.05 * rng.normal(size=C.shape)  # new cluster j is old worker p[j]'s, perturbed
    perm, sim = remap_to_workers(C, noisy)
    assert (p[perm] == np.arange(K)).all()  # worker k gets back the cluster that was its own
    assert sim.min() > 0.9
    with pytest.raises(RefitError):
        remap_to_workers(C, C[:, :3])  # another dimension


def test_remap_membership_change_keeps_the_old_order_for_matched_workers():
    """Live membership (issue 31): a refit for fewer or more decode workers than the file's K."""
    rng = np.random.default_rng(5)
    C = rng.normal(size=(K, 32))
    C /= np.linalg.norm(C, axis=1, keepdims=True)
    # one worker fewer: old centroid 1 has no new match; the others keep their order
    fewer = C[[3, 0, 2] + list(range(4, K))] + 0.01 * rng.normal(size=(K - 1, 32))
    perm, sim = remap_to_workers(C, fewer)
    assert fewer[perm].shape == (K - 1, 32) and sorted(perm.tolist()) == list(range(K - 1))
    assert np.allclose(fewer[perm], C[[0, 2, 3] + list(range(4, K))], atol=0.1) and sim.size == K - 1
    # one more: the old centroids keep theirs, the new cluster goes last (the new worker)
    fresh = rng.normal(size=(1, 32))
    more = np.vstack([fresh, C[::-1]])
    perm, sim = remap_to_workers(C, more)
    assert perm.tolist() == [K - k for k in range(K)] + [0] and sim.size == K and np.allclose(sim, 1.0)


# ------------------------------------------------------------------------ refit (real fit)
@pytest.fixture(scope="module")
def drift_setup(tmp_path_factory):
    """A small synthetic GPT-OSS-shaped trace: 1000 calibration requests and 1024 requests of
    phase A from domains 0-3, then 1024 of phase B from domains 4-7; fitted on calibration."""
    from eldr_sglang.drift.drifting_workload import drifting_trace
    from eldr_sglang.offline.fit import fit_trace

    tr, cal, ph = drifting_trace([([0, 1, 2, 3], 1024), ([4, 5, 6, 7], 1024)], calibration=1000, seed=0,
                                 prompt_len=(32, 96), output_len=8)
    fit = fit_trace(tr, workers=K, requests=cal, seed=0, n_init=1)
    d = tmp_path_factory.mktemp("drift")
    path = str(d / "c.eldr")
    fit.write(path)
    cs = _core.CentroidSet.open(path)
    S, valid = cs.spec().batch_from_topk(tr.expert_ids, tr.req_offsets.astype(np.int64), tr.prefill_len.astype(np.int64))
    from eldr_sglang.traces import save_trace

    save_trace(tr, str(d / "t.npz"))
    return {"path": path, "S": S, "valid": valid, "phase": ph, "dir": d, "trace": str(d / "t.npz")}


def test_monitor_on_a_real_fit_fires_on_the_new_mix_only(drift_setup):
    cs = _core.CentroidSet.open(drift_setup["path"])
    C = cs.centroids()
    out = {}
    for phase in (0, 1):
        m = DriftMonitor.from_centroid_set(cs)  # defaults: windows of 512, patience 2
        idx = np.flatnonzero((drift_setup["phase"] == phase) & drift_setup["valid"])
        d = 1.0 - drift_setup["S"][idx] @ C.T
        for row in d:
            m.observe(float(row.min()), int(row.argmin()))
        out[phase] = m
    assert not out[0].drifted()[0], out[0].windows()
    assert out[1].drifted()[0]
    assert min(w["d_shift"] for w in out[1].windows()) > max(w["d_shift"] for w in out[0].windows())


def test_refit_file_keeps_spec_records_provenance_and_remaps(drift_setup, tmp_path):
    parent = _core.CentroidSet.open(drift_setup["path"])
    A = drift_setup["S"][(drift_setup["phase"] == 0) & drift_setup["valid"]]
    cal = drift_setup["S"][(drift_setup["phase"] == -1) & drift_setup["valid"]]
    out = str(tmp_path / "refit.eldr")
    summary = refit_file(drift_setup["path"], cal, out, reason="test", seed=0)
    new = _core.CentroidSet.open(out)
    assert np.array_equal(new.layer_weights(), parent.layer_weights()) and np.array_equal(new.idf(), parent.idf())
    assert new.worker_names == parent.worker_names and new.tau == parent.tau
    prov = json.loads(new.provenance_json)
    assert prov["tool"] == "eldr refit" and prov["refit"]["parent_checksum"] == parent.checksum
    assert prov["lineage"][-1]["checksum"] == parent.checksum
    DriftMonitor.from_centroid_set(new)  # the new baseline is usable
    # refit on the fit's own calibration set -> near the fit's centroids (K-means may settle in
    # another local optimum for a cluster or two, hence a mean rather than a minimum)
    assert sorted(summary["mapping"]) == list(range(K)) and summary["mean_centroid_similarity"] > 0.8, summary
    # least disturbance: no other worker order of the new centroids is closer to the old ones
    assert remap_to_workers(parent.centroids(), new.centroids())[0].tolist() == list(range(K))
    assert sum(summary["cluster_sizes"]) == summary["n_signatures"]
    assert max(summary["cluster_sizes"]) - min(summary["cluster_sizes"]) <= 1  # balanced
    with pytest.raises(RefitError, match="needs at least"):
        refit_file(drift_setup["path"], A[:10], out)
    with pytest.raises(RefitError, match="must be"):
        refit_file(drift_setup["path"], A[:, :5], out)


def test_live_router_picks_up_refits_while_routing_from_threads(drift_setup, tmp_path):
    """4 threads route continuously (each request acquires and releases its slot) while 3
    refits replace the file; the router auto-reloads. No route may fail, every decision must
    name a valid worker, and the router must end on the last refit's generation."""
    import shutil

    path = str(tmp_path / "live.eldr")
    shutil.copyfile(drift_setup["path"], path)
    router = _core.Router(policy="eldr", centroids=path, reload_interval_ms=1)
    S = drift_setup["S"][drift_setup["valid"]]
    stop = threading.Event()
    errors: list = []
    routed = [0] * 4
    gens: set = set()

    def work(t):
        i = t
        while not stop.is_set():
            try:
                dec = router.route_signature(S[i % len(S)], explain=True)
                assert 0 <= dec.worker < K and dec.reason == "band"
                gens.add(dec.generation)
                with router.acquire(dec.worker, 1):
                    pass
                routed[t] += 1
            except Exception as exc:  # pragma: no cover - the assertion below reports it
                errors.append(repr(exc))
                return
            i += 4

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    try:
        for j in range(3):
            sample = S[(np.arange(len(S)) * 3 + j) % len(S)][:300]
            refit_file(path, sample, path, reason=f"live {j}", seed=j, n_init=1, max_iter=10)
            deadline = time.monotonic() + 10
            while router.centroid_generation < j + 2 and time.monotonic() < deadline:
                time.sleep(0.005)
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors[:3]
    assert router.centroid_generation == 4 and router.last_reload_error is None
    assert {1, 4} <= gens and min(routed) > 0
    assert router.inflight() == [0] * K  # every slot released


def test_refit_for_the_decode_members_fits_their_number_membership(drift_setup, tmp_path):
    """Live membership: a controller told the decode members fits K = their number (one more
    and one fewer than the file's), names them in the file, and asks for signatures per K."""
    import shutil

    path = str(tmp_path / "members.eldr")
    shutil.copyfile(drift_setup["path"], path)
    members = [f"http://d{i}:30001" for i in range(K + 1)]
    ctl = RefitController(path, executor="inline", cooldown_s=0, workers=lambda: list(members),
                          reservoir_kw=dict(capacity=1024, horizon=2048), monitor_kw=dict(window=128))
    assert ctl.min_signatures == 32 * (K + 1)
    S = drift_setup["S"][(drift_setup["phase"] == 0) & drift_setup["valid"]]
    for s in S[:600]:
        ctl.reservoir.add(s)
    for n in (K + 1, K - 2):
        del members[n:]
        r = ctl.request(f"to {n}", force=True)
        assert r["accepted"], r
        st = ctl.status()
        assert st["last_ok"], st["last_error"]
        new = _core.CentroidSet.open(path)
        assert new.num_workers == n and list(new.worker_names) == members
        prov = json.loads(new.provenance_json)
        assert len(prov["baseline"]["nearest_share"]) == n and prov["params"]["workers"] == n
        DriftMonitor(new.provenance_json, num_workers=n)  # its baseline is for the new K


def test_controller_manual_cooldown_and_errors(drift_setup, tmp_path):
    import shutil

    path = str(tmp_path / "ctl.eldr")
    shutil.copyfile(drift_setup["path"], path)
    router = _core.Router(policy="eldr", centroids=path, reload_interval_ms=0)
    now = [0.0]
    ctl = RefitController(path, router=router, executor="inline", cooldown_s=10, clock=lambda: now[0],
                          reservoir_kw=dict(capacity=1024, horizon=2048), monitor_kw=dict(window=128))
    r = ctl.request()
    assert not r["accepted"] and r["why"] == "too_few" and "needs" in r["message"]
    S = drift_setup["S"][(drift_setup["phase"] == 0) & drift_setup["valid"]]
    for s in S[:600]:
        ctl.observe(router.route_signature(s, explain=True), s)
    r = ctl.request("manual")
    assert r["accepted"], r
    st = ctl.status()
    assert st["refits"] == 1 and st["last_ok"] and st["last_reason"] == "manual" and router.centroid_generation == 2
    r = ctl.request("again")
    assert not r["accepted"] and r["why"] == "cooldown"
    assert ctl.request("forced", force=True)["accepted"]
    # a failing refit is reported in the status, never raised into routing
    ctl.path = str(tmp_path / "missing.eldr")
    now[0] = 100.0
    assert ctl.request("broken")["accepted"]
    st = ctl.status()
    assert st["last_ok"] is False and "cannot open" in st["last_error"] and st["failures"] == 1
    dec = router.route_signature(S[0], explain=True)  # routing goes on with the last good set
    assert dec.reason == "band"


def test_controller_refits_on_drift_and_rebases(drift_setup, tmp_path):
    import shutil

    path = str(tmp_path / "drift.eldr")
    shutil.copyfile(drift_setup["path"], path)
    router = _core.Router(policy="eldr", centroids=path, reload_interval_ms=0)
    count = [0]
    ctl = RefitController(path, router=router, executor="inline", cooldown_s=10_000, clock=lambda: float(count[0]),
                          reservoir_kw=dict(capacity=1024, horizon=2048, buckets=8), monitor_kw=dict(window=128))
    S, ph, valid = drift_setup["S"], drift_setup["phase"], drift_setup["valid"]
    fired = []
    for i in np.flatnonzero(ph >= 0):
        if not valid[i]:
            continue
        count[0] += 1
        why = ctl.observe(router.route_signature(S[i], explain=True), S[i])
        if why:
            fired.append((int(ph[i]), why))
    assert len(fired) == 1 and fired[0][0] == 1 and fired[0][1].startswith("drift"), fired
    st = ctl.status()
    assert st["last_ok"] and router.centroid_generation == 2
    assert st["monitor"]["rebases"] == 1 and st["monitor"]["generation"] == 2
    # after the refit phase B traffic is back in profile against the refit's baseline
    assert not st["monitor"]["drifted"]


# ------------------------------------------------------------------------------------ CLI
def test_cli_drift_check_and_refit(drift_setup, tmp_path, capsys):
    from eldr_sglang.cli.refit import main

    ph = drift_setup["phase"]
    a0, a1 = int(np.argmax(ph == 0)), int(np.argmax(ph == 1))
    assert main(["drift-check", drift_setup["path"], "--trace", drift_setup["trace"], "--requests", f"{a0}:{a1}"]) == 0
    assert "no drift reported" in capsys.readouterr().out
    assert main(["drift-check", drift_setup["path"], "--trace", drift_setup["trace"], "--requests", f"{a0}:", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drift_at_request"] is not None and out["drift_at_request"] >= a1
    new = str(tmp_path / "new.eldr")
    assert main(["refit", drift_setup["path"], "--trace", drift_setup["trace"], "--requests", f"{a1}:", "--out", new]) == 0
    assert "refitted" in capsys.readouterr().out
    assert json.loads(_core.CentroidSet.open(new).provenance_json)["refit"]["requests"] == [a1, len(ph)]
    assert main(["refit", drift_setup["path"], "--trace", drift_setup["trace"], "--requests", "9:3"]) == 1
    err = capsys.readouterr().err
    assert "outside" in err and "Traceback" not in err
    assert main(["drift-check", str(tmp_path / "nope.eldr"), "--trace", drift_setup["trace"]]) == 1
    assert "error" in capsys.readouterr().err


# ------------------------------------------------------------------ router service hook
def test_router_hook_metrics_status_and_post_refit(drift_setup):
    """The drift hook on the real router app (no workers needed for these endpoints):
    GET /eldr/drift, POST /eldr/refit (422 too few, 400 bad body, 202 accepted), /metrics
    gauges, and the router's reload loop picking up the refitted file."""
    pytest.importorskip("aiohttp")
    import asyncio
    import shutil

    from aiohttp.test_utils import TestClient, TestServer

    from eldr_sglang.router.drift_hook import install
    from eldr_sglang.router.app import build_app
    from eldr_sglang.router.config import PrefillWorker, RouterConfig
    from eldr_sglang.traces import load_trace

    path = str(drift_setup["dir"] / "router.eldr")
    shutil.copyfile(drift_setup["path"], path)
    cfg = RouterConfig(prefill=[PrefillWorker("http://127.0.0.1:9", None, "127.0.0.1")],
                       decode=[f"http://127.0.0.1:{10 + k}" for k in range(K)], centroids=path, bind="early", policy="eldr",
                       health_check_interval_s=0, load_monitor_interval_s=0, reload_interval_ms=20,
                       admin_token="drift-test-admin-token-0123")
    auth = {"Authorization": "Bearer drift-test-admin-token-0123"}  # /eldr/refit is a control endpoint
    # hook options travel on the config (install() reads a `drift` dict attribute)
    cfg.drift = dict(executor="inline", cooldown_s=0, window=64, check_interval_s=0.02, refit_on_drift=False,
                     reservoir_capacity=512, reservoir_horizon=512)
    app = build_app(cfg)
    pd = next(v for v in app.values() if hasattr(v, "router") and hasattr(v, "cfg"))
    hook = getattr(pd, "drift", None)
    if hook is None:  # the router app does not install the hook itself: attach it here
        hook = install(app, pd)
    assert hook.ctl.reservoir.capacity == 512  # the options were applied
    assert hook is not None and pd.drift is hook
    tr = load_trace(drift_setup["trace"])
    E = tr.num_experts

    async def main():
        async with TestClient(TestServer(app)) as c:
            r = await c.get("/eldr/drift")
            assert r.status == 200 and (await r.json())["monitor"]["observations"] == 0
            r = await c.post("/eldr/refit")
            assert r.status == 401
            r = await c.post("/eldr/refit", headers=auth)
            assert r.status == 422 and "needs" in (await r.json())["message"]
            r = await c.post("/eldr/refit", data=b"{oops", headers={"Content-Type": "application/json", **auth})
            assert r.status == 400
            r = await c.post("/eldr/refit", data=b"[" * 100_000 + b"]" * 100_000,
                             headers={"Content-Type": "application/json", **auth})
            assert r.status == 400 and "nested too deeply" in (await r.json())["error"]["message"]
            for i in np.flatnonzero(drift_setup["phase"] == 0)[:400]:
                counts = _core.count_topk(np.ascontiguousarray(tr.prefill_ids(int(i))), E)
                hook.on_route(pd.router.route_dense(counts, explain=True), counts)
            hook.on_route(pd.router.route_signature(None, explain=True), None)  # a fallback: counted, not stored
            r = await c.post("/eldr/refit", json={"force": True, "reason": "test"}, headers=auth)
            assert r.status == 202, await r.text()
            for _ in range(200):
                if pd.router.centroid_generation == 2:
                    break
                await asyncio.sleep(0.02)
            assert pd.router.centroid_generation == 2
            st = await (await c.get("/eldr/drift")).json()
            assert st["refits"] == 1 and st["last_ok"] and st["last_reason"] == "test"
            assert st["monitor"]["observations"] == 400 and st["monitor"]["no_signature"] == 1
            text = await (await c.get("/metrics")).text()
            assert "eldr_drift_mean_d_star" in text and 'eldr_refits_total{result="ok"} 1.0' in text
            assert "eldr_reservoir_signatures" in text

    asyncio.run(main())
    assert json.loads(_core.CentroidSet.open(path).provenance_json)["refit"]["reason"] == "test"


# -------------------------------------------------------------------------- simulator policy
def test_adaptive_policy_in_the_simulator(drift_setup, tmp_path):
    """AdaptivePolicy drives a real simulation across the A->B shift: every request completes
    exactly once, one drift refit happens in phase B, and it takes effect activation_delay
    routed requests later (the decisions' generation steps from 1 to 2 there)."""
    from eldr_sglang.drift.drifting_workload import AdaptivePolicy
    from eldr_sglang.sim.cluster import ClusterConfig, simulate
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.workload import replay_workload
    from eldr_sglang.traces import load_trace

    tr = load_trace(drift_setup["trace"])
    replay = TraceReplay(tr)
    ev = np.flatnonzero(drift_setup["phase"] >= 0)
    wl = replay_workload(replay, requests=ev, arrival="closed", concurrency=64)
    pol = AdaptivePolicy("adaptive", K, drift_setup["path"], (drift_setup["S"], drift_setup["valid"]), str(tmp_path),
                         cooldown=10_000, activation_delay=32, monitor_kw=dict(window=128),
                         reservoir_kw=dict(capacity=1024, horizon=2048))
    res = simulate(replay, wl, pol, ExecutionModel(get_model(tr.model), get_hardware("h100")), ClusterConfig(num_decode=K))
    assert (res.completions == 1).all()
    assert len(pol.events) == 1 and pol.events[0]["ok"] and pol.events[0]["reason"].startswith("drift")
    e = pol.events[0]
    assert e["triggered_at"] > int(np.argmax(drift_setup["phase"][ev] == 1))  # after the shift
    gens = np.asarray(pol.generation_of)
    assert e["activated_at"] == e["triggered_at"] + 32
    assert (gens[: e["activated_at"]] == 1).all() and (gens[e["activated_at"]:] == 2).all()


def test_controller_schedule(drift_setup, tmp_path):
    import shutil

    path = str(tmp_path / "sched.eldr")
    shutil.copyfile(drift_setup["path"], path)
    now = [0.0]
    ctl = RefitController(path, executor="inline", on_drift=False, interval_s=100, cooldown_s=10, clock=lambda: now[0],
                          reservoir_kw=dict(capacity=512, horizon=512))
    S = drift_setup["S"][drift_setup["valid"]][:300]
    ctl.reservoir.add_many(S)
    assert ctl.maybe_trigger() is None  # not due yet
    now[0] = 100.0
    assert ctl.maybe_trigger() == "schedule"
    assert ctl.status()["last_reason"] == "schedule" and ctl.status()["last_ok"]
    now[0] = 150.0
    assert ctl.maybe_trigger() is None  # next one is due at 200
    now[0] = 200.0
    assert ctl.maybe_trigger() == "schedule" and ctl.refits == 2


def test_router_without_a_baseline_routes_on_without_drift_handling(tmp_path):
    pytest.importorskip("aiohttp")
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from eldr_sglang.router.app import build_app
    from eldr_sglang.router.config import build_parser, config_from_args

    p = str(tmp_path / "nobaseline.eldr")
    _core.write_centroids(p, np.eye(4, 8, dtype=np.float32), np.ones(1, np.float32), np.ones((1, 8), np.float32), 0.1, None, "{}")
    args = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:9", "--disagg-router", "eldr", "--eldr-centroids", p]
    for k in range(4):
        args += ["--decode", f"http://127.0.0.1:{10 + k}"]
    app = build_app(config_from_args(build_parser().parse_args(args)))
    pd = next(v for v in app.values() if hasattr(v, "drift"))
    assert pd.drift is None

    async def main():
        async with TestClient(TestServer(app)) as c:
            for method, path in (("GET", "/eldr/drift"), ("POST", "/eldr/refit")):
                r = await c.request(method, path)
                assert r.status == 404 and "drift baseline" in (await r.json())["error"]["message"]

    asyncio.run(main())
