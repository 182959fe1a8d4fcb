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
    for bad, msg in (("round_robin/0.1", "only eldr"), ("eldr/abc", "bad load factor"), ("eldr/-0.5", ">= 0")):
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
