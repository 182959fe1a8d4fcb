"""Bounded-load ELDR reaches the simulator: policy grammar and the Router it builds."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang import write_centroids
from eldr_sglang.sim.policies import make_policy
from eldr_sglang.sim.runner import parse_policies


def test_grammar():
    specs = {s.label: s for s in parse_policies("shortest_queue,eldr,eldr/0.05,eldr@0.2/0.1", tau=0.1)}
    assert specs["eldr"].load_factor is None and specs["eldr"].tau == 0.1
    assert specs["eldr/0.05"].load_factor == 0.05 and specs["eldr/0.05"].tau == 0.1
    assert (specs["eldr@0.2/0.1"].tau, specs["eldr@0.2/0.1"].load_factor) == (0.2, 0.1)
    assert specs["shortest_queue"].load_factor is None
    assert parse_policies("eldr", load_factor=0.25)[0].load_factor == 0.25
    for bad, msg in (("round_robin/0.1", "applies to eldr, locality and paged only"),
                     ("eldr/abc", "expected a number >= 0 or 'none'"), ("eldr/-0.5", "between 0 and 1e6"),
                     ("eldr/2e6", "between 0 and 1e6"), ("eldr@2.5", "tau must be between 0 and 2")):
        with pytest.raises(ValueError, match=msg):
            parse_policies(bad)


def test_policy_router_gets_the_factor(tmp_path):
    path = tmp_path / "c.eldr"
    w = np.ones(2, np.float32)
    write_centroids(str(path), np.eye(4, 8, dtype=np.float32) + 0.1, w, np.ones((2, 4), np.float32))
    sigs = np.ones((3, 8), np.float32)
    pol = make_policy("eldr", 4, centroids=str(path), signatures=(sigs, np.ones(3, bool)), load_factor=0.05)
    assert pol.router.load_factor == 0.05
    plain = make_policy("eldr", 4, centroids=str(path), signatures=(sigs, np.ones(3, bool)))
    assert plain.router.load_factor is None


def test_load_reports_never_unbalance_the_locality_cap():
    """The router polls each decode worker's /v1/loads and blends it into the tracker; the
    simulator polls its replicas the same way. On a uniform trace (no locality: the locality
    policy only sees its profiles' noise) in a closed loop of C clients on K workers, a worker
    can hold at most ceil((1 + f) * C / K) requests: the bounded-load cap with every client's
    request counted once (a route sees at most C - 1 others in flight). A blend that re-counted
    the router's own finished requests from a stale report lifted the cap and swung batches
    to 2x that (the emulated switchback's 6 % loss; benchmarks/results/archive/switchback_emulated_before_fix.md).
    Polled every 20 ms here, about a quarter of a request's life, as the service's 1 s poll is
    of a request at the emulator's time scale 10."""
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cluster import ClusterConfig, simulate
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.traces.synth import generate
    from eldr_sglang.workload import replay_workload

    C, K, f = 32, 4, 0.05
    replay = TraceReplay(generate(model="gpt-oss-20b", requests=300, seed=0, domains=4, uniform=True, output_len=32,
                                  prompt_len=(64, 256)))
    wl = replay_workload(replay, requests=1200, arrival="closed", concurrency=C)
    em = ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h200"))
    pol = make_policy("locality", K, replay=replay, load_factor=f)
    res = simulate(replay, wl, pol, em, ClusterConfig(num_decode=K, num_prefill=2, load_report_interval_s=0.02))
    bound = int(np.ceil((1 + f) * C / K))
    assert int(res.step_batch.max()) <= bound, np.bincount(res.step_batch)
    assert pol.loads() == [0] * K
