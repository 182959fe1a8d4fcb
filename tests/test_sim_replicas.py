"""sim/replicas.py: one replica routes as the plain policy does; with worker reports each
replica's loads include the other replicas' requests as of the last poll, and go stale
between polls as a report would; the projections add load-only leases for the others'
arrivals, dropped at the worker's next poll (and, mirrored, when their request finishes)."""

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


def test_leases_show_the_other_replicas_requests_until_the_next_poll():
    reps = Replicas(_sq, 2, 2, mode="leases", seed=0)
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


def test_no_polls_ignores_the_load_report():
    reps = Replicas(_sq, 2, 2, mode="no_polls", seed=1)
    reps.route(0)
    lease = reps.acquire(1, 10)
    reps.report_load(1, 9)
    assert sorted(rep.loads()[1] for rep in reps.reps) == [0, 1]  # only the routing replica's own request
    lease.release()
    assert [rep.loads()[1] for rep in reps.reps] == [0, 0]


def _loc(k):
    """The locality balancer over 2 workers, 1 layer x 4 experts; request r uses expert r % 4."""
    from eldr_sglang._core import ExpertProfile

    profiles = [ExpertProfile(1, 4, np.array([r % 4]), np.array([3.0]), 3) for r in range(8)]
    return make_policy("locality", 2, profiles=profiles, load_factor=0.05, seed=k)


def test_projected_replica_counts_the_others_arrivals_as_load_only_until_the_poll():
    reps = Replicas(_loc, 3, 2, mode="leases_projected", seed=0)
    reps.route(0)
    lease = reps.acquire(0, 10)
    k = lease.replica
    loads = [rep.loads()[0] for rep in reps.reps]
    assert loads[k] == 3 and sum(loads) == 3  # its own request and 2 projected ones, on its own router only
    alone = Replicas(_loc, 1, 2, mode="leases", seed=0)
    alone.route(0)
    alone.acquire(0, 10)
    assert reps.reps[k].router.expert_distinct() == alone.reps[0].router.expert_distinct()  # no experts projected
    lease.release()
    assert reps.reps[k].loads()[0] == 2  # the projection outlives the request ...
    reps.report_load(1, 0)
    assert reps.reps[k].loads()[0] == 2  # ... and another worker's poll ...
    reps.report_load(0, 0)
    assert [rep.loads() for rep in reps.reps] == [[0, 0]] * 3  # ... until its own worker's poll


def test_mirrored_replica_projection_ends_with_the_request_or_the_poll():
    reps = Replicas(_loc, 4, 2, mode="leases_mirrored", seed=0)
    reps.route(1)
    first = reps.acquire(1, 10)
    reps.route(2)
    second = reps.acquire(1, 10)
    assert sum(rep.loads()[1] for rep in reps.reps) == 8  # 2 requests x (1 + 3 projected)
    first.release()
    assert sum(rep.loads()[1] for rep in reps.reps) == 4  # its 3 projected leases went with it
    reps.report_load(1, 1)  # the poll drops the second's projection; the others see it in the report
    assert reps.reps[second.replica].loads()[1] == 1
    assert all(rep.loads()[1] == 1 for rep in reps.reps)
    second.release()  # its projected leases went at the poll
    assert [rep.loads()[1] for k, rep in enumerate(reps.reps) if k != second.replica] == [1, 1, 1]  # stale until the poll
    assert reps.reps[second.replica].loads()[1] == 0


def test_replica_modes_on_leases_with_one_replica_route_as_it(gptoss_trace):
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

    def run(R, mode):
        return simulate(small, wl, Replicas(make, R, 3, mode=mode), em, ClusterConfig(num_decode=3, load_report_interval_s=0.05))

    base = run(1, "leases")
    for m in ("leases_projected", "leases_mirrored", "leases_own_cap"):
        one = run(1, m)
        assert np.array_equal(base.worker, one.worker) and np.array_equal(base.finish, one.finish)
    three = [run(3, m) for m in ("leases", "leases_projected")]
    assert all(np.all(r.completions == 1) for r in three)
    assert not np.array_equal(three[0].worker, three[1].worker)  # with 3 replicas the projection routes otherwise


