"""sim/replicas.py: one replica routes as the plain policy does; with worker reports each
replica's loads include the other replicas' requests as of the last poll, and go stale
between polls as a report would."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.sim.policies import make_policy
from eldr_sglang.sim.replicas import Replicas

pytest.importorskip("eldr_sglang._core")


def test_one_replica_routes_as_the_plain_policy(gptoss_trace):
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cluster import ClusterConfig, simulate
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.workload import replay_workload

    small = TraceReplay(gptoss_trace.subset(np.arange(0, 703, 7)))
    em = ExecutionModel(get_model("gpt-oss-20b"), get_hardware("h100"))
    wl = replay_workload(small, arrival="closed", concurrency=16)
    prof = small.expert_profiles()

    def make(k):
        return make_policy("locality", 3, replay=small, load_factor=0.05, profiles=prof, seed=k)

    plain = simulate(small, wl, make(0), em, ClusterConfig(num_decode=3))
    one = simulate(small, wl, Replicas(make, 1, 3), em, ClusterConfig(num_decode=3))
    assert np.array_equal(plain.worker, one.worker) and np.array_equal(plain.finish, one.finish)
    four = simulate(small, wl, Replicas(make, 4, 3), em, ClusterConfig(num_decode=3))
    assert np.all(four.completions == 1)
    assert not np.array_equal(plain.worker, four.worker)


def _sq(k):
    return make_policy("shortest_queue", 2, seed=k)


def test_worker_reports_show_the_other_replicas_requests_until_the_next_poll():
    reps = Replicas(_sq, 2, 2, mode="worker_reports", seed=0)
    leases = []
    for r in range(6):
        reps.route(r)
        leases.append(reps.acquire(0, 10))  # every request on worker 0, from either replica
    by_rep = [sum(x.replica == k for x in leases) for k in (0, 1)]
    assert sum(by_rep) == 6 and min(by_rep) > 0  # both replicas routed some
    assert [rep.loads()[0] for rep in reps.reps] == by_rep  # each sees only its own
    reps.report_load(0, 6)
    assert [rep.loads()[0] for rep in reps.reps] == [6, 6]  # the poll shows every request
    for x in leases:
        x.release()
    assert [rep.loads()[0] for rep in reps.reps] == [by_rep[1], by_rep[0]]  # stale until the next poll
    reps.report_load(0, 0)
    assert [rep.loads()[0] for rep in reps.reps] == [0, 0]
    assert reps.held == [{}, {}]


def test_own_view_passes_the_load_report_to_every_replica():
    reps = Replicas(_sq, 3, 2, mode="own_view", seed=1)
    reps.report_load(1, 5)
    assert all(rep.loads()[1] == 5 for rep in reps.reps)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        Replicas(_sq, 0, 2)
    with pytest.raises(ValueError, match="mode must be one of"):
        Replicas(_sq, 2, 2, mode="gossip")
