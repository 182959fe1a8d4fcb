"""Kubernetes discovery against a scripted fake API server (tests/_fake_kube.py) that speaks the
real pods LIST and WATCH protocol: the 410 re-list, the missed DELETE healed by the periodic
re-LIST, a pod flapping between Ready and not, a prefill pod without its bootstrap annotation, a
deletionTimestamp, a hanging server and one that answers garbage (the last good membership
stays, retried with back-off)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

pytest.importorskip("aiohttp")

from aiohttp.test_utils import TestServer  # noqa: E402

from eldr_sglang.router.discovery.flags import KubeSettings  # noqa: E402
from eldr_sglang.router.discovery.kube import KubeDiscovery  # noqa: E402
from eldr_sglang.router.discovery.membership import PrefillSpec  # noqa: E402
from _fake_kube import FakeKube, make_pod  # noqa: E402

PORT = 30000


async def until(pred, timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def run(fake: FakeKube, body, resync_s: float = 30.0, namespace: str | None = "default", **kw):
    """Run `body(kd, changes)` against the fake with discovery running beside it."""

    async def main():
        server = TestServer(fake.app())
        await server.start_server()
        settings = KubeSettings(prefill_selector={"component": "prefill"}, decode_selector={"component": "decode"},
                                selector={"app": "sglang"}, namespace=namespace, port=PORT,
                                api_url=str(server.make_url("")).rstrip("/"), resync_s=resync_s)
        changes = []
        kd = KubeDiscovery(settings, changes.append, **{"timeout_s": 0.3, "backoff_s": 0.05, "backoff_max_s": 0.2, **kw})
        task = asyncio.ensure_future(kd.run())
        try:
            await body(kd, changes)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.close()

    asyncio.run(main())


def decode_urls(kd):
    return sorted(kd.membership.decode) if kd.membership else None


def url(ip):
    return f"http://{ip}:{PORT}"


def test_discovery_lists_then_watches_adds_and_deletes():
    fake = FakeKube()

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill", bootstrap=8998))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await until(lambda: kd.membership is not None, what="first membership")
        assert kd.membership.prefill == (PrefillSpec(url("10.1.0.1"), 8998),)
        assert kd.membership.decode == (url("10.1.1.1"),)
        assert len(changes) == 1  # both roles listed before the first hand-over, so it is whole
        lists = fake.calls.copy()
        await fake.put(make_pod("decode-1", "10.1.1.2", "decode"))
        await until(lambda: decode_urls(kd) == [url("10.1.1.1"), url("10.1.1.2")], what="watched ADDED")
        await fake.delete("decode-0")
        await until(lambda: decode_urls(kd) == [url("10.1.1.2")], what="watched DELETED")
        # the changes came through the watch, not a re-list (resync is 30 s)
        assert sum(1 for c in fake.calls if "watch" not in c) == sum(1 for c in lists if "watch" not in c) == 2
        assert [c["labelSelector"] for c in fake.calls if "watch" not in c] == [
            "app=sglang,component=prefill", "app=sglang,component=decode"]
        assert all(c["path"] == "/api/v1/namespaces/default/pods" for c in fake.calls)
        assert all(c["auth"] is None for c in fake.calls)  # --kube-api: no token sent

    run(fake, body)


def test_discovery_pods_that_do_not_count():
    fake = FakeKube()

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-ok", "10.1.1.1", "decode"))
        await fake.put(make_pod("decode-pending", "10.1.1.2", "decode", phase="Pending", ready=False))
        await fake.put(make_pod("decode-noip", None, "decode", phase="Pending", ready=False))
        await fake.put(make_pod("decode-notready", "10.1.1.3", "decode", ready=False))
        await fake.put(make_pod("decode-otherapp", "10.1.1.4", "decode", app="other"))
        await fake.put(make_pod("decode-succeeded", "10.1.1.5", "decode", phase="Succeeded"))
        await until(lambda: kd.membership is not None)
        assert kd.membership.decode == (url("10.1.1.1"),)
        assert kd.state()["roles"]["decode"]["pods"] == 5  # otherapp is not selected at all
        # a deletionTimestamp drops the pod at once, before any DELETED event
        await fake.put(make_pod("decode-ok", "10.1.1.1", "decode", deleting=True))
        await until(lambda: kd.membership.decode == (), what="pod being deleted dropped")

    run(fake, body)


def test_discovery_410_gone_relists_and_catches_up():
    fake = FakeKube()

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await until(lambda: kd.membership is not None)
        await until(lambda: sum(1 for c in fake.calls if "watch" in c) >= 2, what="both watches open")
        await fake.expire()  # open watches get ERROR 410
        await until(lambda: kd.stats["decode"]["gone"] >= 1 and kd.stats["prefill"]["gone"] >= 1, what="410 seen")
        await until(lambda: kd.stats["decode"]["lists"] >= 2, what="re-list after 410")
        # a watch from a resourceVersion older than the history gets 410 too; its re-list sees the pod
        await fake.expire()
        await fake.put(make_pod("decode-1", "10.1.1.2", "decode"))
        await until(lambda: decode_urls(kd) == [url("10.1.1.1"), url("10.1.1.2")], what="pod added across a 410")
        assert kd.last_error["decode"] is None and kd.stats["decode"]["errors"] == 0  # 410 is no error

    run(fake, body)


def test_discovery_a_server_that_always_answers_410_is_backed_off():
    fake = FakeKube()
    fake.mode = "always_410"

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await until(lambda: kd.membership is not None)
        await asyncio.sleep(0.5)  # back-off reaches its 0.2 s ceiling
        n0 = kd.stats["decode"]["lists"]
        await asyncio.sleep(1.0)
        # a re-list at once after each 410 would be hundreds a second; backed off: at most ~6
        assert kd.stats["decode"]["lists"] - n0 <= 7
        assert kd.membership.decode == (url("10.1.1.1"),)  # the LISTs still keep it right

    run(fake, body)


def test_discovery_missed_delete_heals_at_the_next_relist():
    fake = FakeKube()
    resync = 0.6

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await fake.put(make_pod("decode-1", "10.1.1.2", "decode"))
        await until(lambda: kd.membership is not None and len(kd.membership.decode) == 2)
        await fake.delete("decode-0", event=False)  # the DELETED event is lost
        t0 = time.monotonic()
        await asyncio.sleep(0.1)
        assert decode_urls(kd) == [url("10.1.1.1"), url("10.1.1.2")]  # the watch did not say
        await until(lambda: decode_urls(kd) == [url("10.1.1.2")], timeout=3 * resync, what="reconcile")
        assert time.monotonic() - t0 <= resync + 0.5

    run(fake, body, resync_s=resync)


def test_discovery_pod_flapping_between_ready_and_not():
    fake = FakeKube()

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await fake.put(make_pod("decode-1", "10.1.1.2", "decode"))
        await until(lambda: kd.membership is not None and len(kd.membership.decode) == 2)
        seen = []
        for i in range(6):
            ready = i % 2 == 1
            await fake.put(make_pod("decode-1", "10.1.1.2", "decode", ready=ready))
            want = [url("10.1.1.1"), url("10.1.1.2")] if ready else [url("10.1.1.1")]
            await until(lambda: decode_urls(kd) == want, what=f"flap {i}")
            seen.append(len(kd.membership.decode))
        assert seen == [1, 2, 1, 2, 1, 2]
        # every flap was handed on, and nothing else
        assert [len(m.decode) for m in changes] == [2, 1, 2, 1, 2, 1, 2]

    run(fake, body)


def test_discovery_prefill_without_its_annotation_has_no_bootstrap_port(caplog):
    fake = FakeKube()

    async def body(kd, changes):
        await fake.put(make_pod("prefill-a", "10.1.0.1", "prefill", bootstrap=None))
        await fake.put(make_pod("prefill-b", "10.1.0.2", "prefill", bootstrap="not-a-port"))
        await fake.put(make_pod("prefill-c", "10.1.0.3", "prefill", bootstrap=9001))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode", bootstrap=None))
        await until(lambda: kd.membership is not None)
        assert kd.membership.prefill == (PrefillSpec(url("10.1.0.1"), None), PrefillSpec(url("10.1.0.2"), None),
                                         PrefillSpec(url("10.1.0.3"), 9001))
        # an unrelated change re-derives the membership; the warning is not repeated
        await fake.put(make_pod("decode-1", "10.1.1.2", "decode"))
        await until(lambda: len(kd.membership.decode) == 2)

    with caplog.at_level(logging.WARNING, logger="eldr.router.discovery"):
        run(fake, body)
    lines = [r.getMessage() for r in caplog.records if "bootstrap-port annotation" in r.getMessage()]
    assert len(lines) == 2 and "prefill-a" in lines[0] and "prefill-b" in lines[1]


def test_discovery_pod_matching_both_selectors_is_prefill_only():
    fake = FakeKube()

    async def body(kd, changes):
        both = make_pod("both-0", "10.1.2.1", "prefill")
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await fake.put(both)
        await until(lambda: kd.membership is not None)
        assert [w.url for w in kd.membership.prefill] == [url("10.1.2.1")]
        assert kd.membership.decode == (url("10.1.1.1"),)

    fake_settings_prefill = {"component": "prefill"}
    # the decode selector here is app=sglang alone, which the prefill pod matches too

    async def main():
        server = TestServer(fake.app())
        await server.start_server()
        s = KubeSettings(prefill_selector=fake_settings_prefill, decode_selector={"app": "sglang"}, selector={},
                         namespace=None, port=PORT, api_url=str(server.make_url("")).rstrip("/"), resync_s=30)
        kd = KubeDiscovery(s, lambda m: None, timeout_s=0.3, backoff_s=0.05)
        task = asyncio.ensure_future(kd.run())
        try:
            await body(kd, [])
            assert all(c["path"] == "/api/v1/pods" for c in fake.calls)  # every namespace
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.close()

    asyncio.run(main())


def test_discovery_hanging_api_server_keeps_the_last_good_membership(caplog):
    fake = FakeKube()

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await until(lambda: kd.membership is not None)
        good = kd.membership
        fake.mode = "hang"
        await until(lambda: min(kd.stats[r]["errors"] for r in ("prefill", "decode")) >= 4, timeout=5,
                    what="timeouts on the hanging server")
        assert kd.membership == good and len(changes) == 1
        assert "timed out" in kd.last_error["decode"]
        # back-off: after 4 failures each role waits 0.4 s between 0.1 s time-outs, so at most
        # 5 calls per role in 2 s (without it: 20)
        n0, t0 = len(fake.calls), time.monotonic()
        await asyncio.sleep(2.0)
        per_s = (len(fake.calls) - n0) / (time.monotonic() - t0)
        assert per_s <= 5.0, per_s
        fake.mode = "ok"
        await fake.put(make_pod("decode-1", "10.1.1.2", "decode"))
        await until(lambda: decode_urls(kd) == [url("10.1.1.1"), url("10.1.1.2")], what="recovery")
        assert kd.last_error["decode"] is None

    with caplog.at_level(logging.WARNING, logger="eldr.router.discovery"):
        run(fake, body, resync_s=0.4, timeout_s=0.1, backoff_max_s=0.4)
    logged = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    # one line per role for the whole outage, however many retries
    assert 1 <= len([m for m in logged if "(decode)" in m]) <= 2


def test_discovery_watch_that_never_answers_falls_back_to_relisting():
    fake = FakeKube()
    fake.mode = "hang_watch"

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await until(lambda: kd.membership is not None, what="membership from LIST alone")
        await until(lambda: kd.stats["decode"]["errors"] >= 1, what="WATCH time-out")
        assert "WATCH timed out" in kd.last_error["decode"]
        await fake.put(make_pod("decode-1", "10.1.1.2", "decode"))
        await until(lambda: decode_urls(kd) == [url("10.1.1.1"), url("10.1.1.2")], what="change seen by re-LIST")
        await fake.delete("decode-0")
        await until(lambda: decode_urls(kd) == [url("10.1.1.2")], what="delete seen by re-LIST")
        assert all(kd.stats[r]["events"] == 0 for r in ("prefill", "decode"))  # no watch ever delivered

    run(fake, body, timeout_s=0.2, backoff_max_s=0.2)


@pytest.mark.parametrize("mode", ["garbage", "not_podlist"])
def test_discovery_garbage_answers_keep_the_last_good_membership(mode):
    fake = FakeKube()

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await until(lambda: kd.membership is not None)
        good = kd.membership
        fake.mode = mode
        await until(lambda: kd.stats["decode"]["errors"] >= 2, what="garbage refused")
        assert kd.membership == good and len(changes) == 1
        assert ("not JSON" if mode == "garbage" else "not a PodList") in kd.last_error["decode"]
        fake.mode = "ok"
        await fake.delete("decode-0", event=False)
        await fake.put(make_pod("decode-1", "10.1.1.2", "decode"))
        await until(lambda: decode_urls(kd) == [url("10.1.1.2")], what="recovery")

    run(fake, body, resync_s=0.3)


def test_discovery_first_membership_waits_for_both_roles():
    fake = FakeKube()
    fake.mode = "hang"

    async def body(kd, changes):
        await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
        await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
        await asyncio.sleep(0.5)
        assert kd.membership is None and changes == []  # nothing listed, nothing handed on
        fake.mode = "ok"
        await until(lambda: kd.membership is not None, what="first membership after the outage")
        assert changes == [kd.membership]

    run(fake, body)


def test_discovery_hook_starts_from_kubernetes_and_waits_out_a_hanging_server():
    """The hook with Kubernetes alone starts from the first full LIST; beside --prefill/--decode,
    a hanging API server delays start-up by the grace period only."""
    from eldr_sglang.router.discovery.flags import DiscoverySettings
    from eldr_sglang.router.discovery.hook import MembershipHook
    from eldr_sglang.router.discovery.membership import Membership

    fake = FakeKube()

    async def main():
        server = TestServer(fake.app())
        await server.start_server()
        s = KubeSettings(prefill_selector={"component": "prefill"}, decode_selector={"component": "decode"},
                         selector={}, namespace="default", port=PORT, api_url=str(server.make_url("")).rstrip("/"))
        opts = {"timeout_s": 0.2, "backoff_s": 0.05, "backoff_max_s": 0.1}
        try:
            await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
            await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
            hook = MembershipHook(Membership(), DiscoverySettings(kube=s), kube_options=opts)
            await hook.start()
            try:
                m = await asyncio.wait_for(hook.first(), 5)
            finally:
                await hook.stop()
            assert m.prefill == (PrefillSpec(url("10.1.0.1"), 8998),) and m.decode == (url("10.1.1.1"),)

            fake.mode = "hang"
            static = Membership((PrefillSpec("http://p:1", None),), ("http://d:1",))
            hook = MembershipHook(static, DiscoverySettings(kube=s), kube_options=opts)
            await hook.start()
            t0 = time.monotonic()
            try:
                m = await asyncio.wait_for(hook.first(grace_s=0.5), 5)
                took = time.monotonic() - t0
                st = hook.status()
            finally:
                await hook.stop()
            assert m == static and 0.45 <= took < 2.0
            assert "timed out" in st["sources"]["kubernetes"]["roles"]["decode"]["last_error"]
        finally:
            await server.close()

    asyncio.run(main())


def test_discovery_in_cluster_uses_the_service_account_token_and_ca(tmp_path, monkeypatch):
    """Without --kube-api: https to $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, the server
    checked against the service account's ca.crt, its token sent and re-read (tokens rotate)."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    sa = tmp_path / "sa"
    sa.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "key.pem"),
                    "-out", str(sa / "ca.crt")], check=True, capture_output=True)
    (sa / "token").write_text("token-one\n")
    other = tmp_path / "other"  # a service account whose CA did not sign the server's certificate
    other.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "key2.pem"),
                    "-out", str(other / "ca.crt")], check=True, capture_output=True)
    (other / "token").write_text("token-x\n")
    import aiohttp

    sessions = []
    real_session = aiohttp.ClientSession

    def CountedSession(*a, **kw):
        sessions.append(real_session(*a, **kw))
        return sessions[-1]

    # both roles open the session at once; the CA is loaded in a thread meanwhile: one session each
    monkeypatch.setattr("eldr_sglang.router.discovery.kube.aiohttp.ClientSession", CountedSession)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(sa / "ca.crt", tmp_path / "key.pem")
    fake = FakeKube()

    async def main():
        server = TestServer(fake.app())
        await server.start_server(ssl=server_ctx)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
        s = KubeSettings(prefill_selector={"component": "prefill"}, decode_selector={"component": "decode"},
                         selector={}, namespace="default", port=PORT, api_url=None, resync_s=0.3)
        untrusted = KubeDiscovery(s, lambda m: None, timeout_s=1.0, backoff_s=0.05, sa_dir=str(other))
        task = asyncio.ensure_future(untrusted.run())
        await until(lambda: untrusted.stats["decode"]["errors"] >= 1, what="TLS refusal")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert untrusted.membership is None and "certificate" in untrusted.last_error["decode"].lower()
        assert fake.calls == []  # no request reached the server
        kd = KubeDiscovery(s, lambda m: None, timeout_s=1.0, backoff_s=0.05, sa_dir=str(sa))
        task = asyncio.ensure_future(kd.run())
        try:
            await fake.put(make_pod("prefill-0", "10.1.0.1", "prefill"))
            await fake.put(make_pod("decode-0", "10.1.1.1", "decode"))
            await until(lambda: kd.membership is not None, what="membership over TLS")
            (sa / "token").write_text("token-two\n")
            await until(lambda: fake.calls[-1]["auth"] == "Bearer token-two", what="rotated token")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.close()
        assert fake.calls[0]["auth"] == "Bearer token-one"
        assert len(sessions) == 2 and all(x.closed for x in sessions)  # one per discovery, closed at the end
        assert kd.membership.decode == (url("10.1.1.1"),)

    asyncio.run(main())
