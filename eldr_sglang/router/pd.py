"""The per-request PD flow: prefill first, wait for the signature, bind decode late, stream back.

Late binding (ELDR; the default for --disagg-router eldr):
  1. pick a prefill worker, draw a bootstrap room, POST the request there (always streamed);
  2. read the prefill stream until its `eldr_signature` arrives (meta_info for /generate,
     sglext for the OpenAI endpoints), or the timeout passes (then: shortest queue);
  3. route with the Rust policy, take a queue slot (Lease) on the chosen decode worker;
  4. POST the same request, same bootstrap host/port/room, to that decode worker and stream
     its answer to the client, while the rest of the prefill stream is drained;
  5. release the slot exactly once: on completion, error, or client disconnect (the handler
     is cancelled; closing the upstream connections aborts the request on the workers).
Early binding (SGLang's usual flow, the default for the baselines): decode is picked first and
both legs are sent at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from aiohttp import web

from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.sglang_ext.payload import META_KEY, PayloadError, decode_payload, to_layout

logger = logging.getLogger("eldr.router")

ENDPOINTS = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# a write to a client that went away (aiohttp >= 3.10 has its own subclass)
_CLIENT_GONE = (ConnectionResetError,) + tuple(
    e for e in (getattr(aiohttp, "ClientConnectionResetError", None),) if e is not None
)


class BadRequest(ValueError):
    """The client's request is malformed (-> HTTP 400 with this message)."""


class UpstreamError(RuntimeError):
    def __init__(self, status: int, body: bytes, content_type: str | None, role: str):
        super().__init__(f"{role} worker answered HTTP {status}")
        self.status, self.body, self.content_type, self.role = status, body, content_type, role


class DecodeUnreachable(UpstreamError):
    """The decode worker refused the connection: it never saw the request, so another
    worker can take it (the prefill keeps the KV parked under the same room)."""


@dataclass
class SignatureResult:
    counts: np.ndarray | None
    reason: str  # 'ok' or why there is none
    wait_s: float
    data_bytes: int = 0


def validate_request(kind: str, body: object) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false")
    if kind == "generate":
        keys = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
        if not keys:
            raise BadRequest("/generate needs 'text' or 'input_ids'")
        v = body[keys[0]]
        if keys[0] == "text" and not isinstance(v, str):
            if isinstance(v, list):
                raise BadRequest("batch requests (a list of texts) are not supported: send one prompt per request")
            raise BadRequest("'text' must be a string")
        if keys[0] == "input_ids":
            if not isinstance(v, list) or not v:
                raise BadRequest("'input_ids' must be a non-empty list of token ids")
            if isinstance(v[0], list):
                raise BadRequest("batch requests (a list of id lists) are not supported: send one prompt per request")
            if not all(isinstance(t, int) for t in v):
                raise BadRequest("'input_ids' must hold integers")
        sp = body.get("sampling_params")
        if sp is not None and not isinstance(sp, dict):
            raise BadRequest("'sampling_params' must be an object")
    elif kind == "completions":
        p = body.get("prompt")
        if p is None:
            raise BadRequest("/v1/completions needs 'prompt'")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise BadRequest("batch prompts are not supported: send one prompt per request")
        elif not isinstance(p, (str, list)):
            raise BadRequest("'prompt' must be a string or a list of token ids")
    elif kind == "chat":
        m = body.get("messages")
        if not isinstance(m, list) or not m or not all(isinstance(x, dict) for x in m):
            raise BadRequest("/v1/chat/completions needs 'messages', a non-empty list of objects")
    if body.get("n", 1) != 1:
        raise BadRequest("n > 1 is not supported by the PD router")
    return body


def find_signature(event: dict) -> object | None:
    """The signature payload in one stream event, wherever the endpoint puts it."""
    meta = event.get("meta_info")
    if isinstance(meta, dict) and meta.get(META_KEY) is not None:
        return meta[META_KEY]
    ext = event.get("sglext")
    if isinstance(ext, dict) and ext.get(META_KEY) is not None:
        return ext[META_KEY]
    return None


def _sse_events(line: bytes):
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if not data or data == b"[DONE]":
        return None
    return data


