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
