"""Readers of trace v2 beside v1: `eldr synth` with one seed writes the same routing in both
formats, so the simulator, drift-check, refit, the strict protocol's fits and the emulator's
prefill payload must give the same results from either file. A v2 file that keeps decode
routing of only some requests replays those."""

from __future__ import annotations

import json

import numpy as np
import pytest

core = pytest.importorskip("eldr_sglang._core", reason="the Rust extension is not built")

from eldr_sglang.cli import main as eldr  # noqa: E402
from eldr_sglang.sim.replay import TraceReplay  # noqa: E402
from eldr_sglang.traces import TraceError, open_trace  # noqa: E402

SYNTH = ["--model", "gpt-oss-20b", "--requests", "240", "--seed", "11", "--prompt-len", "6,30", "--output-len", "3,9",
         "--no-progress"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("v2readers")
    v1, v2, part = d / "t1.npz", d / "t2.npz", d / "t2part.npz"
    assert eldr(["synth", *SYNTH, "--format", "v1", "--out", str(v1)]) == 0
    assert eldr(["synth", *SYNTH, "--keep-decode", "all", "--out", str(v2)]) == 0
    assert eldr(["synth", *SYNTH, "--keep-decode", "90", "--out", str(part)]) == 0
    cent = d / "c.eldr"
    assert eldr(["fit", str(v1), "--workers", "3", "--out", str(cent), "-q", "--restarts", "1"]) == 0
    return v1, v2, part, cent


def _without_paths(obj):
    if isinstance(obj, dict):
        return {k: _without_paths(v) for k, v in obj.items() if k not in ("trace", "trace_path", "sim_wall_s")}  # paths, and the simulator's own run time
    if isinstance(obj, list):
        return [_without_paths(v) for v in obj]
    return obj


def test_replay_of_v2_equals_replay_of_v1(files):
    v1, v2, _, cent = files
    t1 = open_trace(v1)
    with open_trace(v2) as t2:
        a, b = TraceReplay(t1), TraceReplay(t2)
        assert b.is_counts and not a.is_counts and a.num_requests == b.num_requests == 240
        np.testing.assert_array_equal(a.prompt_len, b.prompt_len)
        np.testing.assert_array_equal(a.dec_len, b.dec_len)
        np.testing.assert_array_equal(a.recorded_output_len, b.recorded_output_len)
        np.testing.assert_array_equal(a.step_ids(np.arange(240), np.arange(240) % 3), b.step_ids(np.arange(240), np.arange(240) % 3))
        spec = core.CentroidSet.open(str(cent)).spec()
        (sa, va), (sb, vb) = a.signatures(spec), b.signatures(spec)
        np.testing.assert_array_equal(va, vb)
        np.testing.assert_array_equal(np.asarray(sa).view(np.uint32), np.asarray(sb).view(np.uint32))  # same bits
        for r in (0, 17, 239):
            np.testing.assert_array_equal(a.prompt_counts_of(r), b.prompt_counts_of(r))
            np.testing.assert_array_equal(a.signature(spec, r), b.signature(spec, r))
        with pytest.raises(TraceError, match="prompt counts"):
            b.prefill_ids(0)


def test_simulate_gives_the_same_result_from_v1_and_v2(files, tmp_path, capsys):
    v1, v2, _, cent = files
    out = {}
    for name, path in (("v1", v1), ("v2", v2)):
        js = tmp_path / f"{name}.json"
        assert eldr(["simulate", "--trace", str(path), "--centroids", str(cent), "--policies",
                     "random,shortest_queue,eldr,locality/0.05", "--concurrency", "12", "--hardware", "h100",
                     "--json", str(js), "--no-progress", "--seed", "4"]) == 0
        out[name] = _without_paths(json.loads(js.read_text()))
    assert "replaying the 240 of its 240 requests" in capsys.readouterr().err
    assert out["v1"] == out["v2"]
    assert out["v1"]["policies"]["eldr"]["completed"] == 240


def test_simulate_replays_the_requests_that_kept_decode_routing(files, tmp_path, capsys):
    _, _, part, cent = files
    js = tmp_path / "p.json"
    assert eldr(["simulate", "--trace", str(part), "--centroids", str(cent), "--policies", "random,eldr",
                 "--concurrency", "6", "--json", str(js), "--no-progress"]) == 0
    assert "replaying the 90 of its 240 requests" in capsys.readouterr().err
    assert json.loads(js.read_text())["policies"]["eldr"]["completed"] == 90


def test_drift_check_and_refit_read_v2_like_v1(files, tmp_path, capsys):
    v1, v2, _, cent = files
    runs = {}
    for name, path in (("v1", v1), ("v2", v2)):
        capsys.readouterr()
        assert eldr(["drift-check", str(cent), "--trace", str(path), "--window", "60", "--requests", "20:220", "--json"]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["v1"] == runs["v2"] and len(runs["v1"]["windows"]) == 3
    cents = {}
    for name, path in (("v1", v1), ("v2", v2)):
        outp = tmp_path / f"refit-{name}.eldr"
        assert eldr(["refit", str(cent), "--trace", str(path), "--out", str(outp), "--seed", "2"]) == 0
        cents[name] = np.asarray(core.CentroidSet.open(str(outp)).centroids())
    np.testing.assert_array_equal(cents["v1"], cents["v2"])


def test_strict_protocol_fits_the_same_requests_from_v1_and_v2(files):
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.protocol import Cell, random_splits, run_protocol

    v1, v2, _, _ = files
    em = {"default": ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"))}
    cells = [Cell("trace", "closed", 4.0, "fixed")]
    recs = {}
    t1 = open_trace(v1)
    with open_trace(v2) as t2:
        for name, t in (("v1", t1), ("v2", t2)):
            recs[name] = run_protocol(TraceReplay(t), em, 3, cells, random_splits(240, 1, 5), policies="random,eldr/0.05",
                                      bounds=False, requests=2000, seed=1)
    assert recs["v1"] == recs["v2"] and len(recs["v1"]) == 1


def test_emulator_prefill_payload_is_the_same_from_v1_and_v2(files):
    from eldr_sglang.emulate.workers import PrefillWorker, WorkerSpec

    v1, v2, _, _ = files
    t1 = open_trace(v1)
    with open_trace(v2) as t2:
        p1, p2 = (PrefillWorker(WorkerSpec(trace=t, model="gpt-oss-20b")) for t in (t1, t2))
        for r in (0, 5, 239):
            assert p1.payload(r) == p2.payload(r)
