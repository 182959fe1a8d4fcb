"""benchmarks/gpu_calibrate.py: the d-covering top-k construction, and a CPU dry run whose
file the cost model reads. The dry run needs torch (installed with sglang): it skips without
it, except under ELDR_REQUIRE_SGLANG=1, where it fails."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_calibrate  # noqa: E402


@pytest.mark.parametrize("b,k,E", [(8, 2, 16), (16, 8, 256), (64, 4, 32), (1, 6, 64)])
def test_topk_ids_cover_exactly_d_experts(b, k, E):
    rng = np.random.default_rng(0)
    for d in range(k, min(b * k, E) + 1):
        ids = gpu_calibrate.topk_ids_covering(b, k, d, E, rng)
        assert ids.shape == (b, k)
        assert len(np.unique(ids)) == d
        assert all(len(set(row)) == k for row in ids.tolist())  # no expert twice in one token
    with pytest.raises(ValueError):
        gpu_calibrate.topk_ids_covering(b, k, k - 1, E, rng)


def test_fit_line_recovers_a_line():
    ds = [4, 8, 16, 32]
    a, b, r = gpu_calibrate.fit_line(ds, [5e-6 + 2e-6 * d for d in ds])
    assert a == pytest.approx(5e-6) and b == pytest.approx(2e-6) and r < 1e-9


def test_dry_run_writes_a_calibration_the_cost_model_reads(tmp_path):
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("ELDR_REQUIRE_SGLANG") == "1":
            pytest.fail("torch is not installed and ELDR_REQUIRE_SGLANG=1")
        pytest.skip("torch is not installed (comes with sglang)")
    from eldr_sglang.sim.cost_model import load_calibration

    out = tmp_path / "cal.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_calibrate.py"), "--dry-run", "--out", str(out),
           "--batches", "4,8", "--points", "3", "--warmup", "1", "--reps", "2", "--models", "tiny-moe"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["format"] == "eldr-moe-calibration/1" and doc["dry_run"] is True
    assert [e["batch"] for e in doc["entries"]] == [4, 8]
    for e in doc["entries"]:
        assert len(e["d"]) == len(e["t_s"]) >= 2 and e["d"][0] == 2
    cal = load_calibration(out, "tiny-moe", "cpu")
    assert sorted(cal) == [4, 8] and all(a >= 0 and b >= 0 for a, b in cal.values())
    assert "| tiny-moe | 4 |" in r.stdout
    # never destroys what stands at its output path
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r2.returncode != 0 and "exists" in r2.stderr


def _torch_or_skip():
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("ELDR_REQUIRE_SGLANG") == "1":
            pytest.fail("torch is not installed and ELDR_REQUIRE_SGLANG=1")
        pytest.skip("torch is not installed (comes with sglang)")


def _cpu_run(tmp_path, *extra):
    out = tmp_path / "cal_cpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_calibrate.py"), "--device", "cpu", "--tiny", "--out", str(out),
           "--batches", "1,8", "--points", "3", "--warmup", "2", "--reps", "5", "--context", "8", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text()), r


def _check_cpu_doc(doc, kernel):
    assert doc["format"] == "eldr-moe-calibration/1" and doc["device"] == "cpu" and doc["threads"] == 1
    assert "cpu" in doc["hardware"].lower() and doc["hardware"].endswith("1 thread")
    assert [e["batch"] for e in doc["entries"]] == [1, 8]
    for e in doc["entries"]:
        assert e["kernel"] == kernel and e["weight_dtype"] == "bfloat16" and e["threads"] == 1
        assert e["other_s"] > 0 and e["gate_s"] > 0 and e["context_tokens"] == 8
        assert (e["hidden"], e["intermediate_per_rank"], e["experts"], e["top_k"], e["layers"]) == (128, 512, 16, 2, 2)
    b1, b8 = doc["entries"]
    assert b1["d"] == [2]  # one token touches exactly top-k experts
    assert b8["d"] == [2, 9, 16]
    # 14 more experts of 384 kB each: the time grows with d, well beyond one core's noise
    assert b8["t_s"][-1] > b8["t_s"][0] and b8["b_s"] > 0


def test_cpu_mode_torch_reference_writes_other_s_and_the_simulator_reads_it(tmp_path):
    _torch_or_skip()
    from eldr_sglang.sim.cost_model import load_calibration

    doc, r = _cpu_run(tmp_path, "--moe-kernel", "torch")
    _check_cpu_doc(doc, "torch.grouped_gemm")
    assert doc["sglang_kernel"] is False and "| tiny-cpu-moe | 8 |" in r.stdout
    cal = load_calibration(tmp_path / "cal_cpu.json", "tiny-cpu-moe", "cpu")
    assert sorted(cal) == [1, 8]
    assert all(len(v) == 3 and v[2] == e["other_s"] for v, e in zip((cal[1], cal[8]), doc["entries"]))


def test_cpu_mode_times_sglangs_moe_forward_native(tmp_path):
    """The real path: re-executes itself with the CPU engine environment and the libcuda stub
    (about a minute on two shared cores, most of it importing SGLang)."""
    from _sglang_cpu import REQUIRE

    if importlib.util.find_spec("sglang") is None:
        if REQUIRE:
            pytest.fail("sglang is not installed (CI=true or ELDR_REQUIRE_SGLANG=1)")
        pytest.skip("sglang is not installed")
    doc, r = _cpu_run(tmp_path)
    _check_cpu_doc(doc, "sglang.moe_forward_native")
    assert doc["sglang_kernel"] is True


def test_cpu_mode_refuses_bad_arguments(tmp_path):
    base = [sys.executable, str(ROOT / "benchmarks" / "gpu_calibrate.py"), "--out", str(tmp_path / "x.json")]
    for extra, msg in [(["--device", "cpu", "--tiny", "--model-dir", str(tmp_path)], "not both"),
                       (["--device", "cpu", "--model-dir", str(tmp_path)], "config.json"),
                       (["--device", "cpu", "--dry-run"], "--device cpu"),
                       (["--tiny"], "go with --device cpu")]:
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)
    assert not (tmp_path / "x.json").exists()


def test_cpu_default_shape_is_the_locality_models():
    spec_mod = pytest.importorskip("eldr_sglang.testing.sglang_cpu.locality_model")
    s, d = spec_mod.LocalityModelSpec(), gpu_calibrate.CPU_DEFAULT
    assert (d.hidden, d.inter, d.experts, d.top_k, d.layers, d.heads, d.kv_heads, d.head_dim, d.vocab) == (
        s.hidden, s.moe_intermediate, s.experts, s.top_k, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab)


def test_cpu_shape_from_a_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 512, "moe_intermediate_size": 1536, "intermediate_size": 1536,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 2048, "torch_dtype": "bfloat16"}))
    s = gpu_calibrate.cpu_shape_from_model_dir(tmp_path)
    assert (s.hidden, s.inter, s.experts, s.top_k, s.layers, s.heads, s.kv_heads, s.head_dim, s.vocab) == (
        512, 1536, 32, 4, 4, 8, 4, 64, 2048)


def test_step_terms_recover_a_known_line():
    """The three-term summary: other_s + L*a linear in B gives fixed and per_request back;
    per_expert is the batches' b."""
    L = 4
    entries = [{"model": "m", "batch": b, "a_s": 1e-4, "b_s": 8e-4, "other_s": 0.01 + 0.003 * b} for b in (1, 2, 4, 8)]
    t = gpu_calibrate.step_terms(entries, L)["m"]
    assert abs(t["fixed_s"] - (0.01 + L * 1e-4)) < 1e-9
    assert abs(t["per_request_s"] - 0.003) < 1e-9
    assert t["per_expert_s"] == 8e-4 and t["scope"] == "whole step but the scheduler"
    gpu = gpu_calibrate.step_terms([{k: v for k, v in e.items() if k != "other_s"} for e in entries], 1)["m"]
    assert gpu["scope"] == "MoE layers only" and abs(gpu["per_request_s"]) < 1e-12
