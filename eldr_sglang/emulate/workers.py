"""Emulated SGLang PD workers that speak the patched-SGLang protocol, in real time.

Which trace request a prompt is: `emulator.trace_request` in the body when given (tests),
else (`--assign sequential`) the next one in trace order, counted over all prefill workers of
the process, so a benchmark replays the trace's domain sequence, else (`--assign hash`) a
stable hash of the prompt. Only the prefill decides; decode learns it with the KV, so a
request's signature and its decode routing come from the same trace request.

Prefill worker (`--enable-eldr-signature --enable-eldr-late-binding` emulated):
  POST /generate | /v1/completions | /v1/chat/completions with bootstrap_host/port/room:
  waits its turn (one prefill at a time), sleeps ExecutionModel.prefill_time(prompt), parks
  the KV under the room, streams the signature event (meta_info.eldr_signature, or
  sglext.eldr_signature on the OpenAI routes), then waits until a decode worker fetches the
  room from its bootstrap server and finishes the request.
  Bootstrap server (its own port): GET /kv/{room} waits for the room to be parked, then
  "transfers" it (ExecutionModel.kv_transfer_time) and answers the trace request id. A
  decode in the same process may take it by a call instead (`cluster --kv-in-process`).
Decode worker:
  fetches the KV from the request's bootstrap host/port/room, then joins a continuous-batching
  loop; each step's time is ExecutionModel.decode_step_time(batch, kv_tokens, distinct
  experts per layer) on the trace's real decode routing (sim.replay.TraceReplay).
Both: /health, /v1/models, /server_info, /v1/loads (SGLang 0.5.23 shape), /flush_cache,
/emulator/log (timestamped events), /emulator/stats.

Test controls (a top-level "emulator" object in the request body, ignored otherwise):
  trace_request: int, prefill_status: int (prefill answers this HTTP status, after
  prefill_fail_delay seconds),
  decode_status: int, signature: "none" | "malformed" | "omit" | "delay:<seconds>" |
  "deep:<N>" (the payload is a list nested N deep) | "pad:<N>" (a line of N bytes) |
  "text:<T>" (the payload is the text T, JSON or not) | {"raw": <payload>} (sent as given).

Worker faults (`--fault`, or at run time `POST /emulator/fault {"mode": MODE}`; "none" clears),
the ways real workers fail short of refusing connections; /health keeps answering 200:
  hang            accept the request, never answer (decode: never fetches the KV either)
  hang_midstream  decode: fetch the KV, stream two chunks, then go silent (non-streamed: silent)
  error500        answer HTTP 500 to every generation request
  slow:F          decode: every step takes F times as long
  loads:inf | loads:1e30 | loads:negative | loads:nonjson | loads:shape | loads:hang
                  a bad /v1/loads answer (Infinity, 10^30, -5, HTML, a list, no answer)
  loads:occupancy_version
                  a good load count beside an expert occupancy report of an unknown version

A decode worker answers `/v1/loads?...&eldr_layers=...` with its expert occupancy, as a
SGLang decode server patched with --enable-eldr-occupancy does (emulate/occupancy.py).
  status_delay:S  /health and /v1/loads answer after S seconds (a busy CPU SGLang)

A bootstrap room is transferred once: a second decode that asks for a room already being
or already transferred gets 409, as the KV can only move once. An aborted transfer (the
decode went away mid-transfer) leaves the KV parked for another decode: late binding's
retry of a failed decode on another worker relies on it.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from aiohttp import web

from eldr_sglang.sglang_ext.payload import META_KEY, encode_counts
from eldr_sglang.sim.cost_model import ExecutionModel
from eldr_sglang.models import MODEL_PROFILES, get_model
from eldr_sglang.sim.profiles import get_hardware
from eldr_sglang.emulate.occupancy import Occupancy
from eldr_sglang.sglang_ext.profile_occupancy import ProfileOccupancy
from eldr_sglang.router.occupancy import QUERY_PARAM as OCC_PARAM
from eldr_sglang.sim.replay import TraceReplay, distinct_counter
from eldr_sglang.traces import Trace
from eldr_sglang.traces.counts_file import CountsTrace

logger = logging.getLogger("eldr.emulate")
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def pick_model_profile(trace: Trace, name: str = "auto"):
    if name != "auto":
        m = get_model(name)
    else:
        m = None
        for cand in (trace.meta.get("model"),):
            try:
                m = get_model(str(cand))
            except (ValueError, TypeError):
                m = None
        if m is None:
            for p in MODEL_PROFILES.values():
                if (p.num_moe_layers, p.num_experts, p.top_k) == (trace.num_layers, trace.num_experts, trace.top_k):
                    m = p
                    break
        if m is None:
            raise ValueError(
                f"no model profile matches the trace shape (L={trace.num_layers}, E={trace.num_experts}, "
                f"k={trace.top_k}); pass --model (known: {', '.join(MODEL_PROFILES)})"
            )
    if (m.num_moe_layers, m.num_experts, m.top_k) != (trace.num_layers, trace.num_experts, trace.top_k):
        raise ValueError(
            f"model profile {m.name} (L={m.num_moe_layers}, E={m.num_experts}, k={m.top_k}) does not match the "
            f"trace (L={trace.num_layers}, E={trace.num_experts}, k={trace.top_k})"
        )
    return m


def _prompt_key(body: dict) -> bytes:
    for k in ("text", "input_ids", "prompt", "messages"):
        if body.get(k) is not None:
            return json.dumps(body[k], sort_keys=True).encode()
    return b""


def trace_request_of(body: dict, num_requests: int) -> int:
    ctl = body.get("emulator") or {}
    if isinstance(ctl, dict) and isinstance(ctl.get("trace_request"), int):
        return ctl["trace_request"] % num_requests
    h = hashlib.blake2b(_prompt_key(body), digest_size=8).digest()
    return int.from_bytes(h, "little") % num_requests


def output_len_of(body: dict, default: int = 16) -> int:
    sp = body.get("sampling_params") or {}
    for v in (sp.get("max_new_tokens"), body.get("max_completion_tokens"), body.get("max_tokens")):
        if isinstance(v, int) and v > 0:
            return v
    return default


class EventLog:
    def __init__(self, maxlen: int = 200_000):
        self.events: collections.deque = collections.deque(maxlen=maxlen)

    def add(self, kind: str, **kw) -> None:
        self.events.append({"t": time.monotonic(), "event": kind, **kw})


@dataclass
class WorkerSpec:
    trace: Trace | CountsTrace  # v2: kept open while the workers run
    model: str = "auto"
    hardware: str = "h200"
    time_scale: float = 1.0
    name: str = "emulated"
    exec_model: ExecutionModel = field(init=False)
    replay: TraceReplay = field(init=False)

    def __post_init__(self):
        if not self.time_scale > 0:
            raise ValueError("time scale must be > 0")
        self.exec_model = ExecutionModel(pick_model_profile(self.trace, self.model), get_hardware(self.hardware))
        self.replay = TraceReplay(self.trace)


def _err(status: int, msg: str) -> tuple[int, dict]:
    return status, {"error": {"message": msg, "code": status}}


def _json_err(status: int, msg: str) -> web.Response:
    status, body = _err(status, msg)
    return web.json_response(body, status=status)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


FAULTS = ("none", "hang", "hang_midstream", "error500")
LOADS_FAULTS = {
    "loads:inf": '{"loads": [{"dp_rank": 0, "num_running_reqs": Infinity, "num_waiting_reqs": 0}]}',
    "loads:1e30": '{"loads": [{"dp_rank": 0, "num_running_reqs": 1e30, "num_waiting_reqs": 0, "num_used_tokens": 1e30}]}',
    "loads:negative": '{"loads": [{"dp_rank": 0, "num_running_reqs": -5, "num_waiting_reqs": 0}]}',
    "loads:nonjson": "<html><body>502 Bad Gateway</body></html>",
    "loads:shape": "[1, 2, 3]",
    "loads:hang": None,
    # a good load count beside an occupancy report of a newer patch than the router reads
    "loads:occupancy_version": '{"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}], '
                               '"eldr_occupancy": {"version": 99, "experts": 1, "layers": [0], "idle": [[1.0]]}}',
}


class Faults:
    """A worker's injected faults (see the module doc)."""

    def __init__(self, spec: str | None = None):
        self.mode = "none"
        self.loads = None
        self.slow = 1.0
        self.status_delay = 0.0
        if spec:
            self.set(spec)

    def set(self, spec: str) -> None:
        if spec == "none":
            self.mode, self.loads, self.slow, self.status_delay = "none", None, 1.0, 0.0
        elif spec.startswith("status_delay:"):
            try:
                d = float(spec[13:])
            except ValueError:
                d = float("nan")
            if not (0 <= d <= 3600):
                raise ValueError(f"fault {spec!r}: status_delay:S needs 0 <= S <= 3600 seconds")
            self.status_delay = d
        elif spec in LOADS_FAULTS:
            self.loads = spec
        elif spec.startswith("slow:"):
            try:
                f = float(spec[5:])
            except ValueError:
                f = float("nan")
            if not (f > 0 and f < 1e6):
                raise ValueError(f"fault {spec!r}: slow:F needs a factor F > 0")
            self.slow = f
        elif spec in FAULTS:
            self.mode = spec
        else:
            raise ValueError(f"unknown fault {spec!r}: one of {', '.join(FAULTS)}, slow:F, status_delay:S, "
                             f"{', '.join(LOADS_FAULTS)}")

    def describe(self) -> dict:
        return {"mode": self.mode, "loads": self.loads, "slow": self.slow, "status_delay": self.status_delay}


