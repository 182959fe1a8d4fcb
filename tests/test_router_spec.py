"""The router's spec (rust/core/src/policies/spec.rs): policy, costs, tau, load factor and
binding are built and checked once, in the core. The command line, a config built in code and
`_core.Router` all get the same check and the same words; the control plane's router is made
from the config's spec, and the data plane reads the binding from that router."""

from __future__ import annotations

import json

import pytest

from eldr_sglang import _core
from eldr_sglang.router import config
from eldr_sglang.router.config import UNSTARTED_CONTROL_URL, ConfigError, RouterConfig, parse_config, plane_config

BASE = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:4",
        "--decode", "http://127.0.0.1:5"]
WORKERS = dict(prefill=[config.PrefillWorker("http://127.0.0.1:1", None, "127.0.0.1")],
               decode=["http://127.0.0.1:4", "http://127.0.0.1:5"])


@pytest.mark.parametrize("flags, kw, msg", [
    (["--eldr-tau", "2.5"], dict(tau=2.5), r"^--eldr-tau must be between 0 and 2, got 2\.5$"),
    (["--eldr-tau", "nan"], dict(tau=float("nan")), r"^--eldr-tau must be a finite number, got nan$"),
    (["--eldr-load-factor", "-0.5"], dict(load_factor=-0.5), r"^--eldr-load-factor must be between 0 and 1e\+06, got -0\.5$"),
    (["--eldr-paged-experts", "0"], dict(paged_experts=0), r"^--eldr-paged-experts must be between 1 and 1\.04858e\+06, got 0$"),
    (["--eldr-paged-experts", str(2**20 + 1)], dict(paged_experts=2**20 + 1),
     r"^--eldr-paged-experts must be between 1 and 1\.04858e\+06, got 1048577$"),
    (["--eldr-request-cost", "inf"], dict(request_cost=float("inf")), r"^--eldr-request-cost must be a finite number, got inf$"),
])
def test_one_check_one_message_from_the_command_line_a_config_and_the_router(flags, kw, msg):
    argv = BASE + ["--disagg-router", "locality", "--eldr-centroids", "c.eldr", *flags]
    with pytest.raises(ConfigError, match=msg):
        parse_config(argv)
    with pytest.raises(ConfigError, match=msg):
        RouterConfig(**WORKERS, policy="locality", **kw)
    with pytest.raises(ValueError, match=msg):
        _core.Router("locality", num_workers=2, **kw)


def test_the_routing_flags_have_no_python_copy_of_their_bounds():
    assert not {"--eldr-tau", "--eldr-load-factor", "--eldr-paged-experts", "--eldr-request-cost"} & set(config._NUMERIC_FLAGS)
    # tau's bound is the one the CLI promised (cosine distances lie in [0, 2]), now also the router's
    assert _core.MAX_TAU == 2.0 and _core.Router("eldr", num_workers=2, tau=2.0).tau == 2.0
    # the experts-per-layer bound: one constant, the core's
    from eldr_sglang.cli import args
    from eldr_sglang.traces import format as trace_format

    assert args.MAX_EXPERTS == trace_format.MAX_EXPERTS == _core.MAX_EXPERTS == 2**20


def test_capabilities_come_from_the_core():
    for name in _core.POLICIES:
        s = _core.RouterSpec(name)
        assert s.needs_centroids == s.binds_late == (name in _core.COUNTS_POLICIES)
        assert _core.RouterSpec(name, bind="late").binds_late and not _core.RouterSpec(name, bind="early").binds_late
    assert _core.RouterSpec().policy == _core.DEFAULT_POLICY
    with pytest.raises(ValueError, match="^--disagg-router eldr needs --eldr-centroids"):
        _core.RouterSpec("eldr").check_centroids(False)
    _core.RouterSpec("eldr").check_centroids(True)
    _core.RouterSpec("random").check_centroids(False)


@pytest.mark.parametrize("bind, late", [("auto", False), ("late", True), ("early", False)])
def test_the_control_planes_router_is_made_from_the_spec_and_carries_the_binding(bind, late):
    from eldr_sglang.router.control import ControlPlane

    cfg = parse_config(BASE + ["--disagg-router", "random", "--eldr-bind", bind])
    assert cfg.spec.binds_late == cfg.late_binding == late
    cp = ControlPlane(cfg)
    assert (cp.router.spec.policy, cp.router.spec.bind, cp.router.spec.binds_late) == ("random", bind, late)
    # the data plane is told neither the binding nor the policy: it reads the router's
    assert not {"late_binding", "policy"} & set(json.loads(plane_config(cfg, UNSTARTED_CONTROL_URL)))


def test_a_config_built_in_code_needs_a_centroid_file_for_a_counts_policy():
    from eldr_sglang.router.control import ControlPlane

    for policy in _core.COUNTS_POLICIES:
        with pytest.raises(ConfigError, match=f"^--disagg-router {policy} needs --eldr-centroids"):
            ControlPlane(RouterConfig(**WORKERS, policy=policy))


