"""The synthetic workload generator: shapes, determinism, workload process, and the match to
the real GPT-OSS-20B routing statistics (benchmarks/calibrate_synth.py fits the defaults).

Tolerances: eldr_sglang.testing.synth_tolerances (benchmarks/calibrate_synth.py prints them too).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eldr_sglang.traces import synth, stats as ts
from eldr_sglang.cli import main
from eldr_sglang.traces import load_trace
from eldr_sglang.traces.counts_file import open_counts_trace, prefill_counts
from eldr_sglang.testing.synth_tolerances import TOLERANCES

TEST_SEEDS = (7, 8)  # neither the fit seeds nor the reported evaluation seeds
SMALL_POOL = dataclasses.replace(synth.SynthParams(), pool_size=48)  # cheaper pools where stats need no precision


def check_calibration(real: dict, syn: dict) -> dict:
    """name -> (measured deviation, tolerance, ok) for every criterion in TOLERANCES."""
    out = {}
    for key, tol in TOLERANCES.items():
        r, s = np.asarray(real[key]), np.asarray(syn[key])
        if "mean_abs" in tol:
            d = abs(s.mean() - r.mean())
            out[f"{key}.mean_abs"] = (d, tol["mean_abs"], d <= tol["mean_abs"])
        if "mean_rel" in tol:
            d = abs(s.mean() - r.mean()) / r.mean()
            out[f"{key}.mean_rel"] = (d, tol["mean_rel"], d <= tol["mean_rel"])
        if "profile_r" in tol:
            c = float(np.corrcoef(r, s)[0, 1]) if s.std() > 0 else 0.0
            out[f"{key}.profile_r"] = (c, tol["profile_r"], c >= tol["profile_r"])
    return out


def _averaged(real_trace, seeds, uniform=False):
    kw = synth.workload_like(real_trace)
    runs = [ts.summarize(synth.generate("gpt-oss-20b", seed=s, uniform=uniform, **kw), seed=s) for s in seeds]
    return {k: np.mean([r[k] for r in runs], axis=0) for k in TOLERANCES}


@pytest.fixture(scope="module")
def real_stats(gptoss_trace):
    return ts.summarize(gptoss_trace)


def test_generated_gptoss_matches_real_statistics(gptoss_trace, real_stats):
    res = check_calibration(real_stats, _averaged(gptoss_trace, TEST_SEEDS))
    failed = {k: v for k, v in res.items() if not v[2]}
    assert not failed, f"outside tolerance: {failed}"


def test_uniform_control_fails_the_mi_check(gptoss_trace, real_stats):
    uni = _averaged(gptoss_trace, TEST_SEEDS[:1], uniform=True)
    res = check_calibration(real_stats, uni)
    assert not res["mutual_information.mean_rel"][2]
    assert not res["mutual_information.profile_r"][2]
    assert uni["mutual_information"].mean() < 0.01  # no domain structure at all
    assert np.all(uni["layer_entropy"] > 4.95)  # uniform over 32 experts: ~5 bits


@pytest.mark.parametrize("model", sorted(synth.MODEL_SHAPES))
def test_shapes_dtypes_and_ranges(model):
    shape = synth.MODEL_SHAPES[model]
    t = synth.generate(model, requests=30, domains=4, seed=3, prompt_len=(5, 40), output_len=(0, 20), params=SMALL_POOL)
    t.validate()
    assert t.expert_ids.shape[1:] == (shape["num_layers"], shape["top_k"])
    assert t.expert_ids.dtype == np.uint8
    assert t.meta["model"] == shape["hf_id"] and t.meta["num_experts"] == shape["num_experts"]
    ids = np.sort(t.expert_ids.astype(np.int64), axis=-1)
    assert np.all(np.diff(ids, axis=-1) > 0), "top-k must be sampled without replacement"
    assert ids.max() < shape["num_experts"]
    assert np.all(np.diff(t.arrival_s) >= 0) and t.arrival_s[0] == 0
    assert set(t.domain) <= {f"domain{d}" for d in range(4)}
    assert np.all((t.prefill_len >= 5) & (t.prefill_len <= 40))
    assert np.all((t.decode_len() >= 0) & (t.decode_len() <= 20))


def test_deterministic_per_seed():
    a = synth.generate("mixtral-8x7b", requests=40, seed=5, prompt_len=30, output_len=10)
    b = synth.generate("mixtral-8x7b", requests=40, seed=5, prompt_len=30, output_len=10)
    c = synth.generate("mixtral-8x7b", requests=40, seed=6, prompt_len=30, output_len=10)
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    assert a.expert_ids.shape != c.expert_ids.shape or np.any(a.expert_ids != c.expert_ids)


def test_uniform_control_keeps_the_workload():
    kw = dict(requests=60, seed=9, prompt_len=(10, 50), output_len=16)
    a = synth.generate("gpt-oss-20b", **kw)
    u = synth.generate("gpt-oss-20b", uniform=True, **kw)
    np.testing.assert_array_equal(a.domain, u.domain)
    np.testing.assert_array_equal(a.arrival_s, u.arrival_s)
    np.testing.assert_array_equal(a.req_offsets, u.req_offsets)
    np.testing.assert_array_equal(a.prefill_len, u.prefill_len)
    assert u.meta["synth"]["uniform"] is True


def test_middle_layers_more_domain_specific():
    t = synth.generate("deepseek-v3", requests=240, seed=1, prompt_len=(32, 64), output_len=8, params=SMALL_POOL)
    mi = ts.domain_mutual_information(t)
    L = len(mi)
    middle = mi[L // 3: 2 * L // 3].mean()
    ends = np.concatenate([mi[: L // 8], mi[-(L // 8):]]).mean()
    # the real GPT-OSS trace has 1.36x (relative depths 1/3..2/3 against the outer eighths);
    # wider models spread the ends' MI more, so only a clear excess is required here
    assert middle > 1.1 * ends, (middle, ends)


def test_same_domain_requests_share_experts_uniform_do_not():
    """The decode picks of a request hit the prefill experts of another request of the same
    domain more often than those of a random request; in the uniform control they do not."""
    kw = dict(requests=200, seed=2, prompt_len=(20, 40), output_len=16)
    lift = {}
    for uniform in (False, True):
        t = synth.generate("qwen3-30b-a3b", uniform=uniform, **kw)
        same = np.arange(t.num_requests)
        for d in np.unique(t.domain):  # pair every request with another one of its domain
            idx = np.flatnonzero(t.domain == d)
            same[idx] = np.roll(idx, 1)
        hit_same = np.nanmean(ts.prefill_decode_hit_rate(t, same))
        hit_rand = np.nanmean(ts.prefill_decode_hit_rate(t, ts.shuffled_pairing(t, 0)))
        lift[uniform] = hit_same - hit_rand
    assert lift[False] > 0.03, lift
    assert abs(lift[True]) < 0.01, lift


def test_bursty_domains_and_arrival_rate():
    n = 4000
    def runs(t):
        change = np.flatnonzero(t.domain[1:] != t.domain[:-1])
        return n / (len(change) + 1)
    bursty = synth.generate("mixtral-8x7b", requests=n, seed=4, prompt_len=4, output_len=1, burstiness=0.95)
    iid = synth.generate("mixtral-8x7b", requests=n, seed=4, prompt_len=4, output_len=1, burstiness=0.0)
    assert runs(bursty) > 3 * runs(iid)
    # the mean arrival rate is the requested one (statistically, not a wall-clock check)
    rate = (n - 1) / bursty.arrival_s[-1]
    assert 0.8 * 4.0 < rate < 1.25 * 4.0


def test_argument_errors():
    with pytest.raises(ValueError, match="unknown model"):
        synth.generate("gpt-5", requests=1)
    with pytest.raises(ValueError, match="requests"):
        synth.generate("gpt-oss-20b", requests=0)
    with pytest.raises(ValueError, match="burstiness"):
        synth.generate("gpt-oss-20b", requests=3, burstiness=1.5)
    with pytest.raises(ValueError, match="prompt_len"):
        synth.generate("gpt-oss-20b", requests=3, prompt_len=(10, 5))
    with pytest.raises(ValueError, match="domain_weights"):
        synth.generate("gpt-oss-20b", requests=3, domains=2, domain_weights=[1.0, -1.0])


def test_cli_synth(tmp_path, capsys):
    out = tmp_path / "s.npz"
    assert main(["synth", "--model", "gpt-oss-20b", "--requests", "25", "--domains", "3", "--seed", "1",
                 "--output-len", "12", "--prompt-len", "20", "--out", str(out), "--keep-decode", "10"]) == 0
    with open_counts_trace(out) as t:  # v2 by default
        assert t.num_requests == 25 and np.all(t.decode_len() == 12) and t.arrival_s is not None
        np.testing.assert_array_equal(t.decode_requests(), np.arange(10))
    v1 = tmp_path / "s1.npz"
    assert main(["synth", "--model", "gpt-oss-20b", "--requests", "25", "--domains", "3", "--seed", "1",
                 "--output-len", "12", "--prompt-len", "20", "--out", str(v1), "--format", "v1"]) == 0
    t = load_trace(v1)
    assert t.num_requests == 25 and np.all(t.decode_len() == 12) and t.arrival_s is not None
    with open_counts_trace(out) as c:  # the same requests and routing in both formats
        assert (c.counts() != prefill_counts(t.expert_ids, t.req_offsets, t.prefill_len, t.num_experts)).nnz == 0
    with pytest.raises(SystemExit) as exc:  # argparse: exit status 2
        main(["synth", "--model", "gpt-oss-20b", "--requests", "0", "--out", str(tmp_path / "x.npz")])
    assert exc.value.code == 2 and "--requests: must be an integer 1.." in capsys.readouterr().err
    assert not (tmp_path / "x.npz").exists()


def test_iter_generate_streams_the_same_trace():
    kw = dict(requests=2600, domains=5, seed=11, prompt_len=(5, 15), output_len=4)
    whole = synth.generate("gpt-oss-20b", **kw)
    chunks = list(synth.iter_generate("gpt-oss-20b", chunk_requests=1000, **kw))
    assert [c.num_requests for c in chunks] == [1000, 1000, 600]
    for c in chunks:
        c.validate()
    np.testing.assert_array_equal(np.concatenate([c.domain for c in chunks]), whole.domain)
    np.testing.assert_array_equal(np.concatenate([c.arrival_s for c in chunks]), whole.arrival_s)
    np.testing.assert_array_equal(np.concatenate([c.prefill_len for c in chunks]), whole.prefill_len)
    # the draws go by blocks of requests, so chunking changes nothing of the routing
    np.testing.assert_array_equal(np.concatenate([c.expert_ids for c in chunks]), whole.expert_ids)
    with pytest.raises(ValueError, match="chunk_requests"):
        next(synth.iter_generate("gpt-oss-20b", requests=3, chunk_requests=0))
