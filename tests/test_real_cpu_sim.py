"""benchmarks/real_cpu_sim.py and `eldr simulate --hardware cpu`: the simulator's side of the
real-engine CPU benchmark, on small inputs built here (a synthetic trace at the constructed
Qwen3-MoE's shape, centroids fitted on it, a hand-written CPU calibration file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("eldr_sglang._core")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_cpu_sim  # noqa: E402

SHAPE = {"hidden": 512, "intermediate_per_rank": 1536, "experts": 32, "top_k": 4, "layers": 4, "heads": 8,
         "kv_heads": 4, "head_dim": 64, "vocab": 2048}


def _eldr(*argv):
    r = subprocess.run([sys.executable, "-m", "eldr_sglang", *argv], capture_output=True, text=True, timeout=600)
    return r


def _calibration(path, b_s=0.75e-3):
    entries = [{"model": "qwen3-moe-locality", "hardware": "cpu: Test CPU, 1 thread", "batch": b, "a_s": 0.3e-3,
                "b_s": b_s, "other_s": 3e-3 + 0.2e-3 * b, **SHAPE} for b in (1, 2, 4, 8, 16)]
    path.write_text(json.dumps({"format": "eldr-moe-calibration/1", "device": "cpu", "entries": entries}))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("realcpu")
    model = d / "locality-0.9-0-"  # named as the benchmark names it: not the calibration's model name
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 512, "moe_intermediate_size": 1536, "intermediate_size": 1536,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 2048, "torch_dtype": "bfloat16"}))
    trace, cents = d / "trace.npz", d / "centroids.eldr"
    r = _eldr("synth", "--model", str(model), "--requests", "48", "--domains", "4", "--prompt-len", "24",
              "--output-len", "12", "--keep-decode", "all", "--jobs", "1", "--out", str(trace), "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _eldr("fit", str(trace), "--workers", "2", "--layers", "all", "--out", str(cents), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    # a v1 trace with strong locality by hand: 4 domains, each routing to its own 8 of the 32
    # experts at every layer (the constructed model near locality 1), in a shuffled order
    from eldr_sglang.traces import save_trace

    from _sim_helpers import make_trace

    rng = np.random.default_rng(0)
    dom = rng.permutation(np.arange(48) % 4)
    rows = [np.stack([rng.permutation(8)[:4] + 8 * dm for _ in range(36 * 4)]).reshape(36, 4, 4) for dm in dom]
    strong = d / "strong.npz"
    save_trace(make_trace(np.concatenate(rows).astype(np.int16), [36] * 48, [24] * 48, 32), strong)
    strong_c = d / "strong.eldr"
    r = _eldr("fit", str(strong), "--workers", "2", "--layers", "all", "--out", str(strong_c), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    return {"trace": trace, "centroids": cents, "model_dir": model, "calibration": _calibration(d / "cal.json"),
            "strong": strong, "strong_centroids": strong_c, "dir": d}


def test_simulate_cell_reports_every_policy_against_the_best_balancer(inputs):
    cell = real_cpu_sim.simulate_cell(inputs["trace"], inputs["centroids"], inputs["calibration"], inputs["model_dir"],
                                      workers=2, concurrency=8, output_len=12, repeats=2)
    rows = cell["policies"]
    assert list(rows) == real_cpu_sim.POLICIES.split(",")
    assert cell["best_balancer"] in real_cpu_sim.BALANCERS and cell["model"]["calibrated_step"] is True
    best = rows[cell["best_balancer"]]
    assert best["p50_vs_best_balancer"] == 0.0
    assert all(rows[b]["p50_vs_best_balancer"] >= 0 for b in real_cpu_sim.BALANCERS)
    # each repeat drops its first `concurrency` requests
    assert all(r["requests"] == 2 * (48 - 8) for r in rows.values())
    for r in rows.values():
        # a step is at least other_s(1) + 4 layers x (a + b x top-k), the least a batch can cost
        assert r["tpot_p50_ms"] >= (3.2e-3 + 4 * (0.3e-3 + 0.75e-3 * 4)) * 1e3 * (1 - 1e-9)
        assert r["tpot_p99_ms"] >= r["tpot_p50_ms"]


def test_locality_lowers_distinct_experts_and_the_per_expert_cost_sets_the_gain(inputs, tmp_path):
    """On strong-locality routing ELDR's batches touch fewer experts than round robin's for their
    size (counts); with no per-expert cost (b = 0) distinct experts cost nothing, so ELDR's
    predicted TPOT gain over round robin comes from the calibration's b(B)."""
    flat = _calibration(tmp_path / "flat.json", b_s=0.0)
    kw = dict(workers=2, concurrency=16, output_len=12, repeats=2, policies="round_robin,eldr")
    steep = real_cpu_sim.simulate_cell(inputs["strong"], inputs["strong_centroids"], inputs["calibration"],
                                       inputs["model_dir"], **kw)
    none = real_cpu_sim.simulate_cell(inputs["strong"], inputs["strong_centroids"], flat, inputs["model_dir"], **kw)
    rows = steep["policies"]
    assert rows["eldr"]["expert_locality"] < rows["round_robin"]["expert_locality"] - 0.05, rows
    assert none["policies"]["eldr"]["tpot_p50_ms"] < steep["policies"]["eldr"]["tpot_p50_ms"]
    gain = {name: c["policies"]["eldr"]["tpot_p50_ms"] / c["policies"]["round_robin"]["tpot_p50_ms"] - 1
            for name, c in (("steep", steep), ("none", none))}
    assert gain["steep"] < gain["none"] - 0.02, gain


