"""Live membership on the emulated cluster (1 prefill, 3 decode workers): a router started with
--workers-file alone routes to a decode worker added to the file within 3 s, sends no new
request to one removed from it, loses no request through an add and a remove under load, keeps
the last good membership when the file is garbage, re-adds a worker fresh; POST/DELETE
/eldr/workers with and without the admin token (issue 31)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from eldr_sglang.testing.pd_cluster import get_json, metric, post, start_router  # noqa: E402

TIME_SCALE = 0.05
TRACE = dict(requests=40, seed=5, workers=3)
CLUSTER = dict(prefill=1, decode=3)
INTERVAL = 0.2
TOKEN = "s3cret-membership"
GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


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


def status(base):
    return get_json(base + "/eldr/status")


def decode_members(st) -> dict[str, str]:
    """slot (as the X-ELDR-Decode-Worker header gives it) -> url, of the serving decode workers."""
    return {str(w["slot"]): w["url"] for w in st["membership"]["workers"]["decode"] if w["state"] == "serving"}


def apply_file(path, base, cluster, decodes, timeout=5.0):
    """Write the file and wait until the router serves exactly `decodes` (the file's order aside)."""
    write(path, doc(cluster, decodes))
    deadline = time.monotonic() + timeout
    while True:
        st = status(base)
        if not st["membership"]["pending"] and set(decode_members(st).values()) == set(decodes):
            return st
        assert time.monotonic() < deadline, st["membership"]
        time.sleep(0.05)


def served_by(base, n=6) -> list[str]:
    workers = []
    for _ in range(n):
        code, headers, body = post(base + "/generate", GEN)
        assert code == 200, body
        workers.append(headers["X-ELDR-Decode-Worker"])
    return workers


def test_membership_file_add_is_routed_within_3s(started, cluster):
    path, base, _ = started
    d0, d1, _ = cluster["decode"]
    apply_file(path, base, cluster, [d0])
    assert set(served_by(base, 4)) == {str(s) for s in decode_members(status(base))}
    t0 = time.monotonic()
    write(path, doc(cluster, [d0, d1]))
    first = None
    while first is None and time.monotonic() - t0 < 3.0:
        code, headers, _ = post(base + "/generate", GEN)
        assert code == 200
        st = status(base)
        if decode_members(st).get(headers["X-ELDR-Decode-Worker"]) == d1:
            first = time.monotonic() - t0
    assert first is not None, f"no request reached the added decode worker in 3 s: {status(base)['membership']}"
    st = status(base)
    assert st["membership"]["pending"] is False and [w["url"] for w in st["membership"]["applied"]["decode"]] == [d0, d1]
    # round robin over both: 8 requests, 4 each
    got = served_by(base, 8)
    members = decode_members(st)
    assert sorted(members[w] for w in got) == sorted([d0, d1] * 4)


def test_membership_file_remove_gets_no_new_requests(started, cluster):
    path, base, _ = started
    d0, d1, _ = cluster["decode"]
    st = apply_file(path, base, cluster, [d0, d1])
    slot_d0 = next(s for s, u in decode_members(st).items() if u == d0)
    st = apply_file(path, base, cluster, [d1])
    assert slot_d0 not in decode_members(st)
    assert {w["state"] for w in st["membership"]["workers"]["decode"] if str(w["slot"]) == slot_d0} <= {"draining", "free"}
    got = served_by(base, 10)
    assert slot_d0 not in got and {decode_members(st)[w] for w in got} == {d1}
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert metric(text, "eldr_router_worker_slots", role="decode", state="serving") == 1
    assert metric(text, "eldr_router_membership_pending") == 0


def test_membership_garbage_file_keeps_the_last_good(started, cluster):
    path, base, _ = started
    d0, d1, _ = cluster["decode"]
    apply_file(path, base, cluster, [d0, d1])
    for garbage in ("{\"prefill\": [", json.dumps(doc(cluster, [])), json.dumps(doc(cluster, [d0, d0]))):
        refused = status(base)["membership"]["sources"]["workers_file"]["refused"]
        write(path, garbage)
        deadline = time.monotonic() + 5
        while status(base)["membership"]["sources"]["workers_file"]["refused"] == refused:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        st = status(base)
        assert st["membership"]["sources"]["workers_file"]["ok"] is False
        assert set(decode_members(st).values()) == {d0, d1} and st["membership"]["pending"] is False
        assert {decode_members(st)[w] for w in served_by(base, 4)} == {d0, d1}
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert metric(text, "eldr_router_discovery_source_ok", source="workers_file") == 0


def test_membership_add_and_remove_under_load_lose_no_request(started, cluster):
    path, base, _ = started
    d0, d1, d2 = cluster["decode"]
    apply_file(path, base, cluster, [d0, d1])
    stop = threading.Event()
    results: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def client():
        while not stop.is_set():
            try:
                code, headers, _ = post(base + "/generate", GEN, timeout=30)
                got = (code, headers.get("X-ELDR-Decode-Worker"))
            except OSError as exc:
                got = (0, repr(exc))
            with lock:
                results.append(got)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        st = apply_file(path, base, cluster, [d0, d1, d2])  # add under load
        slot_d2 = next(s for s, u in decode_members(st).items() if u == d2)
        time.sleep(1.0)
        st = apply_file(path, base, cluster, [d1, d2])  # remove under load
        with lock:
            after_remove = len(results)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    failures = [r for r in results if r[0] != 200]
    assert len(results) > 50 and failures == [], (len(results), failures[:5])
    assert any(w == slot_d2 for _, w in results), "the added worker got no request"
    slot_d0 = next(str(w["slot"]) for w in st["membership"]["workers"]["decode"] if w["url"] == d0)
    # requests started after the removal was applied (a margin of the 8 in flight then) avoid d0
    assert all(w != slot_d0 for _, w in results[after_remove + 8:])


def fault(url: str, mode: str) -> None:
    code, _, body = post(url + "/emulator/fault", {"mode": mode})
    assert code == 200, body


def test_membership_re_added_url_starts_fresh(started, cluster):
    path, base, _ = started
    d0, d1, _ = cluster["decode"]
    st = apply_file(path, base, cluster, [d0, d1])
    slot = next(s for s, u in decode_members(st).items() if u == d1)
    fault(d1, "error500")  # its failures eject it (the requests fail over to d0)
    try:
        for _ in range(60):
            code, _, _ = post(base + "/generate", GEN)
            assert code == 200
            w = next(w for w in status(base)["decode_workers"] if str(w["slot"]) == slot)
            if w["ejections"] >= 1:
                break
        assert w["ejections"] >= 1 and w["circuit"] != "closed", w
    finally:
        fault(d1, "none")
    apply_file(path, base, cluster, [d0])
    deadline = time.monotonic() + 5
    while next(w for w in status(base)["decode_workers"] if str(w["slot"]) == slot)["state"] != "free":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    st = apply_file(path, base, cluster, [d0, d1])
    assert decode_members(st)[slot] == d1  # the drained slot is reused...
    w = next(w for w in st["decode_workers"] if str(w["slot"]) == slot)
    assert (w["ejections"], w["circuit"], w["consecutive_failures"], w["state"]) == (0, "closed", 0, "serving")  # ...fresh
    assert {decode_members(st)[x] for x in served_by(base, 6)} == {d0, d1}


def admin(base, method, body, token=TOKEN):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(base + "/eldr/workers", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_membership_admin_endpoints_need_the_token(started, cluster, workdir):
    _, base, _ = started  # this router has no admin token: the endpoints are off
    code, body = admin(base, "POST", {"role": "decode", "url": cluster["decode"][2]})
    assert code == 403 and "--admin-token" in body["error"]["message"]
    d0, d1, d2 = cluster["decode"]
    proc, base = start_router({"prefill": cluster["prefill"], "decode": [d0, d1]}, workdir, [
        "--disagg-router", "round_robin", "--admin-token", TOKEN, "--health-check-interval-secs", "0.5"])
    try:
        add = {"role": "decode", "url": d2}
        assert admin(base, "POST", add, token=None)[0] == 401
        assert admin(base, "POST", add, token="wrong")[0] == 401
        assert admin(base, "DELETE", {"role": "decode", "url": d0}, token=None)[0] == 401
        assert len(decode_members(status(base))) == 2  # nothing changed
        code, body = admin(base, "POST", add)
        assert code == 200 and body["slot"] == 2 and body["members"]["decode"] == [d0, d1, d2]
        code, body = admin(base, "DELETE", {"role": "decode", "url": d0})  # a command-line worker: the overlay wins
        assert code == 200 and body["members"]["decode"] == [d1, d2]
        st = status(base)
        assert {decode_members(st)[w] for w in served_by(base, 6)} == {d1, d2}
        assert st["membership"]["admin"]["removed"] and st["membership"]["pending"] is False
        assert admin(base, "DELETE", {"role": "decode", "url": d1})[0] == 200
        code, body = admin(base, "DELETE", {"role": "decode", "url": d2})
        assert code == 409 and "last decode worker" in body["error"]["message"]
        code, body = admin(base, "DELETE", {"role": "prefill", "url": cluster["prefill"][0][0]})
        assert code == 409 and "last prefill worker" in body["error"]["message"]
        assert admin(base, "DELETE", {"role": "decode", "url": "http://127.0.0.1:9/"})[0] == 404
        for bad, why in ((b"{", "must be a JSON object"), ({"role": "router", "url": d0}, "role must be"),
                         ({"role": "decode"}, "must be a JSON object"), ({"role": "decode", "url": "d0"}, "not a URL"),
                         ({"role": "decode", "url": d0, "bootstrap-port": 1}, "unknown key 'bootstrap-port'"),
                         ({"role": "prefill", "url": d2, "bootstrap_port": 8998}, "already a decode worker")):
            code, body = admin(base, "POST", bad)
            assert code == 400 and why in body["error"]["message"], (bad, body)
        code, body = admin(base, "POST", {"role": "decode", "url": d0})  # POSTed again: back
        assert code == 200 and body["members"]["decode"] == [d0, d2]  # slot 0, drained, reused
        assert {decode_members(status(base))[w] for w in served_by(base, 4)} == {d0, d2}
    finally:
        proc.stop()
