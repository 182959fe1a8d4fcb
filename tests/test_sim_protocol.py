"""The strict study protocol: enough held-out requests, splits that never overlap, both
orders, open and closed loop, bounds beside the policies."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.sim.cost_model import ExecutionModel
from eldr_sglang.models import get_model
from eldr_sglang.sim.profiles import get_hardware
from eldr_sglang.sim.protocol import (
    STRICT_MIN_REQUESTS, Cell, eval_sequence, random_splits, run_cell, run_protocol, strict_cells, summarize, versus_best,
)
from eldr_sglang.sim.replay import TraceReplay
from eldr_sglang.sim.runner import parse_policies

from test_sim_policies import two_domain_trace

core = pytest.importorskip("eldr_sglang._core")


def test_splits_and_sequences():
    for fit, ev in random_splits(101, 3):
        assert len(np.intersect1d(fit, ev)) == 0 and len(fit) + len(ev) == 101
        assert np.all(np.diff(ev) > 0)
    ev = np.array([5, 7, 9])
    tr = eval_sequence(ev, "trace", 8, 0)
    assert tr.tolist() == [5, 7, 9, 5, 7, 9, 5, 7]
    sh = eval_sequence(ev, "shuffle", 9, 0)
    # every pass is a permutation of the held-out set: equal use of every request
    assert sorted(sh.tolist()) == sorted([5, 7, 9] * 3)
    with pytest.raises(ValueError, match="order"):
        eval_sequence(ev, "sorted", 4, 0)
    cells = strict_cells()
    assert {c.order for c in cells} == {"shuffle", "trace"} and {c.loop for c in cells} == {"closed", "open"}
    assert {c.output for c in cells} == {"fixed", "recorded"}


def test_protocol_runs_policies_and_bounds_on_held_out_requests(tmp_path):
    t = two_domain_trace(n_per_block=8, blocks=8)
    em = ExecutionModel(get_model("mixtral-8x7b"), get_hardware("h100"))
    fit, ev = random_splits(t.num_requests, 1)[0]
    with pytest.raises(ValueError, match="at least"):
        run_cell(TraceReplay(t), ev, parse_policies("round_robin"), em, 2, Cell("shuffle", "closed", 4, "fixed"),
                 centroids=None, requests=STRICT_MIN_REQUESTS - 1)
    recs = run_protocol(t, {"default": em}, 2, [Cell("shuffle", "closed", 4, "fixed"), Cell("trace", "open", 0.85, "fixed")],
                        [(fit, ev)], policies="round_robin,shortest_queue,eldr/0.05,locality/0.05", tmpdir=str(tmp_path))
    assert [r["cell"] for r in recs] == ["shuffle,closed@4/worker,fixed", "trace,open@0.85xcap,fixed"]
    for r in recs:
        p = r["policies"]
        assert set(p) >= {"round_robin", "shortest_queue", "eldr/0.05", "locality/0.05", "perfect_overlap", "clairvoyant/0.05"}
        assert p["_workload"]["requests"] >= STRICT_MIN_REQUESTS
        for lab in ("eldr/0.05", "locality/0.05", "perfect_overlap"):
            d = versus_best(p, lab)
            best = min(p[b]["tpot_ms"]["p50"] for b in ("round_robin", "shortest_queue"))
            assert d["tpot_p50"] == pytest.approx((p[lab]["tpot_ms"]["p50"] / best - 1) * 100)
        # the bound is a bound, and the two-domain case has locality to find
        assert versus_best(p, "perfect_overlap")["tpot_p50"] < versus_best(p, "eldr/0.05")["tpot_p50"]
        assert p["eldr/0.05"]["expert_locality"] < p["round_robin"]["expert_locality"]
    assert recs[1]["policies"]["_workload"]["arrival"] == "poisson"
    s = summarize(recs, ["eldr/0.05"])
    assert s["eldr/0.05"]["default"]["runs"] == 2