def test_cli_writes_json_and_a_table_and_refuses_bad_inputs(inputs, tmp_path):
    out = tmp_path / "sim.json"
    base = [sys.executable, str(ROOT / "benchmarks" / "real_cpu_sim.py"), "--trace", str(inputs["trace"]),
            "--centroids", str(inputs["centroids"]), "--model-dir", str(inputs["model_dir"]), "--output-len", "12",
            "--repeats", "1", "--policies", "round_robin,shortest_queue,eldr"]
    r = subprocess.run(base + ["--calibration", str(inputs["calibration"]), "--concurrency", "4,8", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert sorted(doc["cells"]) == ["4", "8"] and "| eldr |" in r.stdout
    r = subprocess.run(base + ["--calibration", str(inputs["calibration"]), "--json", str(out)], capture_output=True, text=True)
    assert r.returncode != 0 and "exists" in r.stderr
    r = subprocess.run(base + ["--calibration", str(inputs["calibration"]), "--workers", "3"], capture_output=True, text=True)
    assert r.returncode == 2 and "not 3" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(base + ["--calibration", str(tmp_path / "none.json")], capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_eldr_simulate_on_the_calibrated_cpu(inputs, tmp_path):
    base = ["simulate", "--trace", str(inputs["trace"]), "--centroids", str(inputs["centroids"]), "--model",
            str(inputs["model_dir"]), "--hardware", "cpu", "--concurrency", "8", "--output-len", "12",
            "--policies", "round_robin,eldr", "--no-progress"]
    r = _eldr(*base, "--calibration", str(inputs["calibration"]), "--json", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["meta"]["model"]["hardware"] == "cpu" and doc["meta"]["model"]["calibrated_step"] is True
    r = _eldr(*base)  # the cpu profile has no roofline constants: a calibration is required
    assert r.returncode != 0 and "needs a calibration with the non-MoE step time" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_measured_step_times_each_prefill_from_its_prompts_routing(inputs):
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cost_model import ExecutionModel, load_calibration
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.traces import load_trace

    t = load_trace(inputs["strong"])
    replay = TraceReplay(t)
    dist = replay.prompt_distinct()
    want = np.array([[len(np.unique(t.prefill_ids(r)[:, layer])) for layer in range(4)] for r in range(t.num_requests)])
    assert (dist == want).all() and dist.max() <= 8  # a domain's prompt stays on its 8 experts
    model = get_model(inputs["model_dir"])
    em = ExecutionModel(model, get_hardware("cpu"), calibration=load_calibration(inputs["calibration"], model.name, "cpu",
                                                                                   profile=model))
    # 24 tokens: other_s held at B=16 (6.2 ms) + 4 layers x (a + b x the prompt's distinct experts)
    assert em.prefill_time(24, dist[0]) == pytest.approx(6.2e-3 + 4 * 0.3e-3 + 0.75e-3 * dist[0].sum())
    assert em.prefill_time(24, dist[0]) < em.prefill_time(24)  # the uniform-routing bound touches ~31 of 32


def test_step_terms_compares_each_term_with_logged_steps(inputs):
    from types import SimpleNamespace

    # steps of batch 4 every 40 ms, touching 6 experts per layer, 20 ms of it inside the MoE
    steps = [SimpleNamespace(t0=0.040 * i, tokens=4, distinct=(6, 6, 6, 6), moe_s=0.020) for i in range(8)]
    steps.append(SimpleNamespace(t0=5.0, tokens=2, distinct=(5, 5, 5, 5), moe_s=0.01))  # too few steps of B=2
    out = real_cpu_sim.step_terms(steps, inputs["calibration"], inputs["model_dir"])
    assert list(out) == [4]
    r = out[4]
    assert r["steps"] == 8 and r["moe_measured_ms"] == pytest.approx(20.0)
    assert r["moe_model_ms"] == pytest.approx((4 * 0.3e-3 + 0.75e-3 * 24) * 1e3)  # 4 layers x (a + b x 6)
    assert r["moe_model_error"] == pytest.approx(19.2 / 20 - 1)
    # gaps: 40 - 20 = 20 ms each; the last B=4 step's gap (to t=5 s) is idle time, left out
    assert r["other_measured_ms"] == pytest.approx(20.0) and r["other_model_ms"] == pytest.approx(3.8)
    assert r["other_model_error"] == pytest.approx(3.8 / 20 - 1)