def test_set_healthy_is_refused_on_a_router_a_data_plane_holds():
    """The data plane's worker set owns the routable bit; a write past it would be undone by the
    next health check, so the Router refuses it while a DataPlane routes on it."""
    router = _core.Router(policy="random", num_workers=2)
    router.set_healthy(1, False)  # a standalone router (tests, the simulator)
    assert router.healthy() == [True, False]
    router.set_healthy(1, True)
    cfg = parse_config(BASE + ["--disagg-router", "random"])
    dp = _core.DataPlane(plane_config(cfg, UNSTARTED_CONTROL_URL), router)
    with pytest.raises(ValueError, match="worker set owns health"):
        router.set_healthy(0, False)
    assert router.healthy() == [True, True]
    dp.set_healthy("decode", 0, False)  # through the worker set
    assert router.healthy() == [False, True]


def test_experiment_arms_are_parsed_by_the_core():
    """--experiment's labels have one parser, the core's (rust/core/src/policies/label.rs)."""
    want = [("locality/0.05", "locality", 0.05), ("eldr", "eldr", 0.2), ("eldr/none", "eldr", None), ("random", "random", None)]
    assert _core.parse_arms("locality/0.05, eldr,eldr/none,random", 0.2) == want
    assert [(a.label, a.policy, a.load_factor) for a in config.parse_arms("locality/0.05, eldr,eldr/none,random", 0.2)] == want
    with pytest.raises(ValueError, match=r"^arm 'eldr/x': expected a number >= 0 or 'none', got 'x'$"):
        _core.parse_arms("eldr/x,random")
    with pytest.raises(ConfigError, match=r"^--experiment: arm 'eldr/2e6': the load factor must be between 0 and 1e6$"):
        parse_config(BASE + ["--eldr-centroids", "c.eldr", "--experiment", "eldr/2e6,random"])


@pytest.mark.parametrize("policy, warns", [("shortest_queue", True), ("round_robin", False)])
def test_a_shared_decode_worker_is_said_once(policy, warns, caplog):
    """Requests a decode worker runs that this router did not send (another replica) are counted
    per poll; three polls in a row with two or more make one warning, for a policy that reads
    loads (docs/operations.md, 'Several router replicas')."""
    import logging

    from eldr_sglang.router.control import ControlPlane

    cp = ControlPlane(parse_config(BASE + ["--disagg-router", policy]))
    with caplog.at_level(logging.WARNING, logger="eldr.router"):
        cp.report_load(0, 1, 0)  # one request of ours sent while the poll flew: no one else
        cp.report_load(0, 5, 1)
        cp.report_load(0, 5, 1)
        assert not caplog.records and cp.state()["decode_foreign_requests"][0] == 4
        cp.report_load(0, 6, 2)
        cp.report_load(0, 6, 2)
        cp.report_load(0, 0, 0)
    said = [r for r in caplog.records if "did not send" in r.getMessage()]
    assert len(said) == (1 if warns else 0)
    if warns:
        msg = said[0].getMessage()
        assert "--router-replicas N" in msg and "--load-monitor-interval 0" in msg and "decode 0" in msg
    assert cp.state()["decode_foreign_requests"] == [0, 0]


def test_router_replicas_flag_projects_in_the_core_and_silences_the_warning(caplog):
    """--router-replicas N reaches the core's tracker (each request sent counts N - 1 projected
    ones until the worker's next report) and /eldr/status; a router told it has company does
    not warn about foreign requests."""
    import logging

    from eldr_sglang.router.control import ControlPlane

    cp = ControlPlane(parse_config(BASE + ["--disagg-router", "shortest_queue", "--router-replicas", "3"]))
    assert cp.router.replicas == 3 and cp.state()["router_replicas"] == 3
    lease = cp.router.acquire(1)
    assert cp.router.loads()[1] == 3
    lease.release()
    with caplog.at_level(logging.WARNING, logger="eldr.router"):
        for _ in range(4):
            cp.report_load(0, 6, 0)
    assert not [r for r in caplog.records if "did not send" in r.getMessage()]
    for bad in ("0", "2000", "x"):
        with pytest.raises((ConfigError, SystemExit)):
            parse_config(BASE + ["--router-replicas", bad])


def test_router_replicas_make_the_default_load_poll_faster_unless_it_is_given():
    """With --router-replicas N > 1 the others' requests are known only from the polls: the
    default interval drops from 1 s to 0.25 s; a given --load-monitor-interval stands."""
    from eldr_sglang.router.config import parse_config

    sq = BASE + ["--disagg-router", "shortest_queue"]
    assert parse_config(sq).load_monitor_interval_s == 1.0
    assert parse_config(sq + ["--router-replicas", "2"]).load_monitor_interval_s == 0.25
    assert parse_config(sq + ["--router-replicas", "2", "--load-monitor-interval", "1"]).load_monitor_interval_s == 1.0
    assert parse_config(sq + ["--load-monitor-interval", "0"]).load_monitor_interval_s == 0.0
