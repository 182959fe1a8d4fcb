"""Decode workers' expert occupancy reports (issue 32, part 2): the answer's parser, the
emulated worker's report, and a router that blends them (counts only, never times).

- A report is read only in its exact shape; anything else is dropped with a cause.
- The emulated worker's moving average follows its steps and its layer selection.
- A decode worker sums its running requests' profiles exactly; a bad profile is ignored.
- A router under the locality balancer sends each request's profile with it, asks every
  decode worker for its occupancy beside its load, routes on the reports, forgets one the worker stops sending, drops (and counts) one
  it cannot read while keeping the worker's load, and asks nothing with the flag off.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from eldr_sglang.emulate.occupancy import Occupancy
from eldr_sglang.router.occupancy import OccupancyDropped, occupancy_from_loads, query
from eldr_sglang.sglang_ext.profile_occupancy import LOG_SCALE, ProfileOccupancy

TIME_SCALE = 0.05
TRACE = dict(requests=60, seed=8, workers=2)
CLUSTER = dict(prefill=1, decode=2)


def _answer(**occ):
    base = {"version": 1, "experts": 3, "layers": [2, 5], "window_steps": 32, "running": 1,
            "idle": [[1.0, 0.5, 0.0], [0.25, 1, 1.0]]}
    base.update(occ)
    return {"loads": [], "eldr_occupancy": base}


def test_a_report_is_read_in_its_exact_shape():
    idle = occupancy_from_loads(_answer(), [2, 5], 3)
    assert idle.tolist() == [1.0, 0.5, 0.0, 0.25, 1.0, 1.0]
    assert occupancy_from_loads({"loads": []}, [2, 5], 3) is None  # an unpatched worker
    off = {"loads": [], "eldr_occupancy_error": "off (--enable-eldr-occupancy not set)"}
    assert occupancy_from_loads(off, [2, 5], 3) is None  # a patched one without the flag
    assert query([2, 5]) == "include=core,disagg&eldr_layers=2,5" and query(None) == "include=core,disagg"


@pytest.mark.parametrize("body,cause", [
    (_answer(version=2), "version"),
    (_answer(layers=[2, 6]), "other_selection"),
    (_answer(experts=4), "other_selection"),
    (_answer(idle=[[1.0, 0.5, 0.0]]), "malformed"),
    (_answer(idle=[[1.0, 0.5], [1.0, 1.0, 1.0]]), "malformed"),
    (_answer(idle=[[1.0, 1.5, 0.0], [1.0, 1.0, 1.0]]), "malformed"),
    (_answer(idle=[[1.0, float("nan"), 0.0], [1.0, 1.0, 1.0]]), "malformed"),
    (_answer(idle=[[1.0, True, 0.0], [1.0, 1.0, 1.0]]), "malformed"),
    (_answer(idle=[[1.0, "x", 0.0], [1.0, 1.0, 1.0]]), "malformed"),
    ({"loads": [], "eldr_occupancy": [1]}, "malformed"),
    ({"loads": [], "eldr_occupancy_error": "several DP ranks: not supported yet"}, "worker_refused"),
])
def test_a_report_that_cannot_be_used_is_dropped_with_its_cause(body, cause):
    with pytest.raises(OccupancyDropped) as e:
        occupancy_from_loads(body, [2, 5], 3)
    assert e.value.cause == cause and str(e.value)


def test_a_report_with_no_profile_of_these_layers_says_nothing_is_in_use():
    body = {"loads": [], "eldr_occupancy": {"version": 1, "source": "signatures", "layers": [2, 5], "experts": None,
                                            "running": 3, "idle": None}}
    assert occupancy_from_loads(body, [2, 5], 3).tolist() == [1.0] * 6
    body["eldr_occupancy"]["layers"] = [2, 6]
    with pytest.raises(OccupancyDropped):
        occupancy_from_loads(body, [2, 5], 3)


def _profile(cells, log_keep, layers=(4, 9), experts=3):
    return {"layers": list(layers), "experts": experts, "cells": list(cells), "log_keep": list(log_keep)}


def test_a_worker_sums_its_running_requests_profiles_exactly():
    occ = ProfileOccupancy()
    half = -int(round(np.log(2) * LOG_SCALE))  # p = 1/2
    a = occ.add(_profile([0, 4], [half, half]))
    b = occ.add(_profile([4], [half]))
    rep = occ.report("4,9")["eldr_occupancy"]
    assert rep["source"] == "signatures" and rep["experts"] == 3 and rep["running"] == 2
    assert rep["idle"] == [[0.5, 1.0, 1.0], [1.0, 0.25, 1.0]]
    # parsed as the router reads it, and the other layer selection knows nothing
    assert occupancy_from_loads({"eldr_occupancy": rep}, [4, 9], 3).tolist() == [0.5, 1, 1, 1, 0.25, 1]
    assert occ.report("4")["eldr_occupancy"]["idle"] is None
    occ.remove(a)
    occ.remove(a)  # a second end of the same request changes nothing
    assert occ.report("4,9")["eldr_occupancy"]["idle"] == [[1.0, 1.0, 1.0], [1.0, 0.5, 1.0]]
    occ.remove(b)
    assert occ.report("4,9")["eldr_occupancy"]["idle"] is None and occ.running == 0
    assert (occ.added, occ.dropped) == (2, 0)


@pytest.mark.parametrize("bad", [
    [1, 2], "x", {"layers": [], "experts": 3, "cells": [], "log_keep": []},
    _profile([6], [-5]), _profile([0], [5]), _profile([0, 1], [-5]), _profile([0.5], [-5]),
    _profile([0], [True]), {**_profile([0], [-5]), "experts": 0}, {**_profile([0], [-5]), "layers": ["a"]},
    _profile([1, 1], [-5, -5]), _profile([2, 1], [-5, -5]), _profile([[0]], [[-5]]), _profile([None], [-5]),
])
def test_a_bad_profile_is_ignored_and_counted(bad):
    occ = ProfileOccupancy()
    assert occ.add(bad) is None and occ.dropped == 1 and occ.running == 0
    assert occ.add(None) is None and occ.dropped == 1  # a request without one is not a bad one
    assert "comma-separated" in occ.report("x")["eldr_occupancy_error"]


def test_the_emulated_worker_averages_its_steps_over_its_window():
    occ = Occupancy(num_layers=3, num_experts=4, window_steps=4)
    ids = np.array([[[0, 1], [2, 3], [0, 0]]])  # one request: layer 0 uses 0,1; layer 1 2,3; layer 2 0
    occ.step(ids)
    rep = occ.report("0,2", running=1)["eldr_occupancy"]
    assert rep["layers"] == [0, 2] and rep["experts"] == 4 and rep["window_steps"] == 4 and rep["source"] == "steps"
    assert rep["idle"] == [[0.75, 0.75, 1.0, 1.0], [0.75, 1.0, 1.0, 1.0]]
    for _ in range(200):
        occ.step(ids)
    assert occ.report("", running=1)["eldr_occupancy"]["idle"][1] == [1.0, 1.0, 0.0, 0.0]
    # an empty batch uses no expert, whatever its last steps did
    assert occ.report("1", running=0)["eldr_occupancy"]["idle"] == [[1.0] * 4]
    assert "not a MoE layer" in occ.report("3", running=1)["eldr_occupancy_error"]
    assert "comma-separated" in occ.report("a,b", running=1)["eldr_occupancy_error"]


# ---------------- a router in front of the emulated cluster ----------------

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.testing.pd_cluster import get_json  # noqa: E402
from test_router_faults import eldr_router, run_requests, set_fault, wait_idle  # noqa: E402


def _metric(base: str, name: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(name + "{")}


def _reported_after_traffic(base: str, n: int = 24) -> list[bool]:
    """Run requests, then read for 3 s (15 load polls) which decode workers the router routes
    on a report for (the balancer asks once it has tracked a request's experts)."""
    res = run_requests(base, n, 4, 3, 0.0)
    assert all(r["status"] == 200 and r["complete"] for r in res)
    seen = [False, False]
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and seen != [True, True]:
        seen = [a or b for a, b in zip(seen, get_json(base + "/eldr/status")["decode_occupancy_reported"])]
        time.sleep(0.05)
    return seen


def _profiles(cluster) -> list[int]:
    return [get_json(u + "/emulator/stats")["profiles_received"] for u in cluster["decode"]]


def test_a_router_routes_on_every_decode_workers_occupancy(cluster, trace_files, workdir):
    proc, base = eldr_router(cluster, trace_files, workdir, [], "locality")
    try:
        assert _reported_after_traffic(base) == [True, True]
        # once a worker reports, it gets its requests' profiles, all well formed
        before = _profiles(cluster)
        assert all(r["status"] == 200 for r in run_requests(base, 24, 4, 3, 0.0))
        assert all(a > b for a, b in zip(_profiles(cluster), before))
        assert [get_json(u + "/emulator/stats")["profiles_dropped"] for u in cluster["decode"]] == [0, 0]
        assert not _metric(base, "eldr_router_occupancy_reports_dropped_total")
        wait_idle(base)
        # a worker that answers with a report the router cannot read: dropped and counted, its
        # load still used, and the router stops routing on its last report
        set_fault(cluster["decode"][1], "loads:occupancy_version")
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not _metric(base, "eldr_router_occupancy_reports_dropped_total"):
                time.sleep(0.1)
            dropped = _metric(base, "eldr_router_occupancy_reports_dropped_total")
            assert list(dropped) == ['eldr_router_occupancy_reports_dropped_total{cause="version",worker="1"}'], dropped
            assert min(dropped.values()) >= 1
            st = get_json(base + "/eldr/status")
            assert st["decode_occupancy_reported"][1] is False and st["decode_reported"][1] == 0
            assert not _metric(base, "eldr_router_load_reports_dropped_total")
            # and its requests no longer carry profiles (it shows no use of them), the other's do
            before = _profiles(cluster)
            routes = _metric(base, "eldr_router_decode_routes_total")
            assert all(r["status"] == 200 for r in run_requests(base, 24, 4, 3, 0.0))
            after = _profiles(cluster)
            to_1 = sum(v for k, v in _metric(base, "eldr_router_decode_routes_total").items() if 'worker="1"' in k) - sum(
                v for k, v in routes.items() if 'worker="1"' in k)
            assert to_1 > 0 and after[1] == before[1] and after[0] > before[0], (to_1, before, after)
        finally:
            set_fault(cluster["decode"][1], "none")
    finally:
        proc.stop()


def test_with_the_flag_off_the_router_asks_for_no_occupancy(cluster, trace_files, workdir):
    proc, base = eldr_router(cluster, trace_files, workdir, ["--eldr-occupancy-reports", "off"], "locality")
    try:
        before = _profiles(cluster)
        assert _reported_after_traffic(base) == [False, False]
        assert _profiles(cluster) == before  # and sends no profile
        assert wait_idle(base)["decode_inflight"] == [0, 0]
    finally:
        proc.stop()
