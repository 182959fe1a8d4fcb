"""The discovery flags on the router's command line: smg's names and defaults, the checks (one
line each, exit 2 from launch_router), and the config they make."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")

from eldr_sglang.router.config import ConfigError, build_parser, parse_config  # noqa: E402
from eldr_sglang.router.discovery.pods import parse_selector  # noqa: E402

PD = ["--pd-disaggregation", "--disagg-router", "random"]
SD = PD + ["--service-discovery", "--prefill-selector", "app=sglang", "component=prefill",
           "--decode-selector", "app=sglang", "component=decode", "--kube-api", "http://127.0.0.1:8001"]


@pytest.fixture
def wfile(tmp_path):
    p = tmp_path / "workers.json"
    p.write_text(json.dumps({"prefill": [{"url": "http://p0:30000", "bootstrap_port": 8998}],
                             "decode": [{"url": "http://d0:30001"}]}))
    return str(p)


def test_discovery_flags_make_the_settings(wfile):
    cfg = parse_config(SD + ["--selector", "team=a", "--service-discovery-namespace", "llm",
                             "--service-discovery-port", "30000", "--service-discovery-resync-secs", "5"])
    assert cfg.prefill == [] and cfg.decode == []  # the workers come from discovery
    k = cfg.discovery.kube
    assert k.prefill_selector == {"app": "sglang", "component": "prefill"} and k.selector == {"team": "a"}
    assert k.role_selector("decode") == {"team": "a", "app": "sglang", "component": "decode"}
    assert (k.namespace, k.port, k.resync_s, k.api_url) == ("llm", 30000, 5.0, "http://127.0.0.1:8001")
    assert cfg.discovery.workers_file is None
    cfg = parse_config(PD + ["--workers-file", wfile, "--workers-file-interval", "0.5"])
    assert cfg.discovery.workers_file == wfile and cfg.discovery.file_interval_s == 0.5 and cfg.discovery.kube is None
    # beside the flags
    cfg = parse_config(PD + ["--prefill", "http://h:1", "--decode", "http://h:2", "--workers-file", wfile])
    assert cfg.decode == ["http://h:2"] and cfg.discovery.workers_file == wfile


def test_discovery_flag_defaults_are_smgs():
    a = build_parser().parse_args(["--pd-disaggregation"])
    assert a.service_discovery is False and a.service_discovery_port == 80 and a.service_discovery_namespace is None
    assert a.workers_file_interval == 1.0 and a.service_discovery_resync_secs == 60.0


@pytest.mark.parametrize("extra,match", [
    (["--service-discovery", "--kube-api", "http://k:1"], "needs --prefill-selector and --decode-selector"),
    (["--service-discovery", "--selector", "app=x", "--kube-api", "http://k:1"], "needs --prefill-selector"),
    (["--prefill-selector", "a=b"], "--prefill-selector needs --service-discovery"),
    (["--kube-api", "http://k:1"], "--kube-api needs --service-discovery"),
    (["--service-discovery", "--prefill-selector", "a", "--decode-selector", "b=c", "--kube-api", "http://k:1"],
     "--prefill-selector: expected key=value"),
    (["--service-discovery", "--prefill-selector", "a b=c", "--decode-selector", "b=c", "--kube-api", "http://k:1"],
     "not a Kubernetes label key"),
    (["--service-discovery", "--prefill-selector", "r=p", "--decode-selector", "r=p", "--kube-api", "http://k:1"],
     "select the same pods"),
    (["--service-discovery", "--prefill-selector", "r=p", "--decode-selector", "r=d", "--kube-api", "k8s"],
     "--kube-api 'k8s': expected a URL"),
    (["--service-discovery", "--prefill-selector", "r=p", "--decode-selector", "r=d"], "not running in a Kubernetes pod"),
    (["--service-discovery", "--prefill-selector", "r=p", "--decode-selector", "r=d", "--kube-api", "http://k:1",
      "--service-discovery-port", "0"], "--service-discovery-port must be between 1 and 65535"),
    (["--service-discovery", "--prefill-selector", "r=p", "--decode-selector", "r=d", "--kube-api", "http://k:1",
      "--service-discovery-resync-secs", "nan"], "--service-discovery-resync-secs must be between"),
    (["--workers-file", "/no/such/file.json"], "--workers-file /no/such/file.json: not found"),
    (["--workers-file-interval", "2"], "--workers-file-interval needs --workers-file"),
    ([], "at least one --prefill and one --decode worker are needed (or a discovery source"),
])
def test_discovery_bad_flags_are_one_line(extra, match, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")) as e:
        parse_config(PD + extra)
    assert "\n" not in str(e.value)


def test_discovery_workers_file_interval_is_checked(wfile):
    for bad in ("0", "-1", "inf", "1e9"):
        with pytest.raises(ConfigError, match="--workers-file-interval must be between"):
            parse_config(PD + ["--workers-file", wfile, "--workers-file-interval", bad])


def test_discovery_selector_words():
    assert parse_selector(["app=sglang", "component=prefill"], "f") == {"app": "sglang", "component": "prefill"}
    assert parse_selector(["app=sglang,component==prefill"], "f") == {"app": "sglang", "component": "prefill"}
    assert parse_selector(["sglang.ai/role=prefill", "empty="], "f") == {"sglang.ai/role": "prefill", "empty": ""}
    for bad in (["=x"], ["a=b c"], ["a=b", "a=c"], ["Bad_Prefix.com/x=y"], ["a=" + "x" * 64]):
        with pytest.raises(ValueError):
            parse_selector(bad, "f")


def test_discovery_launch_router_error_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "eldr_sglang.launch_router", *PD, "--service-discovery",
                        "--prefill-selector", "a=b"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "needs --prefill-selector and --decode-selector" in r.stderr


def test_discovery_help_names_every_flag(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapped inside a name
    text = build_parser().format_help()
    for flag in ("--workers-file", "--workers-file-interval", "--service-discovery", "--selector", "--prefill-selector",
                 "--decode-selector", "--service-discovery-namespace", "--service-discovery-port",
                 "--service-discovery-resync-secs", "--kube-api", "sglang.ai/bootstrap-port"):
        assert flag in text