def _route_by(reps, k, r=0):
    """Route request r (and the next ones) until replica k takes one; its decision."""
    while True:
        w = reps.route(r)
        if reps._last[0] == k:
            return w
        r += 1


def _own_cap_scene(mode):
    """Replica 0 holds 2 requests on worker 0, replica 1 holds 6 on worker 1; both polled."""
    reps = Replicas(_loc, 2, 2, mode=mode, seed=3)
    for k, w, n in ((0, 0, 2), (1, 1, 6)):
        for i in range(n):
            _route_by(reps, k, i)
            reps.acquire(w, 10)
    reps.report_load(0, 2)
    reps.report_load(1, 6)
    return reps


def test_own_cap_replica_bounds_its_own_share_not_the_reports():
    plain, own = _own_cap_scene("leases"), _own_cap_scene("leases_own_cap")
    for reps in (plain, own):
        assert reps.reps[0].loads() == [2, 6]  # its own 2, and the report's 6 of replica 1
    # the cap on every request (8 in all: under 5 per worker) shuts worker 1 out ...
    assert _route_by(plain, 0) == 0
    # ... the cap on its own 2 (under 2 per worker) shuts worker 0 out instead
    assert _route_by(own, 0) == 1
    assert all(rep.router.load_factor is None and rep.router.healthy() == [True, True] for rep in own.reps)
    assert plain.reps[0].router.load_factor == 0.05
    assert own.own == [[2, 0], [0, 6]]


def test_own_view_replicas_project_through_the_core_tracker():
    """--router-replicas R in the simulator: each replica's Rust tracker counts R - 1 projected
    requests per request it sends, until that worker's next report or the request's end."""
    reps = Replicas(_sq, 3, 2, mode="own_view_replicas", seed=1)
    assert all(rep.router.replicas == 3 for rep in reps.reps)
    reps.route(0)
    k = reps._last[0]
    lease = reps.acquire(1, 10)
    assert reps.reps[k].loads()[1] == 3, "one request and two projected"
    lease.release()
    assert reps.reps[k].loads()[1] == 0
    reps.route(0)
    k = reps._last[0]
    reps.acquire(0, 10)
    reps.report_load(0, 2)  # the report counts the others' real requests: the projection goes
    assert reps.reps[k].loads()[0] == 2


def test_worker_reports_no_replicas_flag_show_each_replica_the_others_experts_at_the_poll():
    """worker_reports_no_replicas_flag: a worker's occupancy report, summed from every replica's requests'
    profiles as the worker sums them, reaches each replica's locality state through
    Router.report_occupancy; with one replica it changes nothing."""
    from eldr_sglang import _core

    profiles = [_core.ExpertProfile(1, 8, np.array([0, 1]), np.array([9.0, 9.0]), 9),
                _core.ExpertProfile(1, 8, np.array([6, 7]), np.array([9.0, 9.0]), 9)]

    def make(k):
        return make_policy("locality", 2, load_factor=None, profiles=profiles, seed=k)

    one = Replicas(make, 1, 2, mode="worker_reports_no_replicas_flag", seed=0)
    one.route(0)
    one.acquire(0, 10)
    before = one.reps[0].router.expert_distinct()
    one.report_load(0, 1)
    assert one.reps[0].router.occupancy_reported() == [True, False]
    assert np.allclose(one.reps[0].router.expert_distinct(), before)

    reps = Replicas(make, 2, 2, mode="worker_reports_no_replicas_flag", seed=0)
    leases = []
    for r in range(6):  # requests of profile 0 on worker 0, from either replica
        reps.route(0)
        leases.append(reps.acquire(0, 10))
    k = leases[0].replica
    assert 0 < sum(x.replica == k for x in leases) < 6  # both replicas sent some
    other = reps.reps[1 - k].router
    mine = reps.reps[k].router
    d_own = mine.expert_distinct()[0]
    reps.report_load(0, 6)
    assert mine.occupancy_reported()[0] and other.occupancy_reported()[0]
    assert mine.expert_distinct()[0] > d_own + 1e-6  # the other replica's requests count now
    assert np.isclose(mine.expert_distinct()[0], other.expert_distinct()[0], atol=1e-4)  # one picture
