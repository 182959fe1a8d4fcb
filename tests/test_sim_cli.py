"""`eldr simulate` and `eldr demo` end to end on small inputs."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from eldr_sglang.traces import save_trace

from _sim_helpers import quick_fit

pytest.importorskip("eldr_sglang._core")


def _run(argv):
    from eldr_sglang.cli import demo, simulate

    p = argparse.ArgumentParser(prog="eldr")
    sub = p.add_subparsers(dest="command")
    simulate.register(sub)
    demo.register(sub)
    args = p.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def small_files(gptoss_trace, tmp_path_factory):
    d = tmp_path_factory.mktemp("sim")
    t = gptoss_trace.subset(np.arange(0, 703, 6))
    save_trace(t, d / "t.npz")
    quick_fit(t, 3, d / "c.eldr")
    return d / "t.npz", d / "c.eldr"


def test_list_profiles(capsys):
    assert _run(["simulate", "--list-profiles"]) == 0
    out = capsys.readouterr().out
    for name in ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v2-lite", "h100", "h200", "mi300x"):
        assert name in out


def test_simulate_json_and_plot(small_files, tmp_path, capsys):
    trace, cent = small_files
    js, png = tmp_path / "o.json", tmp_path / "o.png"
    rc = _run(["simulate", "--trace", str(trace), "--centroids", str(cent), "--policies", "random,shortest_queue,eldr,oracle",
               "--concurrency", "12", "--hardware", "h100", "--json", str(js), "--plot", str(png), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "paper check" in out and "eldr" in out
    obj = json.loads(js.read_text())
    assert set(obj["policies"]) == {"random", "shortest_queue", "eldr", "oracle"}
    for m in obj["policies"].values():
        for key in ("tpot_ms", "ttft_ms"):
            assert set(m[key]) >= {"mean", "p50", "p99"}
            assert all(np.isfinite(v) and v > 0 for v in m[key].values())
        assert m["throughput_tok_s"] > 0 and m["unique_experts_per_layer_step"] > 0
        assert m["completed"] == m["requests"] == 118
    assert obj["meta"]["workers"] == 3
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 1000


def test_simulate_load_sweep(small_files, tmp_path):
    trace, _ = small_files
    js = tmp_path / "s.json"
    rc = _run(["simulate", "--trace", str(trace), "--policies", "round_robin,power_of_two", "--workers", "2",
               "--rate", "50,200", "--output-len", "20", "--json", str(js), "--no-progress"])
    assert rc == 0
    obj = json.loads(js.read_text())
    assert [r["load"]["value"] for r in obj["sweep"]] == [50.0, 200.0]
    # more load, no lower TPOT
    t = [r["policies"]["round_robin"]["tpot_ms"]["p50"] for r in obj["sweep"]]
    assert t[1] >= t[0]


@pytest.mark.parametrize("argv, msg", [
    (["--policies", "eldr"], "needs --centroids"),
    (["--model", "deepseek-v3", "--policies", "random"], "pass the matching --model"),
])
def test_simulate_errors_are_clear(small_files, argv, msg):
    trace, _ = small_files
    with pytest.raises(ValueError, match=msg):
        _run(["simulate", "--trace", str(trace), "--no-progress", *argv])


@pytest.mark.parametrize("argv, msg", [
    (["--policies", "fastest"], "unknown policy"),
    (["--policies", "random", "--concurrency", "0"], "--concurrency: must be an integer 1.."),
])
def test_simulate_bad_flags_stop_argparse(small_files, argv, msg, capsys):
    trace, _ = small_files
    with pytest.raises(SystemExit) as exc:
        _run(["simulate", "--trace", str(trace), "--no-progress", *argv])
    assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_simulate_missing_trace_is_one_line_error(tmp_path, capsys):
    from eldr_sglang.cli import main

    rc = main(["simulate", "--trace", str(tmp_path / "nope.npz")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "trace file not found" in err and "Traceback" not in err


def test_demo_small(tmp_path, capsys):
    pytest.importorskip("eldr_sglang.offline.fit")
    pytest.importorskip("eldr_sglang.traces.synth")
    out = tmp_path / "demo"
    rc = _run(["demo", "--out", str(out), "--model", "gpt-oss-20b", "--hardware", "h100", "--workers", "2",
               "--requests", "90", "--output-len", "12", "--concurrency", "4,8", "--no-progress"])
    assert rc == 0
    obj = json.loads((out / "results.json").read_text())
    assert {"random", "shortest_queue", "eldr", "oracle"} <= set(obj["policies"])
    assert len(obj["sweep"]) == 2
    assert (out / "centroids.eldr").exists() and (out / "results.md").exists()
    assert "ELDR demo" in capsys.readouterr().out


def test_simulate_strict_protocol(tmp_path, capsys):
    from test_sim_policies import two_domain_trace

    t = two_domain_trace(n_per_block=8, blocks=8)
    save_trace(t, tmp_path / "two.npz")
    base = ["simulate", "--trace", str(tmp_path / "two.npz"), "--protocol", "strict", "--workers", "2", "--no-progress"]
    rc = _run(base + ["--concurrency", "8", "--splits", "1", "--policies", "round_robin,shortest_queue,eldr/0.05,locality/0.05",
                      "--json", str(tmp_path / "s.json")])
    assert rc == 0
    out = capsys.readouterr().out
    for lab in ("| eldr/0.05 | default |", "| locality/0.05 | default |", "| perfect_overlap | default |", "| clairvoyant/0.05 | default |"):
        assert lab in out
    recs = json.loads((tmp_path / "s.json").read_text())["records"]
    assert {r["cell"] for r in recs} == {"shuffle,closed@4/worker,fixed", "shuffle,open@0.85xcap,fixed",
                                         "trace,closed@4/worker,fixed", "trace,open@0.85xcap,fixed"}
    assert all(r["policies"]["_workload"]["requests"] >= 2000 for r in recs)
    for argv, msg in ((["--centroids", "x.eldr"], "fits its own centroids"), (["--requests", "100"], "--requests >= 2000"),
                      (["--order", "shuffle"], "sets arrivals")):
        with pytest.raises(ValueError, match=msg):
            _run(base + argv)
    with pytest.raises(ValueError, match="needs --protocol strict"):
        _run(["simulate", "--trace", str(tmp_path / "two.npz"), "--cost-model", "band", "--policies", "random"])
