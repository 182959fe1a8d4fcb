"""The simulator's prefill placement: the router service's policies, plus earliest_free."""

from __future__ import annotations

import pytest

from eldr_sglang.sim.prefill import PrefillScheduler


def _one_second(n):
    return 1.0


def test_round_robin_cycles_whatever_the_queues():
    s = PrefillScheduler(3, _one_second)  # the default, as the service's
    placed = [s.place(0.0, 10) for _ in range(5)]
    assert [p for p, _ in placed] == [0, 1, 2, 0, 1]
    assert [t for _, t in placed] == [1.0, 1.0, 1.0, 2.0, 2.0]  # FIFO per worker


def test_shortest_queue_counts_unfinished_prefills():
    s = PrefillScheduler(2, _one_second, "shortest_queue")
    assert s.place(0.0, 1) == (0, 1.0)
    assert s.place(0.0, 1) == (1, 1.0)
    assert s.place(0.0, 1) == (0, 2.0)  # a tie goes to the lower index
    assert s.place(1.5, 1) == (1, 2.5)  # worker 0 still has one in flight, worker 1 none


def test_earliest_free_is_the_old_rule_and_random_is_seeded():
    s = PrefillScheduler(2, lambda n: float(n), "earliest_free")
    assert s.place(0.0, 5) == (0, 5.0)
    assert s.place(0.0, 1) == (1, 1.0)
    assert s.place(0.0, 1) == (1, 2.0)  # worker 1 frees up first


    def picks(seed):
        s = PrefillScheduler(4, _one_second, "random", seed=seed)
        return [s.place(0.0, 1)[0] for _ in range(20)]

    assert picks(3) == picks(3) != picks(4)
    assert set(picks(3)) == {0, 1, 2, 3}


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown prefill policy 'fastest'.*earliest_free"):
        PrefillScheduler(2, _one_second, "fastest")


def test_the_services_placements_are_the_cores_prefill_policies():
    """round_robin, random and shortest_queue are run by the Rust core (as the data plane runs
    them), not reimplemented: the same seed gives the core Router's own sequence."""
    from eldr_sglang import _core

    s = PrefillScheduler(4, _one_second, "random", seed=5)
    r = _core.Router("random", num_workers=4, seed=5)
    assert [s.place(0.0, 1)[0] for _ in range(30)] == [r.route_signature(None) for _ in range(30)]
