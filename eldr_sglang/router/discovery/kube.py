"""Kubernetes pod discovery: LIST + WATCH of the API server's pods, per role, with aiohttp.

For each role (prefill, decode) a loop keeps a store of that role's pods, selected on the
server by its label selector:

1. LIST (GET /api/v1[/namespaces/NS]/pods?labelSelector=...): the PodList replaces the store
   whole (so a DELETE the watch missed heals here) and gives a resourceVersion.
2. WATCH from that resourceVersion (?watch=1, newline-delimited events): ADDED and MODIFIED
   replace a pod, DELETED drops it, BOOKMARK moves the resourceVersion, ERROR with a 410 Status
   (the version is too old) re-lists at once. A watch that ends by itself is re-opened.
3. Every `resync_s` the watch is cut and the loop re-lists (the periodic reconcile).

Any other failure (a timeout on a call, a connection refused, a non-200 answer, a body or an
event that is not what the protocol says) keeps the store as it was (the last good membership)
and retries after a back-off that doubles from `backoff_s` to `backoff_max_s`, reset once a
watch delivers events or a whole resync period goes well (so a LIST that works beside a watch
that always fails still backs off). A 410 re-lists at once; a run of them backs off too. One
log line per distinct failure in a row.

After every change the pods that count (pods.Pod.counts) become a Membership; it is handed to
`on_change` once both roles have been listed and only when it differs from the last one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from typing import Callable
from urllib.parse import urlencode

import aiohttp

from eldr_sglang.router.discovery.flags import KubeSettings
from eldr_sglang.router.discovery.membership import Membership, PrefillSpec, worker_key
from eldr_sglang.router.discovery.pods import Pod, matches, pod_from, selector_text

logger = logging.getLogger("eldr.router.discovery")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
ROLES = ("prefill", "decode")
MAX_LINE = 16 * 1024 * 1024  # one watch event (a pod object is KBs)


class KubeError(Exception):
    """A call that failed or answered what the protocol does not allow: retried with back-off."""


class Gone(KubeError):
    """410: the resourceVersion is too old; re-list at once."""


class KubeDiscovery:
    name = "kubernetes"

    def __init__(self, settings: KubeSettings, on_change: Callable[[Membership], None], *, timeout_s: float = 10.0,
                 backoff_s: float = 1.0, backoff_max_s: float = 30.0, sa_dir: str = SA_DIR):
        self.s = settings
        self.on_change = on_change
        self.timeout_s = timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.sa_dir = sa_dir
        self.stores: dict[str, dict[tuple, Pod]] = {r: {} for r in ROLES}
        self.listed = {r: False for r in ROLES}
        self.rv: dict[str, str | None] = {r: None for r in ROLES}
        self.stats = {r: {"lists": 0, "gone": 0, "events": 0, "errors": 0} for r in ROLES}
        self.last_error: dict[str, str | None] = {r: None for r in ROLES}  # None: the last LIST was good
        self._logged: dict[str, str | None] = {r: None for r in ROLES}  # the failure last logged, until a clean cycle
        self.membership: Membership | None = None
        self.changed_at: float | None = None
        self._warned_annotation: set[tuple] = set()
        self._session: aiohttp.ClientSession | None = None
        self._session_lock = asyncio.Lock()

    # ------------------------------------------------------------------ what it has found
    def state(self) -> dict:
        return {"selectors": self.s.describe(), "api": self.s.api_url or "in-cluster", "resync_s": self.s.resync_s,
                "roles": {r: {"listed": self.listed[r], "pods": len(self.stores[r]),
                              "counted": sum(p.counts for p in self.stores[r].values()), "resource_version": self.rv[r],
                              "last_error": self.last_error[r], **self.stats[r]} for r in ROLES},
                "changed_at": self.changed_at,
                "workers": self.membership.to_json() if self.membership is not None else None}

    def current(self) -> Membership:
        """The pods that count now, as workers: prefill pods with their bootstrap annotation;
        a pod that both role selectors match is prefill only; one IP:port once."""
        pre_sel = self.s.role_selector("prefill")
        seen: set[tuple] = set()
        prefill: list[PrefillSpec] = []
        decode: list[str] = []
        for role in ROLES:
            for pod in sorted(self.stores[role].values(), key=lambda p: p.key):
                if not pod.counts or (role == "decode" and matches(pod.labels, pre_sel)):
                    continue
                url = pod.url(self.s.port)
                if worker_key(url) in seen:
                    continue
                seen.add(worker_key(url))
                if role == "decode":
                    decode.append(url)
                    continue
                port = pod.bootstrap_port()
                if port is None and pod.key not in self._warned_annotation:
                    self._warned_annotation.add(pod.key)
                    logger.warning("prefill pod %s/%s has no valid %s annotation (%r): added with no bootstrap port, as "
                                   "smg does", pod.namespace, pod.name, "sglang.ai/bootstrap-port", pod.bootstrap)
                prefill.append(PrefillSpec(url, port))
        return Membership(tuple(prefill), tuple(decode))

    def _emit(self) -> None:
        if not all(self.listed.values()):
            return
        m = self.current()
        if m != self.membership:
            self.membership = m
            self.changed_at = time.time()
            self.on_change(m)

    # ------------------------------------------------------------------ the API server
    async def _headers(self) -> dict:
        if self.s.api_url is not None:
            return {"Accept": "application/json"}
        # bound service-account tokens rotate: read it for every call (a small file, off the loop)
        try:
            token = await asyncio.to_thread(_read_text, os.path.join(self.sa_dir, "token"))
        except (OSError, UnicodeDecodeError) as exc:
            raise KubeError(f"cannot read the service-account token: {exc}") from None
        return {"Accept": "application/json", "Authorization": f"Bearer {token.strip()}"}

    def _base(self) -> str:
        if self.s.api_url is not None:
            return self.s.api_url
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"

    def _url(self, role: str, **params) -> str:
        path = f"/api/v1/namespaces/{self.s.namespace}/pods" if self.s.namespace else "/api/v1/pods"
        query = {"labelSelector": selector_text(self.s.role_selector(role)), **params}
        return f"{self._base()}{path}?{urlencode(query)}"

    async def _session_get(self) -> aiohttp.ClientSession:
        async with self._session_lock:  # both roles start at once: one session, not two
            return await self._open_session()

    async def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            ctx = None
            if self.s.api_url is None:
                try:
                    ctx = await asyncio.to_thread(ssl.create_default_context, cafile=os.path.join(self.sa_dir, "ca.crt"))
                except (OSError, ssl.SSLError) as exc:
                    raise KubeError(f"cannot load the service-account CA: {exc}") from None
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx) if ctx else None)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def list_pods(self, role: str) -> None:
        """LIST: replaces the role's store and resourceVersion, or raises KubeError (store kept)."""
        session = await self._session_get()
        url, headers = self._url(role), await self._headers()

        async def get() -> tuple[int, bytes]:
            async with session.get(url, headers=headers) as resp:
                return resp.status, await resp.read()

        try:
            status, body = await asyncio.wait_for(get(), self.timeout_s)
        except asyncio.TimeoutError:
            raise KubeError(f"LIST timed out after {self.timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise KubeError(f"LIST failed: {type(exc).__name__}: {exc}") from None
        if status != 200:
            raise (Gone if status == 410 else KubeError)(f"LIST answered HTTP {status}: {_snippet(body)}")
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            raise KubeError(f"LIST answered something that is not JSON: {_snippet(body)}") from None
        rv = doc.get("metadata", {}).get("resourceVersion") if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict) else None
        items = doc.get("items") if isinstance(doc, dict) else None
        if not isinstance(items, list) or not isinstance(rv, str) or not rv:
            raise KubeError(f"LIST answered JSON that is not a PodList (items and metadata.resourceVersion): {_snippet(body)}")
        sel = self.s.role_selector(role)
        pods = [p for p in map(pod_from, items) if p is not None and matches(p.labels, sel)]
        self.stores[role] = {p.key: p for p in pods}
        self.rv[role] = rv
        self.listed[role] = True
        self.stats[role]["lists"] += 1
        self._emit()

    async def watch_pods(self, role: str) -> int:
        """WATCH from the role's resourceVersion until the server ends the stream: events applied
        as they come; returns how many. Raises Gone on a 410, KubeError on anything else."""
        session = await self._session_get()
        url = self._url(role, watch="1", resourceVersion=self.rv[role] or "", allowWatchBookmarks="true",
                        timeoutSeconds=str(max(1, int(self.s.resync_s))))
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s)
        headers = await self._headers()
        try:  # the time limit is on the answer's head, not on the stream
            resp = await asyncio.wait_for(session.get(url, headers=headers, timeout=timeout), self.timeout_s)
        except asyncio.TimeoutError:
            raise KubeError(f"WATCH timed out after {self.timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise KubeError(f"WATCH failed: {type(exc).__name__}: {exc}") from None
        async with resp:
            if resp.status != 200:
                body = await resp.content.read(2048)
                raise (Gone if resp.status == 410 else KubeError)(f"WATCH answered HTTP {resp.status}: {_snippet(body)}")
            n = 0
            try:
                async for line in _lines(resp.content):
                    self._event(role, line)
                    n += 1
            except (aiohttp.ClientError, OSError) as exc:
                raise KubeError(f"WATCH stream broke: {type(exc).__name__}: {exc}") from None
            return n

    def _event(self, role: str, line: bytes) -> None:
        try:
            ev = json.loads(line)
        except (ValueError, RecursionError):
            raise KubeError(f"WATCH sent a line that is not JSON: {_snippet(line)}") from None
        kind = ev.get("type") if isinstance(ev, dict) else None
        obj = ev.get("object") if isinstance(ev, dict) else None
        if not isinstance(obj, dict):
            raise KubeError(f"WATCH sent an event without an object: {_snippet(line)}")
        if kind == "ERROR":
            code = obj.get("code")
            raise (Gone if code == 410 else KubeError)(f"WATCH ERROR {code}: {_snippet(str(obj.get('message', '')).encode())}")
        md = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        if kind == "BOOKMARK":
            rv = md.get("resourceVersion")
            if isinstance(rv, str) and rv:
                self.rv[role] = rv
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            raise KubeError(f"WATCH sent an event of unknown type {kind!r}")
        pod = pod_from(obj)
        if pod is None:
            raise KubeError(f"WATCH sent a {kind} event whose object is not a pod: {_snippet(line)}")
        self.stats[role]["events"] += 1
        if kind == "DELETED" or not matches(pod.labels, self.s.role_selector(role)):
            self.stores[role].pop(pod.key, None)  # gone, or no longer selected
        else:
            self.stores[role][pod.key] = pod
        rv = md.get("resourceVersion")
        if isinstance(rv, str) and rv:
            self.rv[role] = rv
        self._emit()

    # ------------------------------------------------------------------ the loops
    def _failed(self, role: str, exc: Exception) -> None:
        msg = str(exc)
        self.stats[role]["errors"] += 1
        if msg != self._logged[role]:
            self._logged[role] = msg
            kept = "keeping the last good membership" if self.listed[role] else "no membership yet"
            logger.warning("kubernetes discovery (%s): %s; %s, retrying with back-off", role, msg, kept)
        self.last_error[role] = msg

    async def _watch_until_resync(self, role: str, deadline: float) -> None:
        """Watch (re-opening a stream the server ends) until the resync deadline."""
        loop = asyncio.get_running_loop()
        while (left := deadline - loop.time()) > 0:
            started = loop.time()
            try:
                n = await asyncio.wait_for(self.watch_pods(role), timeout=left)
            except asyncio.TimeoutError:
                return
            if n == 0 and loop.time() - started < 1.0:
                raise KubeError("WATCH ended at once with no event")

    async def run_role(self, role: str) -> None:
        loop = asyncio.get_running_loop()
        delay = self.backoff_s
        gone_streak = 0  # 410s with no event between them: past the first, a server that always says 410
        while True:
            try:
                await self.list_pods(role)
                self.last_error[role] = None
                events = self.stats[role]["events"]
                try:
                    await self._watch_until_resync(role, loop.time() + self.s.resync_s)
                finally:
                    if self.stats[role]["events"] != events:  # the watch worked for a while
                        gone_streak, delay = 0, self.backoff_s
                self._logged[role] = None  # a whole cycle went well: the next failure is news
                gone_streak, delay = 0, self.backoff_s
            except Gone as exc:
                self.stats[role]["gone"] += 1
                gone_streak += 1
                logger.info("kubernetes discovery (%s): %s; re-listing", role, exc)
                if gone_streak > 1:  # the first 410 re-lists at once; a run of them backs off
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.backoff_max_s)
            except Exception as exc:  # KubeError, or a bug: the loop must not die
                if not isinstance(exc, KubeError):
                    logger.exception("kubernetes discovery (%s): unexpected error", role)
                self._failed(role, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)

    async def run(self) -> None:
        logger.info("kubernetes discovery: %s, via %s", self.s.describe(), self.s.api_url or "the in-cluster API server")
        try:
            await asyncio.gather(*(self.run_role(r) for r in ROLES))
        finally:
            await self.close()


async def _lines(stream: aiohttp.StreamReader):
    """Newline-delimited lines of a stream (blank lines skipped), each at most MAX_LINE."""
    buf = b""
    async for chunk in stream.iter_any():
        buf += chunk
        while (i := buf.find(b"\n")) >= 0:
            line, buf = buf[:i].strip(), buf[i + 1:]
            if line:
                yield line
        if len(buf) > MAX_LINE:
            raise KubeError(f"WATCH sent a line over {MAX_LINE} bytes")
    if buf.strip():
        yield buf.strip()


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _snippet(body: bytes, n: int = 120) -> str:
    text = body[:n].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else "?" for c in text)
    return repr(text + ("..." if len(body) > n else ""))
