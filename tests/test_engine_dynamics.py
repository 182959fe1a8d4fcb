"""benchmarks/engine_dynamics.py: on a constructed step log with known stalls it finds the
stall share, the per-batch figures and the imbalance between two servers."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import engine_dynamics as ed  # noqa: E402

FIT = {"fixed_s": 0.010, "per_request_s": 0.002, "per_expert_s": 0.0}  # a batch-2 step: 14 ms


def _log(path: Path, batches, stall_every: int, stall_s: float, t0: float = 100.0) -> float:
    """One line per MoE layer (1 layer); every stall_every-th step lasts stall_s longer."""
    t = t0
    with open(path, "w") as fh:
        for i, b in enumerate(batches):
            fh.write(f"{t:.6f} 0 {b} 3 1000\n")
            t += FIT["fixed_s"] + FIT["per_request_s"] * b + (stall_s if stall_every and i % stall_every == 0 else 0.0)
    return t


def _setting(tmp_path, b0, b1, stall_every=0, stall_s=0.0):
    logs = [tmp_path / "d0.steps", tmp_path / "d1.steps"]
    end = max(_log(logs[0], b0, stall_every, stall_s), _log(logs[1], b1, 0, 0.0))
    exp = tmp_path / "experiment.json"
    exp.write_text(json.dumps({"blocks": [{"arm": "round_robin", "block": 0, "complete": True, "start_unix_s": 100.0,
                                           "end_unix_s": end, "n": 5, "requests": 5, "inflight": 0, "warmup_n": 0,
                                           "tpot_p50_s": 0.01, "tpot_mean_s": 0.01}]}))
    return {"step_logs": [str(p) for p in logs], "layers": 1, "clock_offset_s": 0.0, "experiment": str(exp),
            "arms": ["round_robin"], "block_s": 2}


def test_stalls_are_found_and_priced(tmp_path):
    s = _setting(tmp_path, [2] * 200, [2] * 200, stall_every=10, stall_s=0.1)
    res = ed.analyse_setting(s, FIT)
    srv0, srv1 = res["stalls"]["per_server"]
    # 20 stalls of 100 ms in 200 x 14 ms + 2 s: excess share 2 / 4.8
    assert srv0["stall_share_of_time"] == pytest.approx(2.0 / 4.8, rel=0.02)
    assert srv0["excess_p50_ms"] == pytest.approx(100.0, rel=1e-3)
    assert srv1["stall_share_of_time"] == 0.0 and srv1["stalls_per_s"] == 0.0
    row = res["by_batch"][0]
    assert row["batch"] == 2 and row["stall_share"] == pytest.approx(20 / 398, rel=0.05)
    assert row["per_request_ms"] == pytest.approx(row["mean_ms"] / 2)


def test_shrinking_batches_are_left_out_as_possible_idle(tmp_path):
    s = _setting(tmp_path, [3, 3, 1, 1, 1] * 30, [2] * 150)
    servers = ed.server_steps(s)
    # each [3, 3, 1, 1, 1]: the second 3's interval ends at batch 1 and is left out
    assert int((servers[0]["batch"] == 3).sum()) == 30 and int((servers[0]["batch"] == 1).sum()) == 89


def test_imbalance_by_second_reads_the_two_servers_batches(tmp_path):
    s = _setting(tmp_path, [6] * 400, [2] * 400)
    imb = ed.analyse_setting(s, FIT)["imbalance_by_second"]["round_robin"]
    assert len(imb) == 2 and all(x == pytest.approx(4.0, abs=0.05) for x in imb)


def test_cli_refuses_to_overwrite_and_missing_run(tmp_path, capsys):
    out = tmp_path / "o.json"
    out.write_text("{}")
    with pytest.raises(SystemExit):
        ed.main(["--run", str(tmp_path), "--json", str(out)])
    assert "exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ed.main(["--run", str(tmp_path / "nope")])
    assert "does not exist" in capsys.readouterr().err