async def _forever() -> None:
    await asyncio.Event().wait()


def _common_routes(app: web.Application, worker) -> None:
    async def health(_):
        if worker.faults.status_delay:
            await asyncio.sleep(worker.faults.status_delay)
        return web.Response(text="ok")

    async def fault(request: web.Request):
        try:
            body = await request.json()
            worker.faults.set(str(body["mode"]))
        except (ValueError, KeyError, TypeError) as exc:
            return _json_err(400, f"bad fault: {exc}")
        worker.log.add("fault", mode=str(body["mode"]))
        return web.json_response(worker.faults.describe())

    async def loads(request: web.Request):
        if worker.faults.status_delay:
            await asyncio.sleep(worker.faults.status_delay)
        lf = worker.faults.loads
        if lf is None:
            return await worker.loads(request)
        text = LOADS_FAULTS[lf]
        if text is None:
            await _forever()
        return web.Response(text=text, content_type="application/json")

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": worker.spec.name, "object": "model", "owned_by": "eldr-emulator"}]})

    async def log(_):
        return web.json_response(list(worker.log.events))

    async def flush(_):
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/emulator/log", log)
    app.router.add_post("/flush_cache", flush)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/emulator/fault", fault)
    app.router.add_get("/server_info", worker.server_info)
    app.router.add_get("/emulator/stats", worker.stats)


