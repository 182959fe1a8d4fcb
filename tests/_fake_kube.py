"""A scripted fake Kubernetes API server for the discovery tests: it speaks the real pods LIST
and WATCH protocol with the real response shapes, on an aiohttp test server.

- LIST  GET /api/v1/namespaces/NS/pods?labelSelector=k=v,...  and  GET /api/v1/pods?...:
  a v1 PodList, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": RV},
  "items": [Pod, ...]}, the pods the selector matches.
- WATCH the same path with watch=1&resourceVersion=RV[&timeoutSeconds=T]: HTTP 200 and a stream
  of newline-delimited {"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": ...}
  events after RV; a pod that stops matching the selector comes as DELETED, one that starts
  matching as ADDED (the API server's filtered watch). A resourceVersion older than the kept
  history gets an ERROR event whose object is a v1 Status with code 410 (Expired), as the watch
  cache answers, and the stream ends.

Scripted faults: `hang` (every call waits forever), `hang_watch` (a WATCH never answers, as
behind a proxy that buffers streams; LIST works), `always_410` (every WATCH answers 410), `garbage` (LIST answers an HTML page, a
WATCH a line that is not JSON), `not_podlist` (LIST answers JSON that is not a PodList),
`delete(..., event=False)` (the pod goes without a DELETED event: the missed DELETE),
`expire()` (history dropped and every open watch told 410).
"""

from __future__ import annotations

import asyncio
import copy
import json

from aiohttp import web


def make_pod(name: str, ip: str | None, role: str, *, ready: bool = True, phase: str = "Running",
             bootstrap: str | int | None = 8998, namespace: str = "default", app: str = "sglang",
             deleting: bool = False) -> dict:
    """A v1 Pod as the API server returns it, labelled app=APP, component=ROLE."""
    annotations = {"kubectl.kubernetes.io/restartedAt": "2026-12-01T00:00:00Z"}
    if bootstrap is not None:
        annotations["sglang.ai/bootstrap-port"] = str(bootstrap)
    cond = "True" if ready else "False"
    pod = {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
                     "creationTimestamp": "2026-12-01T00:00:00Z", "generateName": name.rsplit("-", 1)[0] + "-",
                     "labels": {"app": app, "component": role, "pod-template-hash": "5d8f7c9b4"},
                     "annotations": annotations,
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{role}-5d8f7c9b4",
                                          "uid": "rs-uid", "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"containers": [{"name": "sglang", "image": "lmsysorg/sglang:v0.5.23",
                                 "ports": [{"containerPort": 80, "protocol": "TCP"}]}],
                 "nodeName": "node-1", "restartPolicy": "Always", "serviceAccountName": "default"},
        "status": {"phase": phase, "hostIP": "10.0.0.1", "startTime": "2026-12-01T00:00:01Z",
                   "conditions": [{"type": "Initialized", "status": "True"}, {"type": "Ready", "status": cond},
                                  {"type": "ContainersReady", "status": cond}, {"type": "PodScheduled", "status": "True"}],
                   "qosClass": "BestEffort"},
    }
    if ip is not None:
        pod["status"]["podIP"] = ip
        pod["status"]["podIPs"] = [{"ip": ip}]
    if deleting:
        pod["metadata"]["deletionTimestamp"] = "2026-12-01T01:00:00Z"
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
    return pod


def _selector(text: str) -> dict:
    out = {}
    for part in filter(None, (text or "").split(",")):
        k, _, v = part.partition("=")
        out[k] = v
    return out


def _matches(pod: dict | None, sel: dict) -> bool:
    labels = (pod or {}).get("metadata", {}).get("labels", {})
    return pod is not None and all(labels.get(k) == v for k, v in sel.items())


class FakeKube:
    def __init__(self):
        self.rv = 1000
        self.pods: dict[tuple, dict] = {}
        self.history: list[tuple[int, dict | None, dict | None]] = []  # (rv, old, new)
        self.oldest = self.rv  # a watch from before this gets 410
        self.mode = "ok"  # ok | hang | hang_watch | always_410 | garbage | not_podlist
        self.calls: list[dict] = []  # every request's query
        self._changed = asyncio.Condition()
        self._expired = 0

    # ---------------------------------------------------------------- the script
    async def _record(self, old: dict | None, new: dict | None) -> None:
        self.history.append((self.rv, old, new))
        async with self._changed:
            self._changed.notify_all()

    def _bump(self, pod: dict) -> dict:
        self.rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        return pod

    async def put(self, pod: dict) -> None:
        """Create or update a pod (an ADDED or MODIFIED event)."""
        md = pod["metadata"]
        key = (md["namespace"], md["name"])
        old, new = self.pods.get(key), self._bump(pod)
        self.pods[key] = new
        await self._record(old, new)

    async def delete(self, name: str, namespace: str = "default", event: bool = True) -> None:
        """Remove a pod; event=False: no DELETED event is ever sent (the missed DELETE)."""
        old = self.pods.pop((namespace, name))
        self.rv += 1
        if event:
            await self._record(old, None)

    async def expire(self) -> None:
        """Compact the history: every open watch gets ERROR 410 and ends; a watch from an older
        resourceVersion gets the same."""
        self.oldest = self.rv
        self.history.clear()
        self._expired += 1
        async with self._changed:
            self._changed.notify_all()

    # ---------------------------------------------------------------- the API
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self.pods_handler)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self.pods_handler)
        return app

    async def pods_handler(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        q["path"] = request.path
        q["auth"] = request.headers.get("Authorization")
        self.calls.append(q)
        if self.mode == "hang" or (self.mode == "hang_watch" and q.get("watch")):
            await asyncio.sleep(3600)
        ns = request.match_info.get("ns")
        sel = _selector(q.get("labelSelector", ""))
        if q.get("watch") in ("1", "true"):
            return await self._watch(request, ns, sel, q)
        if self.mode == "garbage":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        if self.mode == "not_podlist":
            return web.json_response({"kind": "Status", "items": "none"})
        items = [p for (pns, _), p in sorted(self.pods.items()) if (ns is None or pns == ns) and _matches(p, sel)]
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    @staticmethod
    def _event(sel: dict, ns: str | None, old: dict | None, new: dict | None) -> dict | None:
        obj = new or old
        if ns is not None and obj["metadata"]["namespace"] != ns:
            return None
        was, now = _matches(old, sel), _matches(new, sel)
        if now:
            return {"type": "MODIFIED" if was else "ADDED", "object": new}
        if was:
            return {"type": "DELETED", "object": new or old}
        return None

    async def _watch(self, request: web.Request, ns, sel, q) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        since = int(q.get("resourceVersion") or self.rv)
        timeout = float(q.get("timeoutSeconds", 3600))
        if self.mode == "garbage":
            await resp.write(b"this is not json\n")
            return resp
        expired_at_start = self._expired
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            if since < self.oldest or self._expired != expired_at_start or self.mode == "always_410":
                status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                          "message": f"too old resource version: {since} ({self.oldest})", "reason": "Expired", "code": 410}
                await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
                return resp
            for rv, old, new in [h for h in self.history if h[0] > since]:
                since = rv
                ev = self._event(sel, ns, old, new)
                if ev is not None:
                    await resp.write(json.dumps(ev).encode() + b"\n")
            left = end - loop.time()
            if left <= 0:
                return resp
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    return resp
