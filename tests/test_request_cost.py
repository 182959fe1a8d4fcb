"""The locality cost's per-request term r * (2 * B_w + 1) (issue 34 item 4): the core Router's
`request_cost`, the router flag --eldr-request-cost R and the simulator's `:rc=R` labels."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang import _core
from eldr_sglang.router.config import ConfigError, parse_config
from eldr_sglang.sim.policies import make_policy
from eldr_sglang.sim.runner import parse_policies

BASE = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
LOCALITY = ["--disagg-router", "locality", "--eldr-centroids", "x.eldr"]


def _prof(cells):
    return _core.ExpertProfile(1, 8, np.array(cells, np.int64), np.full(len(cells), 10.0), 10)


def _choice(r: float | None) -> int:
    """Worker 0 runs three requests on experts {0, 1}, worker 1 one on {6, 7}; a request on
    {0, 1} adds almost nothing to worker 0 (cost 2.00 + 7r) and 1.82 experts to worker 1
    (5.45 + 3r): the break-even r is about 0.86."""
    router = _core.Router("locality", num_workers=2, request_cost=r)
    a, b = _prof([0, 1]), _prof([6, 7])
    leases = [router.acquire(w, 1, profile=p) for w, p in ((0, a), (0, a), (0, a), (1, b))]
    try:
        return router.route_profile(a)
    finally:
        for lease in leases:
            lease.release()


def test_the_router_takes_a_request_cost_for_locality_and_it_moves_the_choice():
    assert _core.Router("locality", num_workers=2).request_cost == _core.DEFAULT_REQUEST_COST == 0.03
    assert _core.Router("locality", num_workers=2, request_cost=0.4).request_cost == 0.4
    assert _core.Router("locality", num_workers=2, paged_experts=4, request_cost=0.4).request_cost == 0.4
    assert _core.Router("round_robin", num_workers=2).request_cost is None
    assert (_choice(None), _choice(0.0), _choice(0.5), _choice(1.0)) == (0, 0, 0, 1)


@pytest.mark.parametrize("policy, r, msg", [
    # the core's spec checks it once, in the router command line's words
    ("locality", -0.1, r"^--eldr-request-cost must be between 0 and 1e\+06, got -0.1$"),
    ("locality", float("nan"), r"^--eldr-request-cost must be a finite number, got nan$"),
    ("locality", float("inf"), r"^--eldr-request-cost must be a finite number, got inf$"),
    ("eldr", 0.4, r"^--eldr-request-cost is a cost of the locality policy, not of --disagg-router eldr$"),
    ("shortest_queue", 0.4, r"not of --disagg-router shortest_queue$"),
])
def test_the_router_refuses_a_bad_request_cost_in_one_line(policy, r, msg):
    with pytest.raises(ValueError, match=msg):
        _core.Router(policy, num_workers=2, request_cost=r)


def test_the_flag():
    cfg = parse_config(BASE + LOCALITY)
    assert cfg.request_cost is None and cfg.spec.request_cost == _core.DEFAULT_REQUEST_COST  # the core's default
    assert parse_config(BASE + LOCALITY + ["--eldr-request-cost", "0.4"]).request_cost == 0.4
    assert parse_config(BASE + LOCALITY + ["--eldr-request-cost", "0"]).spec.request_cost == 0.0  # the rule without it
    # 0 is every policy's rule, so it is accepted with any policy
    assert parse_config(BASE + ["--disagg-router", "round_robin", "--eldr-request-cost", "0"]).request_cost == 0.0
    for argv, msg in (
        (["--disagg-router", "eldr", "--eldr-centroids", "x.eldr", "--eldr-request-cost", "0.4"],
         "^--eldr-request-cost is a cost of the locality policy, not of --disagg-router eldr$"),
        (["--disagg-router", "round_robin", "--eldr-request-cost", "0.4"], "not of --disagg-router round_robin$"),
        (LOCALITY + ["--eldr-request-cost", "-1"], r"^--eldr-request-cost must be between 0 and 1e\+06, got -1$"),
        (LOCALITY + ["--eldr-request-cost", "nan"], "^--eldr-request-cost must be a finite number, got nan$"),
        (["--eldr-centroids", "x.eldr", "--experiment", "locality/0.05,round_robin", "--eldr-request-cost", "0.4"],
         "^--eldr-request-cost is the router's locality cost; an experiment's arms take none$"),
    ):
        with pytest.raises(ConfigError, match=msg):
            parse_config(BASE + argv)


def test_the_help_says_the_unit():
    from eldr_sglang.router.config import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--eldr-request-cost R" in text and "distinct experts per layer" in text and "Default 0" in text


def test_simulator_labels_give_the_request_cost():
    specs = {s.label: s for s in parse_policies("locality/0.05:rc=0.4,locality:rc=0.4,paged/0.05:rc=0.4,locality/0.05,default:rc=0.2")}
    assert [(s.policy, s.load_factor, s.request_cost) for s in specs.values()] == [
        ("locality", 0.05, 0.4), ("locality", None, 0.4), ("paged", 0.05, 0.4), ("locality", 0.05, None), ("locality", 0.05, 0.2)]
    assert list(specs)[-1] == "locality/0.05:rc=0.2"
    pol = make_policy("locality", 2, profiles=[None], request_cost=specs["locality:rc=0.4"].request_cost, load_factor=0.05)
    assert pol.router.request_cost == 0.4 and pol.router.load_factor == 0.05
    assert make_policy("locality", 2, profiles=[None]).router.request_cost == _core.DEFAULT_REQUEST_COST
    assert make_policy("locality", 2, profiles=[None], request_cost=0.0).router.request_cost == 0.0
    assert make_policy("paged", 2, profiles=[None], paged_experts=8, request_cost=0.4).router.request_cost == 0.4


@pytest.mark.parametrize("label, msg", [
    ("eldr/0.05:rc=0.4", r"^policy 'eldr/0.05:rc=0.4': :rc=R \(the locality cost's per-request term\) applies to locality and paged only$"),
    ("round_robin:rc=0.4", ":rc=R .* applies to locality and paged only"),
    ("clairvoyant:rc=0.4", "^policy 'clairvoyant:rc=0.4': :rc=R .* applies to locality and paged only"),
    ("locality:rc=-1", r"^policy 'locality:rc=-1': the request cost must be between 0 and 1e6$"),
    ("locality:rc=nan", r"^policy 'locality:rc=nan': the request cost must be between 0 and 1e6$"),
    ("locality:rc=abc", r"^policy 'locality:rc=abc': expected a number for rc=, got 'abc'$"),
    ("locality:tau=1", r"^policy 'locality:tau=1': unknown option 'tau=1': use :rc=R \(the per-request term\)$"),
    ("locality:rc=0.4,locality:rc=0.4", "listed twice"),
])
def test_simulator_labels_refuse_bad_request_costs_in_one_line(label, msg):
    with pytest.raises(ValueError, match=msg):
        parse_policies(label)