# ============================================================================ prefill
@dataclass
class _Parked:
    trace_request: int
    prompt_len: int
    parked: asyncio.Event = field(default_factory=asyncio.Event)
    fetched: asyncio.Event = field(default_factory=asyncio.Event)
    claimed: bool = False  # a decode is transferring it (or has): the KV moves once


class PrefillWorker:
    def __init__(self, spec: WorkerSpec, *, signature: bool = True, max_bytes: int = 16384,
                 bootstrap_timeout_s: float = 300.0, sequence=None, fault: str | None = None,
                 signature_off: str | None = None):
        # signature_off: a patched prefill whose layout cannot be attributed (it streams none)
        self.spec, self.max_bytes = spec, max_bytes
        self.signature, self.signature_off = signature and signature_off is None, signature_off
        self.patched = signature or signature_off is not None
        self.faults = Faults(fault)
        self.sequence = sequence  # shared counter: assign trace requests in arrival order
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.log = EventLog()
        self.rooms: dict[int, _Parked] = {}
        self.transferred: set[int] = set()  # rooms whose KV has moved: a late decode gets 409 at once
        self._transferred_order: collections.deque[int] = collections.deque()
        self._lock = asyncio.Lock()
        self.inflight = 0
        self.served = 0
        R = spec.replay.num_requests  # a v2 trace replays the requests that kept decode routing
        self._payloads: dict[int, dict] = {}
        self._R = R

    def payload(self, r: int) -> dict:
        p = self._payloads.get(r)
        if p is None:
            rp = self.spec.replay
            c = rp.prompt_counts_of(r)  # from the prompt rows (v1) or the stored counts (v2)
            p = encode_counts(c, list(range(rp.num_layers)), int(rp.prompt_len[r]), self.max_bytes)
            self._payloads[r] = p
        return p

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for r in ROUTES:
            app.router.add_post(r, self.handle)
        _common_routes(app, self)
        return app

    def bootstrap_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/kv/{room}", self.kv)
        return app

    async def loads(self, _):
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": self.inflight, "num_waiting_reqs": 0,
                                              "num_used_tokens": 0, "disaggregation": {"mode": "prefill"}}]})

    async def server_info(self, _):
        info = {"disaggregation_mode": "prefill", "enable_eldr_signature": self.patched,
                "enable_eldr_late_binding": True, "emulator": True, "model_path": self.spec.name}
        if self.patched:  # the patched scheduler's handshake (patch 0004); unpatched SGLang has no such field
            info["eldr_signature"] = "on" if self.signature else f"off ({self.signature_off})"
        return web.json_response(info)

    async def stats(self, _):
        return web.json_response({"served": self.served, "inflight": self.inflight, "parked": len(self.rooms)})

    async def kv(self, request: web.Request) -> web.Response:
        """Decode side of the KV transfer over HTTP (the bootstrap server's GET /kv/{room})."""
        try:
            room = int(request.match_info["room"])
        except ValueError:
            return _json_err(400, "room must be an integer")
        status, info = await self.take_kv(room)
        return web.json_response(info, status=status)

    async def take_kv(self, room: int) -> tuple[int, dict]:
        """Wait until the room is parked, then take it: (HTTP status, JSON answer)."""
        deadline = time.monotonic() + self.bootstrap_timeout_s
        while room not in self.rooms:  # decode may arrive before the prefill request
            if room in self.transferred:
                self.log.add("kv_refused", room=room)
                return _err(409, f"room {room} is already transferred to another decode worker")
            if time.monotonic() > deadline:
                return _err(404, f"unknown bootstrap room {room}")
            await asyncio.sleep(0.002)
        entry = self.rooms[room]
        try:
            await asyncio.wait_for(entry.parked.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return _err(504, f"room {room} was never prefilled")
        if entry.claimed:
            self.log.add("kv_refused", room=room)
            return _err(409, f"room {room} is already transferred to another decode worker")
        entry.claimed = True
        try:
            await asyncio.sleep(self.spec.exec_model.kv_transfer_time(entry.prompt_len) * self.spec.time_scale)
        except asyncio.CancelledError:  # the decode went away mid-transfer: the KV stays parked
            entry.claimed = False
            raise
        entry.fetched.set()
        self.transferred.add(room)
        self._transferred_order.append(room)
        if len(self._transferred_order) > 100_000:  # remember the recent ones: a bounded set
            self.transferred.discard(self._transferred_order.popleft())
        self.log.add("kv_fetched", room=room)
        return 200, {"trace_request": entry.trace_request, "prompt_len": entry.prompt_len}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _json_err(400, "body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("bootstrap_room"), int):
            return _json_err(400, "a PD prefill request needs bootstrap_host, bootstrap_port and an integer bootstrap_room")
        ctl = body.get("emulator") if isinstance(body.get("emulator"), dict) else {}
        room = body["bootstrap_room"]
        if self.sequence is not None and not isinstance(ctl.get("trace_request"), int):
            r = next(self.sequence) % self._R
        else:
            r = trace_request_of(body, self._R)
        self.log.add("prefill_recv", room=room, trace_request=r)
        if self.faults.mode == "hang":
            await _forever()
        if self.faults.mode == "error500":
            return _json_err(500, "emulated prefill fault: error500")
        if isinstance(ctl.get("prefill_status"), int):
            await asyncio.sleep(float(ctl.get("prefill_fail_delay", 0)))
            return _json_err(ctl["prefill_status"], "emulated prefill failure")
        entry = _Parked(r, int(self.spec.replay.prompt_len[r]))
        self.rooms[room] = entry
        self.inflight += 1
        stream = bool(body.get("stream"))
        openai = request.path != "/generate"
        rid = f"emu-{room}"
        resp = None
        try:
            if stream:  # like SGLang's StreamingResponse: headers go out before the prefill runs
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
            async with self._lock:  # one prefill batch at a time
                await asyncio.sleep(self.spec.exec_model.prefill_time(entry.prompt_len) * self.spec.time_scale)
            entry.parked.set()
            sig = self._signature(r, ctl)
            if stream:
                if sig is not None:
                    delay = ctl.get("signature", "")
                    if isinstance(delay, str) and delay.startswith("delay:"):
                        await asyncio.sleep(float(delay[6:]))
                    if isinstance(sig, _RawJSON):  # hostile payloads, written as text (deep nesting)
                        await resp.write(b'data: {"text": "", "meta_info": {"' + META_KEY.encode() + b'": '
                                         + sig.text.encode() + b"}}\n\n")
                    else:
                        if openai:
                            event = {"id": rid, "object": "eldr.signature", "choices": [], "sglext": {META_KEY: sig}}
                        else:
                            event = {"text": "", "meta_info": {"id": rid, META_KEY: [sig], "prompt_tokens": entry.prompt_len,
                                                               "completion_tokens": 1, "finish_reason": None}}
                        await resp.write(_sse(event))
                    self.log.add("signature_sent", room=room, trace_request=r)
            try:
                await asyncio.wait_for(entry.fetched.wait(), self.bootstrap_timeout_s)
                final = {"text": "", "meta_info": {"id": rid, "prompt_tokens": entry.prompt_len, "completion_tokens": 1,
                                                   "finish_reason": {"type": "length", "length": 0}}}
            except asyncio.TimeoutError:
                final = {"text": "", "meta_info": {"id": rid, "finish_reason": {
                    "type": "abort", "message": "bootstrap timeout: no decode worker fetched the KV"}}}
            self.served += 1
            self.log.add("prefill_done", room=room)
            if stream:  # the last event, [DONE] and the end of the body in one write
                await resp.write_eof(_sse(final) + b"data: [DONE]\n\n")
                return resp
            if sig is not None and not isinstance(sig, _RawJSON):
                final["meta_info"][META_KEY] = [sig]
            return web.json_response(final)
        finally:
            self.inflight -= 1
            self.rooms.pop(room, None)

    def _signature(self, r: int, ctl: dict):
        mode = ctl.get("signature")
        if not self.signature or mode == "omit":
            return None
        if mode == "none":
            return {"v": 1, "none": "emulated"}
        if mode == "malformed":
            return {"v": 1, "layers": [0], "E": 4, "n": 1, "enc": "dense", "bits": 8, "d": "!!not base64!!"}
        if isinstance(mode, dict) and "raw" in mode:  # a crafted payload, sent as given
            return mode["raw"]
        if isinstance(mode, str) and mode.startswith("deep:"):  # [[[...]]] nested N deep
            depth = min(int(mode[5:]), 10_000_000)
            return _RawJSON("[" * depth + "]" * depth)
        if isinstance(mode, str) and mode.startswith("text:"):  # a payload written as given, JSON or not
            return _RawJSON(mode[5:])
        if isinstance(mode, str) and mode.startswith("pad:"):  # one stream line of N bytes
            return {**self.payload(r), "pad": "x" * min(int(mode[4:]), 1 << 30)}
        return self.payload(r)


@dataclass
class _RawJSON:
    text: str


# ============================================================================ decode
@dataclass
class _Running:
    trace_request: int
    prompt_len: int
    output_len: int
    queue: asyncio.Queue
    generated: int = 1  # the first token comes from prefill
    done: bool = False


class DecodeWorker:
    def __init__(self, spec: WorkerSpec, *, max_running: int = 256, kv_timeout_s: float = 300.0, fault: str | None = None,
                 local_bootstrap: dict[tuple[str, int], PrefillWorker] | None = None, occupancy_source: str = "signatures"):
        self.spec = spec
        # prefill workers of this process by bootstrap (host, port): their KV is taken by a call,
        # not an HTTP exchange (--kv-in-process), the same handoff at a fraction of the CPU
        self.local_bootstrap = local_bootstrap or {}
        self.faults = Faults(fault)
        self.max_running = max_running
        self.kv_timeout_s = kv_timeout_s
        self.log = EventLog()
        self.running: list[_Running] = []
        self.waiting: collections.deque[_Running] = collections.deque()
        self.transferring = 0
        self._wake = asyncio.Event()
        self._distinct = distinct_counter()
        # the expert occupancy it reports: from its requests' profiles, or measured per step
        self.occupancy_source = occupancy_source
        self.profiles = ProfileOccupancy()
        self.occupancy = Occupancy(spec.trace.num_layers, spec.trace.num_experts)
        self.steps = 0
        self.step_time_total = 0.0
        self.batch_total = 0
        self.distinct_total = 0.0
        self.tokens = 0
        self.batch_hist: collections.Counter = collections.Counter()
        # summed mean distinct experts per layer by batch size: routing quality at equal batch
        self.distinct_by_batch: collections.Counter = collections.Counter()
        self.step_wall_total = 0.0
        self._loop_task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for r in ROUTES:
            app.router.add_post(r, self.handle)
        _common_routes(app, self)

        async def lifecycle(_app):
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.kv_timeout_s + 5))
            self._loop_task = asyncio.ensure_future(self._batch_loop())
            yield
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            await self._session.close()

        app.cleanup_ctx.append(lifecycle)
        return app

    async def loads(self, request):
        kv = sum(x.prompt_len + x.generated for x in self.running)
        body = {"loads": [{
            "dp_rank": 0, "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
            "num_used_tokens": kv, "max_running_requests": self.max_running,
            "disaggregation": {"mode": "decode", "decode_prealloc_queue_reqs": 0,
                               "decode_transfer_queue_reqs": self.transferring},
        }]}
        if OCC_PARAM in request.query:  # a worker patched with --enable-eldr-occupancy
            src = self.profiles if self.occupancy_source == "signatures" else self.occupancy
            body.update(src.report(request.query[OCC_PARAM], len(self.running)))
        return web.json_response(body)

    async def server_info(self, _):
        return web.json_response({"disaggregation_mode": "decode", "emulator": True, "model_path": self.spec.name,
                                  "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}]})

    async def stats(self, _):
        return web.json_response(self.stats_dict())

    def stats_dict(self) -> dict:
        s = max(self.steps, 1)
        return {"steps": self.steps, "tokens": self.tokens, "mean_batch": self.batch_total / s,
                "mean_distinct_experts": self.distinct_total / s,
                "mean_step_ms_model": 1e3 * self.step_time_total / s,
                "step_time_total_s": self.step_time_total, "step_wall_total_s": self.step_wall_total,
                "batch_hist": {str(k): v for k, v in sorted(self.batch_hist.items())},
                "distinct_by_batch": {str(k): v for k, v in sorted(self.distinct_by_batch.items())},
                "running": len(self.running), "waiting": len(self.waiting), "transferring": self.transferring,
                "profiles_received": self.profiles.added, "profiles_dropped": self.profiles.dropped}

    async def _batch_loop(self) -> None:
        rp = self.spec.replay
        em = self.spec.exec_model
        scale = self.spec.time_scale
        E = self.spec.trace.num_experts
        while True:
            while self.waiting and len(self.running) < self.max_running:
                self.running.append(self.waiting.popleft())
            self.running = [x for x in self.running if not x.done]
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self.running
            t_step = time.monotonic()
            reqs = np.fromiter((x.trace_request for x in batch), np.int64, len(batch))
            steps = np.fromiter((x.generated - 1 for x in batch), np.int64, len(batch))
            ids = np.ascontiguousarray(rp.step_ids(reqs, steps))
            distinct = np.asarray(self._distinct(ids, E))
            self.occupancy.step(ids)
            kv = int(sum(x.prompt_len + x.generated for x in batch))
            dt = em.decode_step_time(len(batch), kv, distinct)
            await asyncio.sleep(dt * scale * self.faults.slow)
            self.step_wall_total += time.monotonic() - t_step
            self.batch_hist[len(batch)] += 1
            self.steps += 1
            self.step_time_total += dt
            self.batch_total += len(batch)
            self.distinct_total += float(distinct.mean())
            self.distinct_by_batch[len(batch)] += float(distinct.mean())
            for x in batch:
                if x.done:
                    continue
                x.generated += 1
                self.tokens += 1
                finished = x.generated >= x.output_len
                x.queue.put_nowait(finished)
                if finished:
                    x.done = True

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _json_err(400, "body is not JSON")
        # the request's expert profile counts in the occupancy report while it is here
        token = self.profiles.add(body.get("eldr_profile")) if isinstance(body, dict) else None
        try:
            return await self._serve(request, body)
        finally:
            self.profiles.remove(token)

    async def _serve(self, request: web.Request, body) -> web.StreamResponse:
        if not isinstance(body, dict) or not isinstance(body.get("bootstrap_room"), int) or not body.get("bootstrap_host"):
            return _json_err(400, "a PD decode request needs bootstrap_host, bootstrap_port and an integer bootstrap_room")
        ctl = body.get("emulator") if isinstance(body.get("emulator"), dict) else {}
        room = body["bootstrap_room"]
        self.log.add("decode_recv", room=room)
        if self.faults.mode == "hang":
            await _forever()
        if self.faults.mode == "error500":
            return _json_err(500, "emulated decode fault: error500")
        if isinstance(ctl.get("decode_status"), int):
            return _json_err(ctl["decode_status"], "emulated decode failure")
        host, port = body["bootstrap_host"], body.get("bootstrap_port")
        stream = bool(body.get("stream"))
        kind = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}[request.path]
        rid = f"emu-{room}"
        resp = None
        if stream:  # like SGLang's StreamingResponse: headers go out before any token
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
        self.transferring += 1
        failure = None
        failure_status = 502
        try:
            local = self.local_bootstrap.get((host, port)) if isinstance(port, int) else None
            if local is not None:
                status, info = await asyncio.wait_for(local.take_kv(room), self.kv_timeout_s + 5)
            else:
                async with self._session.get(f"http://{host}:{port}/kv/{room}") as r:
                    status, info = r.status, await r.json(content_type=None)
            if status != 200:
                failure = f"KV transfer for room {room} failed: {info}"
                if status == 409:  # another decode took this room's KV: the request's fault, not ours
                    failure_status = 409
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            failure = f"cannot reach the prefill bootstrap server {host}:{port}: {exc}"
        finally:
            self.transferring -= 1
        if failure is not None:
            if resp is None:
                return _json_err(failure_status, failure)
            await resp.write(_sse({"text": "", "meta_info": {"id": rid, "finish_reason": {"type": "abort", "message": failure}}}))
            await resp.write_eof()
            return resp
        item = _Running(int(info["trace_request"]), int(info["prompt_len"]), output_len_of(body), asyncio.Queue())
        self.log.add("decode_start", room=room, trace_request=item.trace_request)
        try:
            if item.output_len > 1:
                self.waiting.append(item)
                self._wake.set()
            midstream = self.faults.mode == "hang_midstream"
            if not stream:
                if midstream:
                    await _forever()
                while item.generated < item.output_len:
                    await item.queue.get()
                self.log.add("decode_done", room=room)
                return web.json_response(_final(kind, rid, item))
            await resp.write(_sse(_chunk(kind, rid, item, 1, item.output_len <= 1)))
            n = 1
            while n < item.output_len:
                if midstream and n >= 2:
                    await _forever()
                finished = await item.queue.get()
                n += 1
                await resp.write(_sse(_chunk(kind, rid, item, n, finished)))
            await resp.write_eof(b"data: [DONE]\n\n")
            self.log.add("decode_done", room=room)
            return resp
        finally:
            item.done = True  # a disconnected client leaves the batch at the next step


def _text(n: int) -> str:
    return " tok" * n


def _chunk(kind: str, rid: str, item: _Running, n: int, finished: bool) -> dict:
    fr = {"type": "length", "length": item.output_len} if finished else None
    if kind == "generate":
        return {"text": _text(n), "meta_info": {"id": rid, "prompt_tokens": item.prompt_len, "completion_tokens": n,
                                                 "finish_reason": fr}}
    ofr = "length" if finished else None
    if kind == "chat":
        return {"id": rid, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"content": " tok"}, "finish_reason": ofr}]}
    return {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": " tok", "finish_reason": ofr}]}


def _final(kind: str, rid: str, item: _Running) -> dict:
    n = item.output_len
    usage = {"prompt_tokens": item.prompt_len, "completion_tokens": n, "total_tokens": item.prompt_len + n}
    if kind == "generate":
        return {"text": _text(n), "meta_info": {"id": rid, "prompt_tokens": item.prompt_len, "completion_tokens": n,
                                                 "finish_reason": {"type": "length", "length": n}}}
    if kind == "chat":
        return {"id": rid, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": _text(n)}, "finish_reason": "length"}], "usage": usage}
    return {"id": rid, "object": "text_completion", "choices": [{"index": 0, "text": _text(n), "finish_reason": "length"}],
            "usage": usage}
