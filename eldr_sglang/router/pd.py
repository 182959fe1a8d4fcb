"""The per-request PD flow: prefill first, wait for the signature, bind decode late, stream back.

Late binding (ELDR; the default for --disagg-router eldr):
  1. pick a routable prefill worker, draw a bootstrap room, POST the request there (always
     streamed); no response head within the first-byte timeout, a refused connection, a
     5xx or a stream that ends before its signature is the prefill's failure, and the
     request starts over on another prefill with a new room (at most --retries times);
  2. read the prefill stream until its `eldr_signature` arrives (meta_info for /generate,
     sglext for the OpenAI endpoints), or the timeout passes (then: shortest queue);
  3. route with the Rust policy, take a queue slot (Lease) on the chosen decode worker;
  4. POST the same request, same bootstrap host/port/room, to that decode worker; the client
     gets nothing until the decode's first chunk, so a decode that fails before it (refused,
     5xx, no first byte in time) is charged and the request goes to another decode worker
     with the same room (the prefill keeps the KV parked); then stream its answer to the
     client, each chunk within the stall timeout, while the rest of the prefill stream is
     drained; a failure after the first byte ends the client's stream with an error event;
  5. release the slot exactly once: on completion, error, or client disconnect (the handler
     is cancelled; closing the upstream connections aborts the request on the workers).
Early binding (SGLang's usual flow, the default for the baselines): decode is picked first and
both legs are sent at once; failures are charged but not re-sent.
Worker availability (health checks and outlier ejection) lives in `router.outlier`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from eldr_sglang.router.config import COUNTS_POLICIES, RouterConfig
from eldr_sglang.router.logsafe import RateLimitedLog, safe
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.outlier import RetryBudget, WorkerPool
from eldr_sglang.sglang_ext.payload import META_KEY, PayloadError, decode_payload

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger("eldr.router")

ENDPOINTS = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# a write to a client that went away (aiohttp >= 3.10 has its own subclass)
_CLIENT_GONE = (ConnectionResetError,) + tuple(
    e for e in (getattr(aiohttp, "ClientConnectionResetError", None),) if e is not None
)


class BadRequest(ValueError):
    """The client's request is malformed (-> HTTP 400, or `status`, with this message)."""

    def __init__(self, msg: str, status: int = 400):
        super().__init__(msg)
        self.status = status


class UpstreamError(RuntimeError):
    def __init__(self, status: int, body: bytes, content_type: str | None, role: str):
        super().__init__(f"{role} worker answered HTTP {status}")
        self.status, self.body, self.content_type, self.role = status, body, content_type, role


class Retryable(UpstreamError):
    """A worker failed before any byte reached the client (refused connection, timeout, 5xx,
    a stream that broke before its first chunk): another worker may take the request.
    `cause` is what the outlier detector is told."""

    def __init__(self, status: int, body: bytes, content_type: str | None, role: str, cause: str):
        super().__init__(status, body, content_type, role)
        self.cause = cause


@dataclass
class RetryDecision:
    """A decode choice made for a re-send: the least loaded routable worker not tried yet."""

    worker: int
    generation: int
    reason: str = "retry"
    band: list[int] | None = None
    distances: list[float] | None = None
    d_star: float = float("nan")


# Bounds on what a worker can make the router read: a stream event (the signature one is
# <= 16 KiB by default) and an error body passed on to the client.
MAX_EVENT_BYTES = 1 << 20
MAX_ERROR_BYTES = 64 << 10
@dataclass
class CountsResult:
    """What the prefill's stream gave: its decoded counts (routed from in place), or why none."""

    counts: object | None  # eldr_sglang._core.DecodedCounts
    reason: str  # 'ok', or why there is none: a _core.FALLBACK_REASONS name
    wait_s: float
    data_bytes: int = 0
    tokens: int = 0  # prompt tokens behind the counts (the locality balancer's denominator)
    profile: object | None = None  # _core.ExpertProfile, built once by PDRouter._locality_route


_META_KEY_BYTES = f'"{META_KEY}"'.encode()


def __getattr__(name: str):
    if name == "SignatureResult":  # renamed: it carries raw counts, not the normalized signature
        import warnings

        warnings.warn("SignatureResult is now CountsResult", DeprecationWarning, stacklevel=2)
        return CountsResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


# Client bodies above this are parsed in the body-parse process: json.loads holds the GIL for
# its whole run, so a thread would not free the event loop (an 8 MiB list of token ids took
# 0.7-0.9 s here, in a thread or not). Below it a parse takes a few ms.
LARGE_BODY_BYTES = 256 << 10
_ROUTER_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "stream")


@dataclass
class RawBody:
    """A large client body, parsed and validated in the body-parse process: its JSON text,
    re-encoded there without the fields the router sets, and its stream flag. The router
    sends it on without parsing or encoding it again (`with_fields` splices the fields in)."""

    text: bytes  # a compact JSON object
    stream: bool

    def get(self, key: str, default=None):
        return self.stream if key == "stream" else default

    def with_fields(self, fields: dict) -> bytes:
        extra = json.dumps(fields, separators=(",", ":")).encode()
        return extra if self.text == b"{}" else self.text[:-1] + b"," + extra[1:]


