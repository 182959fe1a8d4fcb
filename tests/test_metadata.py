"""Trace meta_json and centroid-file provenance of the wrong shape give a ValueError naming the
field (not an AttributeError, TypeError or a 192 GiB allocation); a drift baseline for another
number of workers than the file's K is rejected, not used as if it fit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eldr_sglang import _core
from eldr_sglang.cli import main as eldr
from eldr_sglang.drift.monitor import DriftMonitor, baseline_from_provenance
from eldr_sglang.traces import TraceError, load_trace

GOOD = {"format": "eldr-trace", "version": 1, "model": "toy", "num_layers": 2, "num_experts": 4, "top_k": 1}


def _npz(path, meta_json: str):
    ids = np.zeros((4, 2, 1), np.int16)
    np.savez(path, expert_ids=ids, req_offsets=np.array([0, 2, 4], np.int64), prefill_len=np.array([1, 1], np.int32),
             meta_json=np.array(meta_json))
    return path


@pytest.mark.parametrize(
    "meta_json, message",
    [
        ("[1, 2]", "meta_json must be a JSON object, got a list"),
        ('"text"', "meta_json must be a JSON object, got a string"),
        ("null", "meta_json must be a JSON object, got null"),
        (json.dumps({**GOOD, "num_experts": None}), "meta_json.num_experts must be an integer, got null"),
        (json.dumps({**GOOD, "num_experts": 2**31}), "meta_json.num_experts = 2147483648 is out of range 1..1048576"),
        (json.dumps({**GOOD, "num_experts": "4"}), "meta_json.num_experts must be an integer, got a string"),
        (json.dumps({**GOOD, "num_layers": [2]}), "meta_json.num_layers must be an integer, got a list"),
        (json.dumps({**GOOD, "top_k": 1.5}), "meta_json.top_k must be an integer, got a number"),
        (json.dumps({**GOOD, "top_k": True}), "meta_json.top_k must be an integer, got a boolean"),
        (json.dumps({**GOOD, "top_k": 9}), "meta_json.top_k = 9 is out of range 1..4"),
        (json.dumps({**GOOD, "model": None}), "meta_json.model must be a string, got null"),
        (json.dumps({**GOOD, "version": None}), "meta_json.version must be an integer, got null"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "top_k"}), "meta_json lacks 'top_k'"),
    ],
)
def test_bad_meta_json_names_the_field(tmp_path, meta_json, message, capsys):
    p = _npz(tmp_path / "t.npz", meta_json)
    with pytest.raises(TraceError) as exc:
        load_trace(p)
    assert message in str(exc.value)
    # and through a command: one line, exit 1, no traceback
    assert eldr(["fit", str(p), "--workers", "2", "--out", str(tmp_path / "c.eldr"), "-q"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def _centroids(path, provenance: str, K: int = 4):
    C = np.eye(K, 16, dtype=np.float32) + 0.01
    _core.write_centroids(str(path), C, np.ones(2, np.float32), np.ones((2, 8), np.float32), 0.1, None, provenance)
    return _core.CentroidSet.open(str(path))


BASE = {"mean_d_star": 0.2, "std_d_star": 0.05, "nearest_share": [0.25] * 4}


@pytest.mark.parametrize(
    "provenance, message",
    [
        ("[1, 2]", "provenance must be a JSON object, got a list"),
        ("42", "provenance must be a JSON object, got an integer"),
        (json.dumps({"baseline": [1]}), "provenance.baseline must be a JSON object, got a list"),
        (json.dumps({"baseline": {**BASE, "mean_d_star": None}}), "provenance.baseline.mean_d_star must be a finite number, got null"),
        (json.dumps({"baseline": {**BASE, "std_d_star": "0.1"}}), "provenance.baseline.std_d_star must be a finite number, got a string"),
        (json.dumps({"baseline": {**BASE, "nearest_share": None}}), "provenance.baseline.nearest_share must be a list, got null"),
        (json.dumps({"baseline": {**BASE, "nearest_share": [0.5, None, 0.5, 0]}}), "nearest_share must be a list of numbers"),
        (json.dumps({"baseline": {**BASE, "nearest_share": [0.5, 0.5]}}), "nearest_share has 2 entries for K=4 workers"),
    ],
)
def test_bad_provenance_names_the_field(tmp_path, provenance, message):
    cs = _centroids(tmp_path / "c.eldr", provenance)
    with pytest.raises(ValueError) as exc:
        DriftMonitor.from_centroid_set(cs, window=8)
    assert message in str(exc.value)
    with pytest.raises(ValueError):
        baseline_from_provenance(provenance, num_workers=4)


def test_inspect_and_refit_survive_odd_provenance(tmp_path, capsys):
    for i, prov in enumerate(["[1, 2]", json.dumps({"fit": None, "params": [1], "baseline": {"mean_d_star": None},
                                                    "lineage": "x"})]):
        p = tmp_path / f"c{i}.eldr"
        _centroids(p, prov)
        assert eldr(["inspect", str(p)]) == 0, capsys.readouterr().err
        assert eldr(["inspect", str(p), "--json"]) == 0
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        from eldr_sglang.drift.refit import refit_file

        rng = np.random.default_rng(i)
        S = rng.random((200, 16)).astype(np.float32)
        summary = refit_file(str(p), S, str(tmp_path / f"r{i}.eldr"))
        assert summary["n_signatures"] == 200


def test_a_baseline_for_another_k_is_not_used_on_decisions(tmp_path):
    """A monitor built without K (as the router hook builds it) learns K from the baseline; a
    decision over another number of centroids is counted as mismatched, not observed."""
    cs = _centroids(tmp_path / "c.eldr", json.dumps({"baseline": {**BASE, "nearest_share": [0.5, 0.5]}}))
    m = DriftMonitor(cs.provenance_json, window=8)
    r = _core.Router(policy="eldr", centroids=str(tmp_path / "c.eldr"), reload_interval_ms=0)
    for _ in range(5):
        m.observe_decision(r.route_signature(np.eye(4, 16, dtype=np.float32)[1] + 0.01, explain=True))
    assert m.observations == 0 and m.snapshot()["mismatched"] == 5
