"""Domain labels reach the oracle only: no other policy, and no part of the simulator
outside the oracle, ever reads them."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.sim.cluster import ClusterConfig
from eldr_sglang.sim.cost_model import ExecutionModel
from eldr_sglang.sim.policies import make_policy
from eldr_sglang.models import get_model
from eldr_sglang.sim.profiles import get_hardware
from eldr_sglang.sim.replay import TraceReplay
from eldr_sglang.sim.runner import parse_policies, run_comparison
from eldr_sglang.workload import replay_workload

from test_sim_policies import two_domain_trace, write_domain_centroids

pytest.importorskip("eldr_sglang._core")


class LabelRead(AssertionError):
    pass


class Poison:
    """Stands in for the label arrays; any use of it fails the test."""

    def _boom(self, *a, **k):
        raise LabelRead("domain labels were read")

    __getitem__ = __len__ = __iter__ = __array__ = __eq__ = __hash__ = __bool__ = _boom
    shape = property(_boom)
    astype = property(_boom)


def test_non_oracle_policies_never_read_labels(tmp_path):
    t = two_domain_trace()
    t.domain = Poison()
    t.subdomain = Poison()
    rp = TraceReplay(t)
    c = write_domain_centroids(tmp_path / "c.eldr")
    wl = replay_workload(rp, arrival="closed", concurrency=6)
    em = ExecutionModel(get_model("mixtral-8x7b"), get_hardware("h100"))
    specs = parse_policies("random,round_robin,shortest_queue,power_of_two,eldr,eldr@0.5")
    pols, _ = run_comparison(rp, wl, specs, em, ClusterConfig(num_decode=2), centroids=c)
    assert len(pols) == 6
    # the oracle is the one that does read them (so the poison works)
    with pytest.raises(LabelRead):
        run_comparison(rp, wl, parse_policies("oracle"), em, ClusterConfig(num_decode=2))


def test_labels_cannot_be_handed_to_other_policies():
    labels = np.array(["A", "B"])
    for name in ("random", "round_robin", "shortest_queue", "power_of_two", "eldr"):
        with pytest.raises(ValueError, match="must not be given labels"):
            make_policy(name, 2, labels=labels, centroids="x")
    with pytest.raises(ValueError, match="needs domain labels"):
        make_policy("oracle", 2)