class PDRouter:
    def __init__(self, cfg: RouterConfig):
        from eldr_sglang import _core

        self.cfg = cfg
        kw = dict(policy=cfg.policy, num_workers=len(cfg.decode), seed=cfg.seed,
                  reload_interval_ms=cfg.reload_interval_ms, load_report_ttl_ms=cfg.load_report_ttl_ms)
        if cfg.centroids:
            # The Rust set holds a private copy of the file's bytes, so an in-place overwrite
            # of the user's file cannot fault a route; a bad file is rejected on reload.
            kw["centroids"] = cfg.centroids
        if cfg.tau is not None:
            kw["tau"] = cfg.tau
        if cfg.load_factor is not None:
            kw["load_factor"] = cfg.load_factor
        try:
            self.router = _core.Router(**kw)
        except _core.CentroidFileError as exc:
            raise ValueError(str(exc)) from None
        self._generation = self.router.centroid_generation
        self._reload_failures = 0
        self._layout: tuple[int, int] | None = None
        self.on_centroids_reloaded()
        P, D = len(cfg.prefill), len(cfg.decode)
        self.prefill_inflight = [0] * P
        self.prefill_healthy = [True] * P
        self.decode_healthy = [True] * D
        self.reported: list[int | None] = [None] * D
        self.prefill_signs: list[bool | None] = [None] * P  # None: not known yet
        self._rr = 0
        self._rng = random.Random(cfg.seed)
        self.session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()
        self.drift = None  # eldr_sglang.drift.router_hook.DriftHook, set by the app when enabled
        self.metrics = RouterMetrics(self.state)

    # ------------------------------------------------------------------ state
    def on_centroids_reloaded(self) -> None:
        cs = self.router.centroid_set()
        if cs is not None:
            if cs.num_workers != len(self.cfg.decode):
                raise ValueError(
                    f"the centroid file has {cs.num_workers} workers, the router {len(self.cfg.decode)} decode workers"
                )
            self._layout = (cs.num_layers, cs.num_experts)

    def state(self) -> dict:
        return {
            "policy": self.cfg.policy,
            "late_binding": self.cfg.late_binding,
            "decode_loads": list(self.router.loads()),
            "decode_inflight": list(self.router.inflight()),
            "prefill_inflight": list(self.prefill_inflight),
            "decode_reported": list(self.reported),
            "decode_healthy": list(self.decode_healthy),
            "prefill_healthy": list(self.prefill_healthy),
            "prefill_signatures": list(self.prefill_signs),
            "centroid_generation": int(self.router.centroid_generation),
            "centroid_reload_failures": int(self.router.reload_failures),
            "last_reload_error": self.router.last_reload_error,
            "tau": float(self.router.tau),
            "load_factor": self.router.load_factor,
        }

    def set_healthy(self, role: str, i: int, ok: bool) -> None:
        if role == "decode":
            if self.decode_healthy[i] != ok:
                logger.warning("decode worker %d (%s) is now %s", i, self.cfg.decode[i], "healthy" if ok else "UNHEALTHY")
            self.decode_healthy[i] = ok
            self.router.set_healthy(i, ok)
        else:
            if self.prefill_healthy[i] != ok:
                logger.warning("prefill worker %d (%s) is now %s", i, self.cfg.prefill[i].url, "healthy" if ok else "UNHEALTHY")
            self.prefill_healthy[i] = ok

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s), read_bufsize=1 << 20
        )

    def check_centroids(self) -> bool:
        """Hot reload: True when a new centroid file is serving (swapped in by this check or
        by a route's own rate-limited check). A bad file raises CentroidFileError once and the
        previous centroids keep serving."""
        if not self.cfg.centroids:
            return False
        self.router.maybe_reload()
        failures = self.router.reload_failures  # also counts files a route's own check rejected
        if failures != self._reload_failures:
            self._reload_failures = failures
            raise _core_errors().CentroidFileError(self.router.last_reload_error or "centroid file rejected")
        gen = self.router.centroid_generation
        if gen == self._generation:
            return False
        self._generation = gen
        self.on_centroids_reloaded()
        return True

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ choices
    def pick_prefill(self) -> int:
        P = len(self.cfg.prefill)
        cand = [i for i in range(P) if self.prefill_healthy[i]] or list(range(P))
        pol = self.cfg.prefill_policy
        if pol == "random":
            return self._rng.choice(cand)
        if pol == "shortest_queue":
            return min(cand, key=lambda i: (self.prefill_inflight[i], i))
        for _ in range(P):
            i = self._rr % P
            self._rr += 1
            if i in cand:
                return i
        return cand[0]

    def route(self, sig: SignatureResult | None):
        t0 = time.perf_counter()
        if sig is None or sig.counts is None:
            d = self.router.route_signature(None, explain=True)
        else:
            d = self.router.route_dense(sig.counts, explain=True)
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        reason = d.reason
        self.metrics.routes.labels(str(d.worker), reason.split(":")[0]).inc()
        if reason == "band":
            self.metrics.band_size.observe(len(d.band))
            self.metrics.d_star.observe(d.d_star)
            self.metrics.d_chosen.observe(d.distances[d.worker])
        elif self.cfg.policy == "eldr":
            why = sig.reason if (sig is not None and sig.counts is None) else reason
            self.metrics.fallbacks.labels(why).inc()
        if self.drift is not None:  # O(K) monitor update; never raises
            self.drift.on_route(d, None if sig is None else sig.counts)
        return d

    # ------------------------------------------------------------------ signature
    def _signature_from(self, raw: object, t0: float) -> SignatureResult:
        wait = time.perf_counter() - t0
        if isinstance(raw, list) and len(raw) >= 1:  # meta_info holds per-token values
            raw = raw[0]
        if isinstance(raw, dict) and "none" in raw and raw.get("v") == 1:
            return SignatureResult(None, f"prefill_none:{raw.get('none')}", wait)
        if self._layout is None:
            return SignatureResult(None, "no_centroids", wait)
        try:
            dec = decode_payload(raw)
            counts = to_layout(dec, *self._layout)
        except PayloadError as exc:
            self.metrics.malformed.inc()
            logger.warning("malformed signature payload: %s", exc)
            return SignatureResult(None, "malformed", wait)
        self.metrics.sig_bytes.observe(dec.data_bytes)
        return SignatureResult(counts, "ok", wait, dec.data_bytes)

    async def _await_signature(self, presp: aiohttp.ClientResponse, t0: float) -> SignatureResult:
        """Read prefill stream events until the signature; the rest is left for the drain."""
        last = None
        async for line in presp.content:
            data = _sse_events(line)
            if data is None:
                continue
            try:
                event = json.loads(data)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            last = event
            raw = find_signature(event)
            if raw is not None:
                return self._signature_from(raw, t0)
            if isinstance(event.get("error"), (dict, str)):
                break
        # The prefill ended the request before any signature: it failed or was aborted.
        msg = "prefill worker ended the request before its signature"
        if isinstance(last, dict):
            fr = (last.get("meta_info") or {}).get("finish_reason") or last.get("error")
            if fr:
                msg += f": {json.dumps(fr)[:500]}"
        raise UpstreamError(502, json.dumps({"error": {"message": msg}}).encode(), "application/json", "prefill")

    # ------------------------------------------------------------------ request
    async def handle(self, request: web.Request) -> web.StreamResponse:
        kind = ENDPOINTS[request.path]
        status = 500
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise BadRequest("the request body is not valid JSON") from None
            body = validate_request(kind, body)
            resp = await self._serve(request, kind, body)
            status = resp.status
            return resp
        except BadRequest as exc:
            status = 400
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}}, status=400)
        except UpstreamError as exc:
            status = exc.status
            return web.Response(body=exc.body, status=exc.status, content_type=(exc.content_type or "application/json").split(";")[0])
        except _core_errors().NoHealthyWorker:
            status = 503
            return web.json_response({"error": {"message": "no healthy decode worker"}}, status=503)
        except asyncio.CancelledError:
            status = 499
            self.metrics.disconnects.inc()
            raise
        except _CLIENT_GONE:
            status = 499
            self.metrics.disconnects.inc()
            raise
        finally:
            self.metrics.requests.labels(kind, str(status)).inc()

    def _bootstrap(self, p: int) -> dict:
        w = self.cfg.prefill[p]
        return {"bootstrap_host": w.host, "bootstrap_port": w.bootstrap_port, "bootstrap_room": random.getrandbits(63)}

    async def _serve(self, request: web.Request, kind: str, body: dict) -> web.StreamResponse:
        p = self.pick_prefill()
        self.metrics.prefill_routes.labels(str(p)).inc()
        boot = self._bootstrap(p)
        client_stream = bool(body.get("stream", False))
        dbody = {**body, **boot}
        pbody = {**body, **boot}
        late = self.cfg.late_binding
        no_sig = late and self.prefill_signs[p] is False
        if no_sig:
            late = False  # this prefill never streams a signature: do not wait for one
        if late:
            pbody["stream"] = True
        purl = f"{self.cfg.prefill[p].url}{request.path}"
        self.prefill_inflight[p] += 1
        presp: aiohttp.ClientResponse | None = None
        drain: asyncio.Future | None = None
        ok = False
        try:
            if late:
                t0 = time.perf_counter()
                try:
                    presp = await self.session.post(purl, json=pbody)
                except aiohttp.ClientError as exc:
                    self.metrics.worker_errors.labels("prefill", str(p), "connect").inc()
                    raise UpstreamError(502, _err(f"prefill worker {p} unreachable: {exc}"), "application/json", "prefill") from None
                if presp.status != 200:
                    self.metrics.worker_errors.labels("prefill", str(p), f"http_{presp.status}").inc()
                    raise UpstreamError(presp.status, await presp.read(), presp.content_type, "prefill")
                try:
                    sig = await asyncio.wait_for(self._await_signature(presp, t0), self.cfg.signature_timeout_s)
                except asyncio.TimeoutError:
                    sig = SignatureResult(None, "timeout", time.perf_counter() - t0)
                except aiohttp.ClientError as exc:
                    self.metrics.worker_errors.labels("prefill", str(p), "stream").inc()
                    raise UpstreamError(502, _err(f"prefill worker {p} stream failed: {exc}"), "application/json", "prefill") from None
                self.metrics.sig_wait.observe(sig.wait_s)
                drain = asyncio.ensure_future(_drain(presp))
                decision = self.route(sig)
            else:
                decision = self.route(SignatureResult(None, "prefill_no_signature", 0.0) if no_sig else None)
                drain = asyncio.ensure_future(self._early_prefill(purl, pbody, p))
            if late:
                resp = await self._decode_with_failover(request, kind, p, boot, dbody, decision, client_stream, sig)
            else:
                resp = await self._decode_racing_prefill(request, kind, p, boot, dbody, decision, client_stream, drain)
            ok = True
            return resp
        finally:
            self.prefill_inflight[p] -= 1
            if drain is not None and not drain.done():
                if ok:  # the prefill's last event may trail the decode's answer: let it end
                    self._finish_later(drain, presp)
                    presp = None
                else:  # error or client gone: closing the stream aborts the prefill request
                    drain.cancel()
            if presp is not None:
                presp.release()

    def _finish_later(self, drain: asyncio.Future, presp: aiohttp.ClientResponse | None) -> None:
        async def finish():
            try:
                await asyncio.wait_for(drain, timeout=60)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            finally:
                if presp is not None:
                    presp.release()

        task = asyncio.ensure_future(finish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _early_prefill(self, url: str, body: dict, p: int) -> UpstreamError | None:
        """The prefill leg of early binding; returns its failure (None when it succeeded)."""
        try:
            async with self.session.post(url, json=body) as r:
                data = await r.read()
                if r.status != 200:
                    self.metrics.worker_errors.labels("prefill", str(p), f"http_{r.status}").inc()
                    return UpstreamError(r.status, data, r.content_type, "prefill")
        except aiohttp.ClientError as exc:
            self.metrics.worker_errors.labels("prefill", str(p), "connect").inc()
            return UpstreamError(502, _err(f"prefill worker {p} unreachable: {exc}"), "application/json", "prefill")
        return None

    async def _decode_racing_prefill(self, request, kind, p, boot, dbody, decision, client_stream, prefill):
        """Early binding: both legs run at once; a failed prefill ends the request (the decode
        leg would otherwise wait for KV that never comes)."""
        state: dict = {}
        dec = asyncio.ensure_future(self._decode(request, kind, p, boot, dbody, decision, client_stream, state))
        try:
            done, _ = await asyncio.wait({dec, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if dec not in done and prefill.result() is not None:
                dec.cancel()
                await asyncio.gather(dec, return_exceptions=True)
                err = prefill.result()
                out = state.get("out")
                if out is None:
                    raise err
                # the client's stream has started: end it with an error event
                with contextlib.suppress(*_CLIENT_GONE, RuntimeError):
                    await out.write(b"data: " + err.body + b"\n\n")
                    await out.write_eof()
                return out
            return await dec
        finally:
            if not dec.done():
                dec.cancel()
                await asyncio.gather(dec, return_exceptions=True)

    async def _decode_with_failover(self, request, kind, p, boot, dbody, decision, client_stream, sig):
        """Late binding: a decode worker that refuses the connection is marked unhealthy at
        once (without waiting for the health check) and the request is routed again among
        the others; at most once per decode worker."""
        for _ in range(len(self.cfg.decode)):
            try:
                return await self._decode(request, kind, p, boot, dbody, decision, client_stream)
            except DecodeUnreachable as exc:
                last = exc
                try:
                    decision = self.route(sig)
                except _core_errors().NoHealthyWorker:
                    break
                self.metrics.decode_failovers.inc()
        raise last

    async def _decode(self, request, kind, p, boot, dbody, decision, client_stream, state=None) -> web.StreamResponse:
        w = decision.worker
        headers = {}
        if self.cfg.explain_headers:
            headers = {
                "X-ELDR-Decode-Worker": str(w),
                "X-ELDR-Prefill-Worker": str(p),
                "X-ELDR-Reason": decision.reason,
                "X-ELDR-Bootstrap-Room": str(boot["bootstrap_room"]),
            }
            if decision.band is not None:
                headers["X-ELDR-Band"] = ",".join(map(str, decision.band))
        durl = f"{self.cfg.decode[w]}{request.path}"
        with self.router.acquire(w, 0):
            try:
                dresp = await self.session.post(durl, json=dbody)
            except aiohttp.ClientConnectorError as exc:
                self.metrics.worker_errors.labels("decode", str(w), "connect").inc()
                self.set_healthy("decode", w, False)  # the health check brings it back
                raise DecodeUnreachable(502, _err(f"decode worker {w} unreachable: {exc}"), "application/json", "decode") from None
            except aiohttp.ClientError as exc:
                self.metrics.worker_errors.labels("decode", str(w), "connect").inc()
                raise UpstreamError(502, _err(f"decode worker {w} unreachable: {exc}"), "application/json", "decode") from None
            try:
                if dresp.status != 200:
                    self.metrics.worker_errors.labels("decode", str(w), f"http_{dresp.status}").inc()
                    raise UpstreamError(dresp.status, await dresp.read(), dresp.content_type, "decode")
                if not client_stream:
                    data = await dresp.read()
                    return web.Response(body=data, status=200, headers=headers, content_type=dresp.content_type)
                out = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **headers})
                await out.prepare(request)
                if state is not None:
                    state["out"] = out
                try:
                    async for chunk in dresp.content.iter_any():
                        await out.write(chunk)
                except aiohttp.ClientError as exc:
                    self.metrics.worker_errors.labels("decode", str(w), "stream").inc()
                    await out.write(b"data: " + _err(f"decode worker {w} stream failed: {exc}") + b"\n\n")
                await out.write_eof()
                return out
            finally:
                dresp.release()


def _core_errors():
    from eldr_sglang import _core

    return _core


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read the prefill stream to its end: closing it early would abort the KV transfer."""
    try:
        async for _ in resp.content.iter_any():
            pass
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass


def _err(msg: str) -> bytes:
    return json.dumps({"error": {"message": msg}}).encode()
