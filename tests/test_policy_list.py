"""One policy list and one fallback vocabulary, both from the Rust core: the router's config and
CLI and the simulator read _core.POLICIES / COUNTS_POLICIES, and every fallback name routes to a
decision that carries it."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang import _core
from eldr_sglang.router import config
from eldr_sglang.sim import policies as sim_policies


def _choices(parser, dest):
    return next(a.choices for a in parser._actions if a.dest == dest)


def test_config_cli_and_simulator_read_the_core_list():
    assert config.DECODE_POLICIES is _core.POLICIES and config.COUNTS_POLICIES is _core.COUNTS_POLICIES
    assert tuple(_choices(config.build_parser(), "policy")) == _core.POLICIES
    assert set(_core.COUNTS_POLICIES) < set(_core.POLICIES)
    # the simulator adds two labels of its own: paged (locality with the paged-experts cost,
    # the router's --eldr-paged-experts) and the label oracle
    assert sim_policies.POLICY_NAMES == sim_policies.BASELINES + _core.COUNTS_POLICIES + ("paged", "oracle")
    assert set(sim_policies.BASELINES) == set(_core.POLICIES) - set(_core.COUNTS_POLICIES)
    for name in _core.POLICIES:  # every listed name is a policy the Router builds
        assert _core.Router(policy=name, num_workers=2).policy == name


def test_counts_policies_bind_late(tmp_path):
    for name in _core.POLICIES:
        cfg = config.RouterConfig(prefill=[config.PrefillWorker("http://127.0.0.1:1", None, "127.0.0.1")],
                                  decode=["http://127.0.0.1:2"], policy=name)
        assert cfg.late_binding == (name in _core.COUNTS_POLICIES)


@pytest.fixture()
def eldr_router(tmp_path):
    p = tmp_path / "c.eldr"
    _core.write_centroids(str(p), np.eye(2, 8, dtype=np.float32), np.ones(2, np.float32), np.ones((2, 4), np.float32))
    return _core.Router(policy="eldr", centroids=str(p))


def test_every_fallback_name_is_the_decisions_reason(eldr_router):
    names = _core.FALLBACK_REASONS
    assert len(set(names)) == len(names) and "no_centroids" in names
    for why in names:
        if why == "no_centroids":
            continue
        assert eldr_router.route_fallback(why, explain=True).reason == f"no_signature:{why}"
    with pytest.raises(ValueError, match="unknown"):
        eldr_router.route_fallback("prefill_none:some text")
    # without a centroid file the core names the fallback itself
    assert _core.Router(policy="eldr", num_workers=2).route_fallback("timeout", explain=True).reason == "no_centroids"


def test_defaults_and_the_prefill_list_come_from_the_core():
    from eldr_sglang import defaults
    from eldr_sglang.sim import prefill as sim_prefill

    assert (defaults.DEFAULT_POLICY, defaults.DEFAULT_TAU, defaults.DEFAULT_LOAD_FACTOR) == (
        _core.DEFAULT_POLICY, _core.DEFAULT_TAU, _core.DEFAULT_LOAD_FACTOR)
    assert _core.DEFAULT_POLICY == "locality" and _core.Router(num_workers=2).policy == _core.DEFAULT_POLICY
    assert config.PREFILL_POLICIES is _core.PREFILL_POLICIES
    assert tuple(_choices(config.build_parser(), "prefill_policy")) == _core.PREFILL_POLICIES
    assert config.RouterConfig(prefill=[], decode=[]).prefill_policy == _core.DEFAULT_PREFILL_POLICY
    assert sim_prefill.PREFILL_POLICIES == _core.PREFILL_POLICIES + ("earliest_free",)
    assert sim_prefill.DEFAULT_PREFILL_POLICY == _core.DEFAULT_PREFILL_POLICY
    assert set(_core.PREFILL_POLICIES) < set(_core.POLICIES) - set(_core.COUNTS_POLICIES)
