"""The router started with --workers-file alone, on the emulated cluster (1 prefill, 2 decode):
it is built with the file's workers; a later change is seen within the interval and shown in
/eldr/status as desired but NOT applied (the core does not take runtime membership yet: the
router keeps routing to the workers it started with); a garbage version keeps the last good."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.testing.pd_cluster import get_json, metric, post, start_router  # noqa: E402

TIME_SCALE = 0.05
TRACE = dict(requests=40, seed=5, workers=2)
CLUSTER = dict(prefill=1, decode=2)
INTERVAL = 0.2


def write(path, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))
    os.replace(tmp, path)


def doc(cluster, decodes):
    (purl, bport), = cluster["prefill"]
    return {"prefill": [{"url": purl, "bootstrap_port": bport}], "decode": [{"url": u} for u in decodes]}


@pytest.fixture(scope="module")
def started(cluster, workdir):
    path = workdir / "workers.json"
    write(path, doc(cluster, cluster["decode"][:1]))
    proc, base = start_router({"prefill": [], "decode": []}, workdir, [
        "--workers-file", str(path), "--workers-file-interval", str(INTERVAL), "--disagg-router", "round_robin",
        "--load-monitor-interval", "0.2", "--health-check-interval-secs", "0.5"])
    yield path, base, proc
    proc.stop()


def wait_status(base, pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        st = get_json(base + "/eldr/status")
        if pred(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def served_by(base, n=6):
    workers = []
    for _ in range(n):
        status, headers, _ = post(base + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert status == 200
        workers.append(headers["X-ELDR-Decode-Worker"])
    return set(workers)


def test_discovery_router_starts_from_the_workers_file_and_shows_changes_pending(started, cluster):
    path, base, proc = started
    st = get_json(base + "/eldr/status")
    m = st["membership"]
    assert m["applied"] == m["desired"] == doc(cluster, cluster["decode"][:1]) and m["pending"] is False
    assert len(st["decode_workers"]) == 1 and len(st["prefill_workers"]) == 1
    assert served_by(base) == {"0"}

    # add the second decode worker to the file: seen within the interval, shown pending
    t0 = time.monotonic()
    write(path, doc(cluster, cluster["decode"]))
    st = wait_status(base, lambda s: s["membership"]["pending"])
    seen_after = time.monotonic() - t0
    m = st["membership"]
    assert m["pending"] is True and m["live_apply"] is False and seen_after < 3.0
    assert m["pending_change"]["added_decode"] == [cluster["decode"][1]]
    assert [w["url"] for w in m["desired"]["decode"]] == cluster["decode"]
    assert [w["url"] for w in m["applied"]["decode"]] == cluster["decode"][:1]
    # honest: not applied, so the router still routes to the one decode worker it started with
    assert len(st["decode_workers"]) == 1 and served_by(base) == {"0"}
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert metric(text, "eldr_router_membership_pending") == 1
    assert metric(text, "eldr_router_membership_workers", role="decode", state="desired") == 2
    assert metric(text, "eldr_router_membership_workers", role="decode", state="applied") == 1

    log = proc.log.read_text()
    assert f"membership changed (+decode {cluster['decode'][1]}) but is NOT applied" in log

    # garbage: refused, the last good (desired) membership stays
    write(path, "{\"prefill\": [")
    st = wait_status(base, lambda s: not s["membership"]["sources"]["workers_file"]["ok"])
    src = st["membership"]["sources"]["workers_file"]
    assert src["ok"] is False and "ends early" in src["last_error"] and src["refused"] >= 1
    assert [w["url"] for w in st["membership"]["desired"]["decode"]] == cluster["decode"]
    assert served_by(base, 2) == {"0"}
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert metric(text, "eldr_router_discovery_source_ok", source="workers_file") == 0

    # back to the started membership: nothing pending any more
    write(path, doc(cluster, cluster["decode"][:1]))
    st = wait_status(base, lambda s: not s["membership"]["pending"])
    assert st["membership"]["pending"] is False and st["membership"]["changes"] == 2
