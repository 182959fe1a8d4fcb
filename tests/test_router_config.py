"""Router command line and /v1/loads parsing (no network; request validation is the data plane's,
checked over HTTP in test_e2e_pd)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")

from eldr_sglang.router.config import ConfigError, parse_config  # noqa: E402
from eldr_sglang.router.loads import running_from_loads  # noqa: E402

BASE = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "8998", "--prefill", "http://127.0.0.1:2", "none",
        "--prefill", "http://127.0.0.1:3", "--decode", "http://127.0.0.1:4", "--decode", "http://127.0.0.1:5/"]


def test_sglang_router_style_flags():
    cfg = parse_config(BASE + ["--disagg-router", "shortest_queue", "--port", "8000"])
    assert [(w.url, w.bootstrap_port, w.host) for w in cfg.prefill] == [
        ("http://127.0.0.1:1", 8998, "127.0.0.1"), ("http://127.0.0.1:2", None, "127.0.0.1"),
        ("http://127.0.0.1:3", None, "127.0.0.1")]
    assert cfg.decode == ["http://127.0.0.1:4", "http://127.0.0.1:5"]
    assert cfg.policy == "shortest_queue" and cfg.port == 8000 and not cfg.late_binding
    cfg = parse_config(BASE + ["--decode-policy", "eldr", "--eldr-centroids", "c.eldr", "--eldr-tau", "0.2"])
    assert cfg.policy == "eldr" and cfg.late_binding and cfg.tau == 0.2
    assert parse_config(BASE + ["--disagg-router", "random", "--eldr-bind", "late"]).late_binding
    assert parse_config(BASE + ["--eldr-centroids", "c.eldr", "--eldr-load-factor", "0.2"]).load_factor == 0.2
    assert parse_config(BASE + ["--eldr-centroids", "c.eldr"]).load_factor == 0.05  # bounded by default
    assert parse_config(BASE + ["--eldr-centroids", "c.eldr", "--eldr-load-factor", "none"]).load_factor is None


@pytest.mark.parametrize("argv,match", [
    (BASE[1:], "--pd-disaggregation is required"),
    (BASE, "needs --eldr-centroids"),
    (["--pd-disaggregation", "--decode", "http://h:1"], "at least one --prefill"),
    (["--pd-disaggregation", "--prefill", "h:1", "--decode", "http://h:1"], "expected a URL"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "x", "--decode", "http://h:1"], "not a number"),
    (BASE + ["--disagg-router", "random", "--eldr-tau", "-1"], "--eldr-tau"),
    (BASE + ["--disagg-router", "random", "--eldr-load-factor", "-0.5"], "--eldr-load-factor"),
    (["--pd-disaggregation", "--prefill", "https://h:1", "--decode", "http://h:2"], "plain http:// to workers only"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "https://h:2"], "plain http:// to workers only"),
    # one worker given twice would be counted as two (twice the traffic, a wrong K for the centroid file)
    (BASE + ["--disagg-router", "random", "--decode", "http://127.0.0.1:4"], "--decode: 'http://127.0.0.1:4' twice"),
    (BASE + ["--disagg-router", "random", "--decode", "http://127.0.0.1:4/"], "--decode: 'http://127.0.0.1:4' twice"),
    (["--pd-disaggregation", "--prefill", "http://h:1", "--decode", "http://Dec:2", "--decode", "http://dec:2",
      "--disagg-router", "random"], "--decode: 'http://Dec:2' and 'http://dec:2', the same worker"),
    (["--pd-disaggregation", "--prefill", "http://h", "--prefill", "http://h:80/", "--decode", "http://h:2",
      "--disagg-router", "random"],
     "--prefill: 'http://h' and 'http://h:80', the same worker"),
])
def test_bad_command_lines_are_explained(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(argv)


def test_launch_router_reports_errors_without_traceback(tmp_path):
    bad = tmp_path / "bad.eldr"
    bad.write_bytes(b"not a centroid file")
    p = subprocess.run([sys.executable, "-m", "eldr_sglang.launch_router", *BASE, "--eldr-centroids", str(bad),
                        "--port", "1"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr and "error" in p.stderr


def test_launch_router_refuses_a_centroid_file_whose_baseline_does_not_fit(tmp_path):
    """Drift baseline shares for 3 workers in a file for 2: the router stops at start with one line
    naming the file, instead of serving with a drift monitor that can never match a decision."""
    import json

    import numpy as np

    from eldr_sglang import _core

    bad = tmp_path / "bad_shares.eldr"
    prov = {"baseline": {"mean_d_star": 0.1, "std_d_star": 0.05, "nearest_share": [0.3, 0.3, 0.4]}}
    _core.write_centroids(str(bad), np.eye(2, 8, dtype=np.float32), np.ones(1, np.float32), np.ones((1, 8), np.float32),
                          0.1, None, json.dumps(prov))
    argv = [*BASE, "--disagg-router", "eldr", "--eldr-centroids", str(bad), "--port", "1"]
    p = subprocess.run([sys.executable, "-m", "eldr_sglang.launch_router", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"launch_router: error: centroid file {bad}: its drift baseline is unusable"), p.stderr
    assert "nearest_share has 3 entries for K=2 workers" in last and "--no-eldr-drift" in last
    # as the message says: without drift handling the file routes (the app builds)
    from eldr_sglang.router.app import build_app
    from eldr_sglang.router.config import parse_config

    build_app(parse_config(argv + ["--no-eldr-drift"]))


def test_running_from_v1_loads():
    body = {"loads": [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": 100,
         "disaggregation": {"mode": "decode", "decode_prealloc_queue_reqs": 2, "decode_transfer_queue_reqs": 1}},
        {"dp_rank": 1, "num_running_reqs": 4, "num_waiting_reqs": 0, "num_used_tokens": 50},
    ]}
    assert running_from_loads(body) == 11
    with pytest.raises(ValueError):
        running_from_loads({"nope": 1})


@pytest.mark.parametrize("flags,match", [
    (["--port", "70000"], "--port"),
    (["--port", "0"], "--port"),
    (["--max-payload-size", "-1"], "--max-payload-size"),
    (["--eldr-signature-timeout-secs", "nan"], "--eldr-signature-timeout-secs"),
    (["--eldr-signature-timeout-secs", "inf"], "--eldr-signature-timeout-secs"),
    (["--request-timeout-secs", "-1"], "--request-timeout-secs"),
    (["--request-timeout-secs", "1e300"], "--request-timeout-secs"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--health-check-interval-secs", "nan"], "--health-check-interval-secs"),
    (["--health-failure-threshold", "0"], "--health-failure-threshold"),
    (["--load-monitor-interval", "-0.5"], "--load-monitor-interval"),
    (["--eldr-reload-interval-ms", "-5"], "--eldr-reload-interval-ms"),
    (["--eldr-load-report-ttl-ms", str(10**18)], "--eldr-load-report-ttl-ms"),
    (["--eldr-tau", "nan"], "--eldr-tau"),
    (["--eldr-load-factor", "nan"], "--eldr-load-factor"),
    (["--eldr-load-factor", "inf"], "--eldr-load-factor"),
    (["--prometheus-port", "99999"], "--prometheus-port"),
    (["--worker-startup-timeout-secs", "-3"], "--worker-startup-timeout-secs"),
    (["--first-byte-timeout-secs", "0"], "--first-byte-timeout-secs"),
    (["--decode-progress-timeout-secs", "nan"], "--decode-progress-timeout-secs"),
    (["--stall-timeout-secs", "nan"], "--stall-timeout-secs"),
    (["--upstream-connect-timeout-secs", "-1"], "--upstream-connect-timeout-secs"),
    (["--retries", "-1"], "--retries"),
    (["--eject-after-failures", "0"], "--eject-after-failures"),
    (["--eject-base-secs", "10", "--eject-max-secs", "5"], "--eject-max-secs"),
    (["--client-header-timeout-secs", "0"], "--client-header-timeout-secs"),
    (["--client-body-timeout-secs", "inf"], "--client-body-timeout-secs"),
    (["--admin-token", "short"], "at least 16"),
])
def test_every_numeric_router_flag_is_range_checked(flags, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(BASE + ["--disagg-router", "random", *flags])


def test_flag_defaults_are_sane():
    cfg = parse_config(BASE + ["--disagg-router", "random"])
    assert cfg.max_payload_size == 8 << 20  # not 512 MiB
    assert 0 < cfg.first_byte_timeout_s < cfg.request_timeout_s and 0 < cfg.stall_timeout_s < cfg.request_timeout_s
    assert cfg.admin_token is None and cfg.retries >= 1 and cfg.eject_after_failures >= 2
    # 0 still means off where it always did
    cfg = parse_config(BASE + ["--disagg-router", "random", "--health-check-interval-secs", "0", "--load-monitor-interval", "0"])
    assert cfg.health_check_interval_s == 0 and cfg.load_monitor_interval_s == 0


def test_admin_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("ELDR_ADMIN_TOKEN", "x" * 32)
    assert parse_config(BASE + ["--disagg-router", "random"]).admin_token == "x" * 32


@pytest.mark.parametrize("flags", [["--port", "70000"], ["--max-payload-size", "-1"], ["--eldr-signature-timeout-secs", "nan"]])
def test_launch_router_refuses_bad_numbers_before_anything_runs(flags):
    p = subprocess.run([sys.executable, "-m", "eldr_sglang.launch_router", *BASE, "--disagg-router", "random", *flags],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and flags[0] in p.stderr, p.stderr


@pytest.mark.parametrize("body", [
    {"loads": [{"num_running_reqs": float("inf")}]},
    {"loads": [{"num_running_reqs": 1e30}]},
    {"loads": [{"num_running_reqs": -5}]},
    {"loads": [{"num_running_reqs": float("nan")}]},
    {"loads": [{"num_running_reqs": "3"}]},
    {"loads": [{"num_running_reqs": 2.5}]},
    [1, 2],
    "text",
])
def test_running_from_loads_refuses_bad_values(body):
    with pytest.raises(ValueError):
        running_from_loads(body)


def test_programmatic_router_config_is_checked_too():
    from eldr_sglang.router.config import PrefillWorker, RouterConfig

    kw = dict(prefill=[PrefillWorker("http://127.0.0.1:1", None, "127.0.0.1")], decode=["http://127.0.0.1:2"])
    assert RouterConfig(**kw).stall_timeout_s > 0
    with pytest.raises(ConfigError, match="--stall-timeout-secs"):
        RouterConfig(**kw, stall_timeout_s=float("nan"))
    with pytest.raises(ConfigError, match="--port"):
        RouterConfig(**kw, port=70000)


def test_the_data_plane_numbers_have_one_check():
    """The data plane's numeric settings are checked by rust/dataplane/src/config.rs alone, in
    the command line's words; the Python table holds only the control plane's own."""
    import json

    from eldr_sglang import _core
    from eldr_sglang.router import config
    from eldr_sglang.router.config import UNSTARTED_CONTROL_URL, plane_config

    plane_keys = set(json.loads(plane_config(parse_config(BASE + ["--disagg-router", "random"]), UNSTARTED_CONTROL_URL)))
    assert not plane_keys & {attr for attr, *_ in config._NUMERIC_FLAGS.values()}
    with pytest.raises(ValueError, match=r"^--max-payload-size must be between 1 and 2\.14748e\+09, got -1$"):
        _core.DataPlane.check_numbers(json.dumps({"max_payload_size": -1}))
    with pytest.raises(ConfigError, match=r"^--stall-timeout-secs must be a finite number, got nan$"):
        parse_config(BASE + ["--disagg-router", "random", "--stall-timeout-secs", "nan"])
    with pytest.raises(ConfigError, match=r"^--eject-max-secs \(5\) must be >= --eject-base-secs \(10\)$"):
        parse_config(BASE + ["--disagg-router", "random", "--eject-base-secs", "10", "--eject-max-secs", "5"])


def test_health_checks_are_counted_by_the_data_plane_worker_set():
    """`--health-failure-threshold` failed checks in a row mark a worker down, one pass brings
    it back; the counting lives in the core worker set, which `routable` and /eldr/status read."""
    from eldr_sglang import _core
    from eldr_sglang.router.config import UNSTARTED_CONTROL_URL, plane_config

    cfg = parse_config(BASE + ["--disagg-router", "random"])
    router = _core.Router(policy="random", num_workers=len(cfg.decode))
    dp = _core.DataPlane(plane_config(cfg, UNSTARTED_CONTROL_URL), router)
    for _ in range(2):
        dp.health_check("decode", 1, False, 3)
    assert dp.routable("decode") == [True, True] and router.healthy() == [True, True]
    dp.health_check("decode", 1, True, 3)  # a pass resets the count
    for _ in range(2):
        dp.health_check("decode", 1, False, 3)
    assert dp.routable("decode") == [True, True]
    dp.health_check("decode", 1, False, 3)
    assert dp.routable("decode") == [True, False] and router.healthy() == [True, False]
    assert [w["health_ok"] for w in dp.workers("decode")] == [True, False]
    dp.health_check("decode", 1, True, 3)
    assert dp.routable("decode") == [True, True] and router.healthy() == [True, True]
    dp.health_check("prefill", 2, False, 1)
    assert dp.routable("prefill") == [True, True, False]
    with pytest.raises(ValueError, match="decode worker 2 out of range"):
        dp.health_check("decode", 2, True, 3)