def parse_large_body(kind: str, raw: bytes) -> tuple:
    """In the body-parse process: ("ok", stream, text) or ("bad", status, message)."""
    try:
        body = validate_request(kind, json.loads(raw))
    except BadRequest as exc:
        return ("bad", exc.status, str(exc))
    except (ValueError, UnicodeDecodeError):
        return ("bad", 400, "the request body is not valid JSON")
    except RecursionError:
        return ("bad", 400, "the request body is nested too deeply")
    stream = bool(body.get("stream", False))
    for k in _ROUTER_FIELDS:
        body.pop(k, None)
    return ("ok", stream, json.dumps(body, separators=(",", ":")).encode())


def leg_body(body: "dict | RawBody", fields: dict) -> "dict | bytes":
    """The body of one upstream leg: the client's, with the router's fields set."""
    if isinstance(body, RawBody):
        return body.with_fields({"stream": body.stream, **fields})
    return {**body, **fields}


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
        # reload_interval_ms=0: the Rust route path never touches the file (its own
        # rate-limited check would stat and read it on the event loop); the service checks
        # the file in a worker thread instead (reload_centroids).
        if cfg.policy == "locality" and not cfg.centroids:
            raise ValueError("policy locality needs a centroid file (its layer selection): give --eldr-centroids")
        kw = dict(policy=cfg.policy, num_workers=len(cfg.decode), seed=cfg.seed,
                  reload_interval_ms=0, load_report_ttl_ms=cfg.load_report_ttl_ms)
        if cfg.centroids:
            # The Rust set holds a private copy of the file's bytes, so an in-place overwrite
            # of the user's file cannot fault a route; a bad file is rejected on reload. Its
            # reader opens regular files only, without blocking, and checks the header against
            # the size before reading the body (a FIFO or a huge file fails fast, at start too).
            kw["centroids"] = cfg.centroids
        if cfg.tau is not None:
            kw["tau"] = cfg.tau
        if cfg.load_factor is not None:
            kw["load_factor"] = cfg.load_factor
        try:
            self.router = _core.Router(**kw)
        except _core.CentroidFileError as exc:
            raise ValueError(str(exc)) from None
        self._decode_event = _core.decode_event
        self._generation = self.router.centroid_generation
        self._reload_failures = 0
        self._layout: tuple[int, int] | None = None
        self.on_centroids_reloaded()
        D = len(cfg.decode)
        self.reported: list[int | None] = [None] * D
        self.prefill_signs: list[bool | None] = [None] * len(cfg.prefill)  # None: not known yet
        self._rr = 0
        self._rng = random.Random(cfg.seed)
        self.session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()
        self._reload_pool = None  # one thread: a stuck file read never takes another thread
        self._parse_pool = None  # the body-parse process (large client bodies), spawned on first use
        self._reload_busy_since: float | None = None
        self.drift = None  # eldr_sglang.drift.router_hook.DriftHook, set by the app when enabled
        self._band_gen, self._band_spec, self._band_mu = None, None, None  # _drift_view's cache, per generation
        self.metrics = RouterMetrics(self.state)
        pool_kw = dict(threshold=cfg.eject_after_failures, base_s=cfg.eject_base_s, max_s=cfg.eject_max_s,
                       metrics=self.metrics)
        # Prefill and decode availability live in one place each: health checks and request
        # outcomes both feed these pools (router.outlier).
        self.prefill = WorkerPool("prefill", [w.url for w in cfg.prefill], **pool_kw)
        self.decode = WorkerPool("decode", list(cfg.decode), on_change=self.router.set_healthy, **pool_kw)
        self._log = RateLimitedLog(logger)
        self.retry_budget = RetryBudget()
        self._prefill_of: dict[int, int] = {}  # drain task id -> prefill worker (for error labels)

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
        pre, dec = self.prefill.state(), self.decode.state()
        reload_error = self.router.last_reload_error
        return {
            "policy": self.cfg.policy,
            "late_binding": self.cfg.late_binding,
            "decode_loads": list(self.router.loads()),
            "decode_inflight": list(self.router.inflight()),
            "prefill_inflight": [w["inflight"] for w in pre],
            "decode_reported": list(self.reported),
            "decode_healthy": [self.decode.routable(i) for i in range(len(dec))],
            "prefill_healthy": [self.prefill.routable(i) for i in range(len(pre))],
            "decode_workers": dec,
            "prefill_workers": pre,
            "prefill_signatures": list(self.prefill_signs),
            "centroid_generation": int(self.router.centroid_generation),
            "centroid_reload_failures": int(self.router.reload_failures),
            "last_reload_error": reload_error,
            "centroid_file": {"path": self.cfg.centroids, "ok": reload_error is None} if self.cfg.centroids else None,
            "tau": float(self.router.tau),
            "load_factor": self.router.load_factor,
            "decode_expert_distinct": self.router.expert_distinct(),  # locality only, else None
        }

    def set_healthy(self, role: str, i: int, ok: bool) -> None:
        (self.decode if role == "decode" else self.prefill).set_health(i, ok)

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=conn, read_bufsize=1 << 20,
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=self.cfg.connect_timeout_s),
        )

    def check_centroids(self) -> bool:
        """Hot reload, blocking (call it off the event loop): True when a new centroid file is
        serving. A bad file (a FIFO, a device, a huge or corrupt file: the Rust reader refuses
        each without blocking or reading it whole) raises CentroidFileError once per version
        and the previous centroids keep serving."""
        if not self.cfg.centroids:
            return False
        self.router.maybe_reload()
        failures = self.router.reload_failures
        if failures != self._reload_failures:
            self.metrics.centroid_rejections.inc(failures - self._reload_failures)
            self._reload_failures = failures
            raise _core_errors().CentroidFileError(self.router.last_reload_error or "centroid file rejected")
        gen = self.router.centroid_generation
        if gen == self._generation:
            return False
        self._generation = gen
        self.on_centroids_reloaded()
        return True

    async def reload_centroids(self) -> None:
        """One hot-reload check in the reload thread; the event loop only awaits it. A check
        still running (a slow disk, a file system that blocks) is never stacked on."""
        import concurrent.futures as cf

        if self._reload_busy_since is not None:
            stuck = time.monotonic() - self._reload_busy_since
            self._log.warning("reload-stuck", "centroid reload check still running after %.0f s", stuck)
            return
        if self._reload_pool is None:
            self._reload_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eldr-reload")
        self._reload_busy_since = time.monotonic()
        fut = asyncio.get_running_loop().run_in_executor(self._reload_pool, self.check_centroids)
        fut.add_done_callback(lambda _f: setattr(self, "_reload_busy_since", None))
        try:
            if await asyncio.shield(fut):
                logger.info("centroids reloaded from %s (generation %d)", self.cfg.centroids, self.router.centroid_generation)
        except _core_errors().CentroidFileError as exc:
            logger.warning("centroid reload rejected, keeping the previous file: %s", safe(str(exc), 500))

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self.prefill.close()
        self.decode.close()
        if self.session is not None:
            await self.session.close()
        if self._reload_pool is not None:
            self._reload_pool.shutdown(wait=False, cancel_futures=True)
        if self._parse_pool is not None:
            self._parse_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ choices
    def pick_prefill(self, exclude: set[int] = frozenset()) -> int | None:
        P = len(self.cfg.prefill)
        cand = [i for i in self.prefill.candidates() if i not in exclude]
        if not cand:
            if exclude:
                return None
            cand = list(range(P))  # every prefill out: try them anyway (their errors say why)
        pol = self.cfg.prefill_policy
        if pol == "random":
            return self._rng.choice(cand)
        if pol == "shortest_queue":
            return min(cand, key=lambda i: (self.prefill.workers[i].inflight, i))
        for _ in range(P):
            i = self._rr % P
            self._rr += 1
            if i in cand:
                return i
        return cand[0]

    def route(self, sig: CountsResult | None, exclude: set[int] = frozenset()):
        t0 = time.perf_counter()
        if self.cfg.policy == "locality":
            d = self._locality_route(sig)
        elif sig is None or sig.counts is None:
            d = self._fallback(sig)
        else:  # the signature is read straight from the packed counts, GIL released
            keep = self.drift is not None and self.drift.wants_signature()
            d = self.router.route_counts(sig.counts, explain=True, signature=keep)
        if d.worker in exclude:  # a retry: the least loaded routable worker not tried yet
            loads = self.router.loads()
            others = [k for k in self.decode.candidates() if k not in exclude]
            if not others:
                raise _core_errors().NoHealthyWorker("no other decode worker to retry on")
            d = RetryDecision(min(others, key=lambda k: (loads[k], k)), d.generation)
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        reason = d.reason
        self.metrics.routes.labels(str(d.worker), reason.split(":")[0]).inc()
        if reason == "band":
            self.metrics.band_size.observe(len(d.band))
            self.metrics.d_star.observe(d.d_star)
            self.metrics.d_chosen.observe(d.distances[d.worker])
        elif self.cfg.policy in COUNTS_POLICIES and reason not in ("retry", "profile"):
            # the decision names the fallback: 'no_signature:<why>' or 'no_centroids'
            self.metrics.fallbacks.labels(reason.partition(":")[2] or reason).inc()
        if self.drift is not None and reason != "retry":  # O(K) monitor update; never raises
            self.drift.on_route(self._drift_view(d, sig), None if sig is None else sig.counts)
        return d

    def _drift_view(self, d, sig: CountsResult | None):
        """The decision the drift monitor reads. It measures how far traffic is from the
        fitted centroids (d_k = 1 - cos(s, mu_k) over all K), which the band rule's decision
        carries and the locality balancer's does not: under locality the distances of the
        same counts are computed here for the monitor alone (a [K, D] mat-vec per request)."""
        if self.cfg.policy != "locality" or sig is None or sig.counts is None:
            return d
        try:
            gen = int(d.generation)
            if self._band_gen != gen:
                cs = self.router.centroid_set()
                self._band_spec, self._band_mu, self._band_gen = cs.spec(), cs.centroids(), gen
            spec = self._band_spec
            unit = spec.from_dense(sig.counts.to_layout(spec.num_layers, spec.num_experts))
        except (PayloadError, ValueError, AttributeError):  # layout changed under a reload, or no usable counts
            return d
        return _BandView(gen, (1.0 - self._band_mu @ unit).tolist(), unit)

    # ------------------------------------------------------------------ locality balancer
    def _locality_route(self, sig: CountsResult | None):
        """The locality balancer's decision. The request's expert profile (over the centroid
        file's selected layers) is built once and kept on `sig`, so a failover acquires the
        same profile on its next worker; counts it cannot use fall back to shortest queue
        with the same reasons as a signature."""
        if sig is None or sig.counts is None:
            return self._fallback(sig)
        if sig.profile is None:
            try:
                dense = sig.counts.to_layout(*self._layout)  # decoded wire counts -> [L, E]
                sig.profile = self.router.profile_dense(dense, max(int(sig.tokens), 1))
            except PayloadError:  # the centroid layout changed under a reload
                sig.reason, sig.counts = "shape", None
                return self.router.route_fallback(sig.reason, True)
            except _core_errors().NoSignature as exc:
                sig.reason = getattr(exc, "reason", "malformed")
                sig.counts = None
                return self.router.route_fallback(sig.reason, True)
        return self.router.route_profile(sig.profile, explain=True)

    def _fallback(self, sig: CountsResult | None):
        """The decision for a request without usable counts. Its reason comes from the one
        fallback vocabulary (_core.FALLBACK_REASONS): 'no_signature:<why>', or 'no_centroids',
        which the Rust router names itself when it has no centroid file."""
        why = "missing" if sig is None or sig.reason == "no_centroids" else sig.reason
        return self.router.route_fallback(why, True)

    def _lease(self, w: int, profile):
        """A queue slot on decode worker w, counting the request's experts there too when
        the locality balancer routed it. A profile from before a centroid reload changed the
        layer selection no longer fits the balancer: the request is then counted in the queue
        only (and said so), never failed."""
        if profile is None:
            return self.router.acquire(w, 0)
        try:
            return self.router.acquire(w, 0, profile=profile)
        except _core_errors().ProfileError as exc:
            self._log.warning("stale-profile", "expert profile not counted: %s", safe(str(exc)))
            return self.router.acquire(w, 0)

    # ------------------------------------------------------------------ signature
    def _counts_from_event(self, data: bytes, t0: float) -> CountsResult | None:
        """The payload of one stream event, decoded in Rust from the event's bytes (no Python
        JSON parse of the 16 KiB event). None: the event holds no payload after all."""
        try:
            found = self._decode_event(data, layout=self._layout)
        except PayloadError as exc:
            found = exc
        return None if found is None else self._counts_result(found, t0)

    def _signature_from(self, raw: object, t0: float) -> CountsResult:
        """The payload as an already parsed JSON value (an event the Rust scan passed over)."""
        if isinstance(raw, list) and len(raw) >= 1:  # meta_info holds per-token values
            raw = raw[0]
        if isinstance(raw, dict) and "none" in raw and raw.get("v") == 1:
            return self._counts_result(str(raw.get("none")) if isinstance(raw.get("none"), str) else repr(raw.get("none")), t0)
        try:
            found = decode_payload(raw, layout=self._layout)
        except PayloadError as exc:
            found = exc
        return self._counts_result(found, t0)

    def _counts_result(self, found, t0: float) -> CountsResult:
        """found: DecodedCounts, the prefill's reason for sending none (str), or PayloadError."""
        wait = time.perf_counter() - t0
        if isinstance(found, str):  # its reason goes to the log: a label takes no free text
            self._log.warning("prefill_none", "the prefill sent no counts: %s", safe(found, 200))
            return CountsResult(None, "prefill_none", wait)
        if self._layout is None:
            return CountsResult(None, "no_centroids", wait)
        if isinstance(found, PayloadError):
            self.metrics.malformed.inc()
            self._log.warning("malformed", "malformed signature payload: %s", safe(str(found)))
            return CountsResult(None, "malformed", wait)
        self.metrics.sig_bytes.observe(found.data_bytes)
        return CountsResult(found, "ok", wait, found.data_bytes, tokens=found.num_tokens)

    async def _await_signature(self, presp: aiohttp.ClientResponse, t0: float) -> CountsResult:
        """Read prefill stream events until the signature; the rest is left for the drain.
        A line longer than the stream buffer or a JSON too deep to parse is a malformed
        signature (the fallback), not a failed request."""
        last = None
        async for line in _bounded_lines(presp.content, MAX_EVENT_BYTES):
            if line is None:  # a line over the bound: not read on, not parsed
                self.metrics.malformed.inc()
                self._log.warning("malformed", "prefill stream line over %d bytes: signature ignored", MAX_EVENT_BYTES)
                return CountsResult(None, "malformed", time.perf_counter() - t0)
            data = _sse_events(line)
            if data is None:
                continue
            if _META_KEY_BYTES in data:  # the payload event: decoded in Rust from its bytes
                got = self._counts_from_event(data, t0)
                if got is not None:
                    return got
            try:
                event = json.loads(data)
            except ValueError:
                continue
            except RecursionError:  # nested too deep to be an event of ours: the signature is unusable
                self.metrics.malformed.inc()
                self._log.warning("malformed", "prefill stream event nested too deeply: signature ignored")
                return CountsResult(None, "malformed", time.perf_counter() - t0)
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
            meta = last.get("meta_info")
            fr = (meta.get("finish_reason") if isinstance(meta, dict) else None) or last.get("error")
            if fr:
                msg += f": {json.dumps(fr)[:500]}"
        raise UpstreamError(502, _err(msg), "application/json", "prefill")

    # ------------------------------------------------------------------ request
    async def handle(self, request: web.Request) -> web.StreamResponse:
        kind = ENDPOINTS[request.path]
        status = 500
        try:
            parsed = await self._read_body(request, kind)
            body = parsed if isinstance(parsed, RawBody) else validate_request(kind, parsed)
            resp = await self._serve(request, kind, body)
            status = resp.status
            return resp
        except BadRequest as exc:
            status = exc.status
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}}, status=exc.status)
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
        except _CLIENT_GONE:  # the client went away (mid-body or mid-answer): nobody to answer
            status = 499
            self.metrics.disconnects.inc()
            return web.Response(status=499)
        finally:
            self.metrics.requests.labels(kind, str(status)).inc()

    async def _read_body(self, request: web.Request, kind: str) -> object:
        """The client's JSON body, read within the body timeout and the size limit. A large
        one is parsed and validated off the event loop (a RawBody comes back)."""
        try:
            raw = await asyncio.wait_for(request.read(), self.cfg.client_body_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(f"the request body did not arrive within {self.cfg.client_body_timeout_s:g} s", 408) from None
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(f"the request body is larger than {self.cfg.max_payload_size} bytes "
                             "(the router's --max-payload-size)", 413) from None
        if len(raw) > LARGE_BODY_BYTES:
            return await self._parse_large(kind, raw)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        except RecursionError:
            raise BadRequest("the request body is nested too deeply") from None

    async def _parse_large(self, kind: str, raw: bytes) -> RawBody:
        """Parse and validate a large body in the body-parse process (one, spawned on first
        use: it bounds the memory big bodies take, and queues them), within the body timeout."""
        import concurrent.futures as cf
        import multiprocessing

        if self._parse_pool is None:
            self._parse_pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        fut = asyncio.get_running_loop().run_in_executor(self._parse_pool, parse_large_body, kind, raw)
        try:
            out = await asyncio.wait_for(fut, self.cfg.client_body_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(f"the request body was not parsed within {self.cfg.client_body_timeout_s:g} s "
                             "(the router is busy with large bodies)", 503) from None
        except cf.process.BrokenProcessPool:  # the parser died (out of memory?): a fresh one next time
            self._parse_pool = None
            raise BadRequest("the request body could not be parsed (the parser process failed)", 503) from None
        if out[0] == "bad":
            raise BadRequest(out[2], out[1])
        return RawBody(out[2], out[1])

    def _bootstrap(self, p: int) -> dict:
        w = self.cfg.prefill[p]
        return {"bootstrap_host": w.host, "bootstrap_port": w.bootstrap_port, "bootstrap_room": random.getrandbits(63)}

    async def _serve(self, request: web.Request, kind: str, body: dict) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.request_timeout_s
        client_stream = bool(body.get("stream", False))
        tried: set[int] = set()
        last: UpstreamError | None = None
        budget = self.retry_budget
        budget.active += 1
        try:
            for attempt in range(min(len(self.cfg.prefill), 1 + self.cfg.retries)):
                p = self.pick_prefill(tried)
                if p is None or (attempt and not self._may_retry("prefill")):
                    break
                tried.add(p)
                if attempt:
                    self.metrics.retries.labels("prefill", last.cause if isinstance(last, Retryable) else "error").inc()
                    budget.retrying += 1
                try:
                    return await self._serve_with_prefill(request, kind, body, p, client_stream, deadline)
                except Retryable as exc:  # the prefill failed before anything reached a decode or the client
                    last = exc
                    if loop.time() >= deadline:
                        break
                finally:
                    if attempt:
                        budget.retrying -= 1
        finally:
            budget.active -= 1
        assert last is not None
        raise last

    def _may_retry(self, role: str) -> bool:
        if self.retry_budget.allows():
            return True
        self.metrics.retries_refused.labels(role).inc()
        return False

    async def _serve_with_prefill(self, request, kind, body, p, client_stream, deadline) -> web.StreamResponse:
        self.metrics.prefill_routes.labels(str(p)).inc()
        boot = self._bootstrap(p)
        late = self.cfg.late_binding
        no_sig = late and self.prefill_signs[p] is False
        if no_sig:
            late = False  # this prefill never streams a signature: do not wait for one
        dbody = leg_body(body, boot)
        pbody = leg_body(body, {**boot, "stream": True} if late else boot)
        purl = f"{self.cfg.prefill[p].url}{request.path}"
        self.prefill.dispatched(p)
        presp: aiohttp.ClientResponse | None = None
        drain: asyncio.Future | None = None
        ok = False
        verdict = False  # the prefill's outcome was recorded (success or failure)
        try:
            if late:
                t0 = time.perf_counter()
                presp = await self._open("prefill", p, purl, pbody, self.cfg.first_byte_timeout_s, deadline)
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    sig = await asyncio.wait_for(self._await_signature(presp, t0), min(self.cfg.signature_timeout_s, remaining))
                except asyncio.TimeoutError:
                    sig = CountsResult(None, "timeout", time.perf_counter() - t0)
                except aiohttp.ClientError as exc:
                    self.metrics.worker_errors.labels("prefill", str(p), "stream").inc()
                    raise Retryable(502, _err(f"prefill worker {p} stream failed: {exc.__class__.__name__}"),
                                    "application/json", "prefill", "stream") from None
                except UpstreamError as exc:  # ended before its signature
                    self.metrics.worker_errors.labels("prefill", str(p), "no_signature").inc()
                    raise Retryable(exc.status, exc.body, exc.content_type, "prefill", "ended") from None
                self.prefill.success(p)
                verdict = True
                self.metrics.sig_wait.observe(sig.wait_s)
                drain = asyncio.ensure_future(_drain(presp, deadline))
                self._prefill_of[id(drain)] = p
                try:
                    resp = await self._decode_with_failover(request, kind, p, boot, dbody, client_stream, sig, deadline, drain)
                finally:
                    self._prefill_of.pop(id(drain), None)
            else:
                decision = self.route(CountsResult(None, "prefill_no_signature", 0.0) if no_sig else None)
                drain = asyncio.ensure_future(self._early_prefill(purl, pbody, p, deadline))
                resp = await self._decode_racing_prefill(request, kind, p, boot, dbody, decision, client_stream, drain, deadline)
            ok = True
            return resp
        except Retryable as exc:
            if exc.role == "prefill":
                self.prefill.failure(p, exc.cause)
                verdict = True
            raise
        finally:
            if not verdict and late:
                self.prefill.abandoned(p)
            self.prefill.finished(p)
            if drain is not None and not drain.done():
                if ok:  # the prefill's last event may trail the decode's answer: let it end
                    self._finish_later(drain, presp)
                    presp = None
                else:  # error or client gone: closing the stream aborts the prefill request
                    drain.cancel()
            if presp is not None:
                presp.release()

    async def _open(self, role: str, i: int, url: str, body: dict | bytes, first_byte_s: float | None, deadline: float):
        """POST to a worker; the response once its headers are in. Raises Retryable for
        connect errors, timeouts and 5xx (nothing reached the client yet), UpstreamError for
        other statuses (the client's own fault: passed on)."""
        loop = asyncio.get_running_loop()
        budget = deadline - loop.time()
        limit = budget if first_byte_s is None else min(first_byte_s, budget)
        phase = "total" if first_byte_s is None or budget <= first_byte_s else "first_byte"
        try:
            send = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
            resp = await asyncio.wait_for(self.session.post(url, **send), max(limit, 0.0))
        except asyncio.TimeoutError:
            self.metrics.timeouts.labels(role, str(i), phase).inc()
            self.metrics.worker_errors.labels(role, str(i), "timeout").inc()
            raise Retryable(504, _err(f"{role} worker {i} sent no response in {limit:.3g} s"), "application/json", role,
                            f"{phase}_timeout") from None
        except aiohttp.ClientConnectorError as exc:
            self.metrics.worker_errors.labels(role, str(i), "connect").inc()
            self.set_healthy(role, i, False)  # refused: out at once, the health check brings it back
            raise Retryable(502, _err(f"{role} worker {i} unreachable: {exc.__class__.__name__}"), "application/json",
                            role, "connect") from None
        except aiohttp.ClientError as exc:
            self.metrics.worker_errors.labels(role, str(i), "connect").inc()
            raise Retryable(502, _err(f"{role} worker {i} failed: {exc.__class__.__name__}"), "application/json",
                            role, "connect") from None
        if resp.status != 200:
            self.metrics.worker_errors.labels(role, str(i), f"http_{resp.status}").inc()
            try:
                data = await asyncio.wait_for(resp.content.read(MAX_ERROR_BYTES), 5.0)
            except (asyncio.TimeoutError, aiohttp.ClientError):
                data = _err(f"{role} worker {i} answered HTTP {resp.status}")
            ctype = resp.content_type
            resp.release()
            if resp.status >= 500:
                raise Retryable(resp.status, data, ctype, role, f"http_{resp.status}")
            raise UpstreamError(resp.status, data, ctype, role)
        return resp

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

    async def _early_prefill(self, url: str, body: dict, p: int, deadline: float) -> UpstreamError | None:
        """The prefill leg of early binding; returns its failure (None when it succeeded)."""
        try:
            r = await self._open("prefill", p, url, body, None, deadline)
            try:
                await asyncio.wait_for(r.read(), max(0.0, deadline - asyncio.get_running_loop().time()))
            finally:
                r.release()
        except UpstreamError as exc:
            if isinstance(exc, Retryable):
                self.prefill.failure(p, exc.cause)
            return exc
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            self.prefill.failure(p, "stream")
            return UpstreamError(504, _err(f"prefill worker {p} failed: {exc.__class__.__name__}"), "application/json", "prefill")
        self.prefill.success(p)
        return None

    async def _decode_racing_prefill(self, request, kind, p, boot, dbody, decision, client_stream, prefill, deadline):
        """Early binding: both legs run at once; a failed prefill ends the request (the decode
        leg would otherwise wait for KV that never comes)."""
        state: dict = {}
        dec = asyncio.ensure_future(self._decode(request, kind, p, boot, dbody, decision, client_stream, deadline, state))
        try:
            done, _ = await asyncio.wait({dec, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if dec not in done and prefill.result() is not None:
                dec.cancel()
                await asyncio.gather(dec, return_exceptions=True)
                err = prefill.result()
                out = state.get("out")
                if out is None:
                    raise UpstreamError(err.status, err.body, err.content_type, err.role)
                # the client's stream has started: end it with an error event
                with contextlib.suppress(*_CLIENT_GONE, RuntimeError):
                    await out.write(b"data: " + err.body + b"\n\n")
                    await out.write_eof()
                return out
            try:
                return await dec
            except Retryable as exc:  # early binding does not re-send: the prefill is bound to it
                raise UpstreamError(exc.status, exc.body, exc.content_type, exc.role) from None
        finally:
            if not dec.done():
                dec.cancel()
                await asyncio.gather(dec, return_exceptions=True)

    async def _decode_with_failover(self, request, kind, p, boot, dbody, client_stream, sig, deadline, drain):
        """Late binding: a decode worker that fails before the client got a byte (refused
        connection, 5xx, no first byte in time) is charged with the failure and the request
        goes to another one with the same bootstrap room: the prefill keeps the KV parked
        until a decode fetches it. At most 1 + --retries decode workers per request."""
        loop = asyncio.get_running_loop()
        tried: set[int] = set()
        first: Retryable | None = None  # the root cause: what the client is told if no retry works
        last: Retryable | None = None
        for attempt in range(min(len(self.cfg.decode), 1 + self.cfg.retries)):
            if attempt and not self._may_retry("decode"):
                break
            try:
                decision = self.route(sig, tried)
            except _core_errors().NoHealthyWorker:
                if first is None:
                    raise
                break
            if attempt:
                self.metrics.decode_failovers.inc()
                self.metrics.retries.labels("decode", last.cause).inc()
                self.retry_budget.retrying += 1
            tried.add(decision.worker)
            try:
                return await self._decode(request, kind, p, boot, dbody, decision, client_stream, deadline, drain=drain,
                                          profile=sig.profile if sig is not None else None)
            except Retryable as exc:
                if exc.role == "prefill":  # the KV is gone: start over from a prefill
                    raise
                first, last = first or exc, exc
                if loop.time() >= deadline:
                    break
            except UpstreamError:
                # A retry refused (e.g. 409: the failed worker had already taken the room's
                # KV): the first failure is what went wrong.
                if first is None:
                    raise
                break
            finally:
                if attempt:
                    self.retry_budget.retrying -= 1
        assert first is not None
        # Not the prefill's fault: end as a plain upstream error (no prefill retry).
        raise UpstreamError(first.status, first.body, first.content_type, first.role)

    async def _kv_lost(self, drain: asyncio.Future | None) -> bool:
        """Did the prefill's stream break (the prefill died, and its parked KV with it)?"""
        if drain is None:
            return False
        if not drain.done():  # the decode may notice a dead prefill a moment before the router
            await asyncio.wait({drain}, timeout=0.1)
        if drain.done() and not drain.cancelled() and drain.result() is False:
            self.metrics.worker_errors.labels("prefill", str(self._prefill_of.get(id(drain), -1)), "kv_lost").inc()
            return True
        return False

    async def _blame(self, w: int, cause: str, drain: asyncio.Future | None) -> None:
        """Charge decode worker w with a failure before the client's first byte, unless the
        prefill broke meanwhile: then the decode is not at fault and the request starts over
        on another prefill (raises a prefill Retryable)."""
        if await self._kv_lost(drain):
            raise _kv_lost_error()
        self.decode.failure(w, cause)

    def _explain_headers(self, decision, p: int, boot: dict) -> dict:
        if not self.cfg.explain_headers:
            return {}
        headers = {
            "X-ELDR-Decode-Worker": str(decision.worker),
            "X-ELDR-Prefill-Worker": str(p),
            "X-ELDR-Reason": decision.reason,
            "X-ELDR-Bootstrap-Room": str(boot["bootstrap_room"]),
        }
        if decision.band is not None:
            headers["X-ELDR-Band"] = ",".join(map(str, decision.band))
        return headers

    async def _decode(self, request, kind, p, boot, dbody, decision, client_stream, deadline, state=None,
                      drain: asyncio.Future | None = None, profile=None) -> web.StreamResponse:
        """One decode attempt on the chosen worker, holding its queue slot. Its outcome is told
        to the worker pool exactly once: success, a failure (blame), or abandoned."""
        w = decision.worker
        headers = self._explain_headers(decision, p, boot)
        durl = f"{self.cfg.decode[w]}{request.path}"
        t_start = asyncio.get_running_loop().time()
        pool = self.decode
        pool.dispatched(w)
        told = _Told()
        try:
            with self._lease(w, profile):
                try:
                    if client_stream:
                        dresp = await self._open("decode", w, durl, dbody, self.cfg.first_byte_timeout_s, deadline)
                    else:  # a non-streamed answer comes whole at the end: no byte bounds it
                        dresp = await self._open_watched(w, durl, dbody, deadline, drain)
                except Retryable as exc:
                    await self._blame(w, exc.cause, drain)
                    told.yes = True
                    raise
                try:
                    if not client_stream:
                        return await self._decode_whole(dresp, w, headers, deadline, drain, told)
                    return await self._decode_stream(request, dresp, w, headers, t_start, deadline, drain, state, told)
                except Retryable as exc:
                    if not told.yes and exc.role == "decode":
                        await self._blame(w, exc.cause, drain)
                        told.yes = True
                    raise
                finally:
                    dresp.release()
        finally:
            if not told.yes:
                pool.abandoned(w)
            pool.finished(w)

    async def _decode_whole(self, dresp, w: int, headers: dict, deadline: float, drain, told: "_Told") -> web.Response:
        """A non-streamed decode answer, read whole within the request deadline."""
        loop = asyncio.get_running_loop()
        try:
            data = await asyncio.wait_for(dresp.read(), max(0.0, deadline - loop.time()))
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            cause = "total_timeout" if isinstance(exc, asyncio.TimeoutError) else "stream"
            await self._blame(w, cause, drain)
            told.yes = True
            raise Retryable(504 if cause == "total_timeout" else 502,
                            _err(f"decode worker {w} answer cut: {exc.__class__.__name__}"),
                            "application/json", "decode", cause) from None
        self.decode.success(w)
        told.yes = True
        return web.Response(body=data, status=200, headers=headers, content_type=dresp.content_type)

    async def _decode_stream(self, request, dresp, w: int, headers: dict, t_start: float, deadline: float, drain,
                             state, told: "_Told") -> web.StreamResponse:
        """A streamed decode answer. The client sees nothing until the decode's first chunk:
        until then the request can still move to another worker. After it, a failure ends
        the client's stream with an error event."""
        loop = asyncio.get_running_loop()
        left = min(t_start + self.cfg.first_byte_timeout_s, deadline) - loop.time()
        first = await self._chunk(dresp, w, left, "first_byte")
        if not first:
            await self._blame(w, "empty", drain)
            told.yes = True
            raise Retryable(502, _err(f"decode worker {w} ended its stream without a byte"),
                            "application/json", "decode", "empty")
        if b'"abort"' in first[:8192] and await self._kv_lost(drain):
            # aborted before any token because the KV is gone: the request can still start over
            raise _kv_lost_error()
        out = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **headers})
        await out.prepare(request)
        if state is not None:
            state["out"] = out
        await out.write(first)
        failed = None
        while True:
            remaining = deadline - loop.time()
            phase = "stall" if self.cfg.stall_timeout_s < remaining else "total"
            try:
                chunk = await self._chunk(dresp, w, min(self.cfg.stall_timeout_s, remaining), phase)
            except Retryable as exc:  # too late to move: end the client's stream with an error event
                failed = exc
                break
            if not chunk:
                break
            await out.write(chunk)
        if failed is not None:
            self.decode.failure(w, failed.cause)
            with contextlib.suppress(*_CLIENT_GONE, RuntimeError):
                await out.write(b"data: " + failed.body + b"\n\n")
        else:
            self.decode.success(w)
        told.yes = True
        with contextlib.suppress(*_CLIENT_GONE, RuntimeError):
            await out.write_eof()
        return out

    async def _open_watched(self, w: int, durl: str, dbody: dict, deadline: float, drain: asyncio.Future | None):
        """Open a non-streamed decode answer. It comes whole at the end, so no first byte can
        bound it; the KV can: a decode at work takes the prefill's KV, which ends the prefill's
        stream, within the first-byte timeout. One that has not by then is treated like a
        stream with no first byte (a Retryable: charged, and the request moves to another
        decode with the KV still parked). Once the KV is taken, the request deadline bounds it."""
        loop = asyncio.get_running_loop()
        opening = asyncio.ensure_future(self._open("decode", w, durl, dbody, None, deadline))
        try:
            if drain is not None and not drain.done():
                limit = max(0.0, min(self.cfg.first_byte_timeout_s, deadline - loop.time()))
                done, _ = await asyncio.wait({opening, drain}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    self.metrics.timeouts.labels("decode", str(w), "first_byte").inc()
                    self.metrics.worker_errors.labels("decode", str(w), "timeout").inc()
                    raise Retryable(504, _err(f"decode worker {w} took no KV in {limit:.3g} s"), "application/json",
                                    "decode", "first_byte_timeout")
            return await opening
        finally:
            if not opening.done():
                opening.cancel()
                await asyncio.gather(opening, return_exceptions=True)

    async def _chunk(self, resp: aiohttp.ClientResponse, w: int, limit: float, phase: str) -> bytes:
        """The next chunk of a decode stream within `limit` seconds (b'' at its end)."""
        try:
            return await asyncio.wait_for(resp.content.readany(), max(limit, 0.0))
        except asyncio.TimeoutError:
            self.metrics.timeouts.labels("decode", str(w), phase).inc()
            self.metrics.worker_errors.labels("decode", str(w), "timeout").inc()
            what = "first byte" if phase == "first_byte" else "next chunk"
            raise Retryable(504, _err(f"decode worker {w} sent no {what} in {limit:.3g} s"), "application/json",
                            "decode", f"{phase}_timeout") from None
        except aiohttp.ClientError as exc:
            self.metrics.worker_errors.labels("decode", str(w), "stream").inc()
            raise Retryable(502, _err(f"decode worker {w} stream failed: {exc.__class__.__name__}"), "application/json",
                            "decode", "stream") from None


class _Told:
    """Whether a decode attempt's outcome has been told to the worker pool (it is told once)."""

    __slots__ = ("yes",)

    def __init__(self):
        self.yes = False


@dataclass(frozen=True)
class _BandView:
    """What the drift monitor and reservoir read of a band-rule decision (see _drift_view)."""

    generation: int
    distances: list
    signature: np.ndarray
    reason: str = "band"

    def unit_signature(self) -> np.ndarray:
        return self.signature


def _kv_lost_error() -> Retryable:
    return Retryable(502, _err("the prefill worker went away before the KV reached a decode worker"),
                     "application/json", "prefill", "kv_lost")


def _core_errors():
    from eldr_sglang import _core

    return _core


async def _bounded_lines(content: aiohttp.StreamReader, limit: int):
    """The stream's lines (with their newline); None, then the end, for a line over `limit`
    bytes. Only what is needed is read: the rest stays for the drain."""
    buf = b""
    while True:
        chunk = await content.readany()
        if not chunk:
            if buf:
                yield buf
            return
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[: nl + 1], buf[nl + 1:]
            if len(line) > limit:
                yield None
                return
            yield line
        if len(buf) > limit:
            yield None
            return


async def _drain(resp: aiohttp.ClientResponse, deadline: float) -> bool | None:
    """Read the prefill stream to its end (closing it early would abort the KV transfer),
    at most until the request's deadline. True: it ended; False: it broke (the prefill
    went away); None: the deadline passed."""
    async def read_all():
        async for _ in resp.content.iter_any():
            pass

    try:
        await asyncio.wait_for(read_all(), max(0.0, deadline - asyncio.get_running_loop().time()))
    except aiohttp.ClientError:
        return False
    except asyncio.TimeoutError:
        return None
    return True


def _err(msg: str) -> bytes:
    return json.dumps({"error": {"message": msg}}).encode()
