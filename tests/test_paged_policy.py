"""The cache-aware locality cost (--eldr-paged-experts C): its Python surface, the router flag,
and the simulator's `paged` policy."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang import _core
from eldr_sglang.router.config import ConfigError, parse_config

BASE = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


def test_router_takes_paged_experts_for_locality_only():
    r = _core.Router("locality", num_workers=2, paged_experts=4)
    assert r.policy == "locality" and r.paged_experts == 4
    assert _core.Router("locality", num_workers=2).paged_experts is None
    # the core's spec checks it, in the router command line's words
    with pytest.raises(ValueError, match="^--eldr-paged-experts is a cost of the locality policy, not of --disagg-router shortest_queue$"):
        _core.Router("shortest_queue", num_workers=2, paged_experts=4)
    with pytest.raises(ValueError, match=r"^--eldr-paged-experts must be between 1 and 1\.04858e\+06, got 0$"):
        _core.Router("locality", num_workers=2, paged_experts=0)
    with pytest.raises(ValueError, match=r"^--eldr-paged-experts must be between 1 and 1\.04858e\+06, got 1180591620717411303424$"):
        _core.RouterSpec("locality", paged_experts=2**70)
    with pytest.raises(ValueError, match="^--eldr-paged-experts must be an integer, got 1.5$"):
        _core.RouterSpec("locality", paged_experts=1.5)


def test_router_routes_to_the_worker_that_holds_the_request_experts():
    L, E = 1, 16
    r = _core.Router("locality", num_workers=2, paged_experts=2)

    def prof(cells):
        return _core.ExpertProfile(L, E, np.array([c[0] for c in cells], np.int64), np.array([c[1] for c in cells], float), 9)

    a = prof([(10, 5.0), (11, 4.0)])
    lease = r.acquire(1, 100, profile=a)  # worker 1 pages in 10 and 11
    lease.release()
    assert r.route_profile(a) == 1  # finished, but its experts are still resident there
    assert r.route_profile(prof([(3, 5.0), (4, 4.0)])) == 0  # resident nowhere: first worker


def test_the_flag_needs_the_locality_policy():
    cfg = parse_config(BASE + ["--disagg-router", "locality", "--eldr-centroids", "x.eldr", "--eldr-paged-experts", "32"])
    assert cfg.paged_experts == 32
    with pytest.raises(ConfigError, match="locality"):
        parse_config(BASE + ["--disagg-router", "shortest_queue", "--eldr-paged-experts", "32"])
    with pytest.raises(ConfigError, match="--eldr-paged-experts"):
        parse_config(BASE + ["--disagg-router", "locality", "--eldr-centroids", "x.eldr", "--eldr-paged-experts", "0"])


def test_simulator_paged_policy_needs_paged_workers():
    from eldr_sglang.sim.policies import make_policy

    profiles = [None]
    with pytest.raises(ValueError, match="offload-experts"):
        make_policy("paged", 2, profiles=profiles)
    pol = make_policy("paged", 2, profiles=profiles, paged_experts=8)
    assert pol.router.paged_experts == 8
