"""Runs that would need more memory than there is are refused up front with one line (exit 1),
and a MemoryError that gets past the estimates is one line too, never a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eldr_sglang import memory
from eldr_sglang.cli import main as eldr


def _trace(path, R: int, L: int, E: int):
    ids = np.zeros((2 * R, L, 1), np.int32)
    np.savez(path, expert_ids=ids, req_offsets=np.arange(0, 2 * R + 1, 2, dtype=np.int64),
             prefill_len=np.ones(R, np.int32),
             meta_json=np.array(json.dumps({"format": "eldr-trace", "version": 1, "model": "toy", "num_layers": L,
                                            "num_experts": E, "top_k": 1})))
    return path


def _refused(capsys, argv, what):
    assert eldr(argv) == 1
    err = capsys.readouterr().err
    assert f"{what} needs at least" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_synth_beyond_memory_is_refused_before_generating(tmp_path, capsys):
    out = tmp_path / "t.npz"
    err = _refused(capsys, ["synth", "--model", "deepseek-v3", "--requests", "100000000", "--out", str(out), "--format", "v1"],
                   "synth of 100000000 requests")
    assert "TiB" in err and not out.exists()
    _refused(capsys, ["synth", "--model", "gpt-oss-20b", "--requests", "1000", "--out", str(out), "--max-memory", "16M"],
             "synth of 1000 requests")
    assert not out.exists()


def test_demo_beyond_the_limit_is_refused(tmp_path, capsys):
    _refused(capsys, ["demo", "--out", str(tmp_path / "d"), "--requests", "100000", "--max-memory", "64M"],
             "demo of 100000 requests")
    assert not (tmp_path / "d").exists()


def test_fit_with_a_million_experts_is_refused_up_front(tmp_path, capsys):
    # 2,000 one-token requests of 64 layers x 2^20 experts: the dense signatures alone are
    # 2000 x 32 x 2^20 x 4 bytes = 250 GiB
    t = _trace(tmp_path / "t.npz", 2000, 64, 1 << 20)
    err = _refused(capsys, ["fit", str(t), "--workers", "2", "--out", str(tmp_path / "c.eldr"), "-q"],
                   "fit of 2000 requests x 32 layers x 1048576 experts")
    assert "GiB" in err
    small = _trace(tmp_path / "s.npz", 100, 2, 1 << 16)
    _refused(capsys, ["fit", str(small), "--workers", "2", "--out", str(tmp_path / "c.eldr"), "-q", "--max-memory", "8M"],
             "fit of 100 requests x 2 layers x 65536 experts")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz", "t.npz"]


def test_simulate_beyond_the_limit_is_refused(tmp_path, capsys):
    t = _trace(tmp_path / "t.npz", 50, 2, 8)
    _refused(capsys, ["simulate", "--trace", str(t), "--policies", "random", "--requests", "100000000",
                      "--max-memory", "1G", "--json", str(tmp_path / "r.json")], "simulation of 100000000 requests")
    assert not (tmp_path / "r.json").exists()


def test_a_memory_error_is_one_line(monkeypatch, capsys):
    from eldr_sglang.cli import synth

    def boom(args):
        raise MemoryError

    monkeypatch.setattr(synth, "run", boom)
    assert eldr(["synth", "--model", "gpt-oss-20b", "--requests", "1", "--out", "x.npz"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "eldr synth: error: out of memory; use smaller sizes"


def test_sizes_and_estimates(tmp_path):
    assert memory.parse_size("512M") == 512 << 20 and memory.parse_size("1.5g") == 3 << 29 and memory.parse_size("100") == 100
    for bad in ("", "-1", "0", "x", "1e400", "5Q"):
        with pytest.raises(ValueError):
            memory.parse_size(bad)
    t = _trace(tmp_path / "t.npz", 10, 3, 4)
    s = memory.trace_shape(t)
    assert (s.tokens, s.layers, s.top_k, s.id_bytes, s.requests) == (20, 3, 1, 4, 10)
    assert memory.trace_shape(tmp_path / "missing.npz") is None
    avail = memory.available_bytes()
    assert avail is None or avail > 0
