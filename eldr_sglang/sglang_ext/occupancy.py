"""Decode expert occupancy (`--enable-eldr-occupancy`): which experts a decode server's batch uses.

Two sources (`--eldr-occupancy-source`):

- `signatures` (the default): the HTTP process sums the expert profiles the ELDR router sends
  with each request (`eldr_profile`) while the request is served, in one process-wide
  `ProfileOccupancy` (profile_occupancy.py). `while_served` wraps the /generate,
  /v1/completions and /v1/chat/completions handlers: the profile is added when the request
  enters and removed when its response ends; a StreamingResponse's when its body iterator ends
  or is closed (a client disconnect), not when the handler returns. No work per decode step,
  no device work, and none of the hooks below runs.
- `steps`: measured on the device, below.

Source `steps`: for every MoE layer l and routed expert e the decode server keeps, on the device, an
exponential moving average over its decode forward steps of "no token of the step selected
e at l":

    idle[l, e] <- (1 - 1/W) * idle[l, e] + (1/W) * [e unused at l in this step],  W = 32

starting at 1.0, and back at 1.0 whenever the server's running batch is empty (an empty batch
uses no expert). Only decode forwards count (not extend/prefill, not idle, not speculative
verify passes). The update is fixed-shape in-place tensor ops on preallocated buffers (a
per-layer mark row, `index_fill_`, `lerp_` with a device weight), so it runs inside CUDA-graph
capture and replay with no host sync; the step's weight (1/W or 0) and a per-row offset that
sends graph padding rows to a trash column are written into device buffers before each forward.

The scheduler copies the [L, E] table to the host when it publishes its load snapshot (every
`--load-snapshot-publish-interval` decode steps, and on idle), and writes it beside the
snapshot's shared-memory file; `/v1/loads?include=...,eldr` reads it there (`answer`).

Call sites (patches/sglang-0.5.23/0005-decode-occupancy.patch):
- `install(model_runner)`          ModelRunner init, beside the signature accumulator
- `begin_forward(runner, batch)`   ModelRunner.forward, before the model runs
- `capture(layer_id, topk_ids)`    layers/moe/topk.py `capture_routed_experts_if_allowed`
- `publish(writer, load)`          Scheduler.publish_load_snapshot, after the snapshot is written
- `split_include` / `answer_for`   entrypoints/v1_loads.py
- `while_served(request, served)`  entrypoints/http_server.py (source `signatures`)
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

VERSION = 1
WINDOW_STEPS = 32
FILE_SUFFIX = ".eldr_occ"
OCCUPANCY = None  # IdleEMA of this process, or None (the flag is off, or the layout is refused)
REFUSAL: str | None = None  # why a server that asked for occupancy does not keep it


class IdleEMA:
    """The [L, E] idle table on the device and its per-forward state."""

    def __init__(self, *, num_hidden_layers: int, moe_layers: list[int], num_experts: int, max_rows: int,
                 window: int = WINDOW_STEPS, device: Any = "cpu") -> None:
        import torch

        if not moe_layers:
            raise ValueError("occupancy needs at least one MoE layer")
        if any(not 0 <= l < num_hidden_layers for l in moe_layers):
            raise ValueError(f"MoE layer ids must lie in [0, {num_hidden_layers})")
        self.moe_layers, self.num_experts, self.window = list(moe_layers), int(num_experts), int(window)
        self.max_rows = int(max_rows)
        self.device = torch.device(device)
        self._row = [-1] * num_hidden_layers
        for i, layer in enumerate(self.moe_layers):
            self._row[layer] = i
        L, E = len(self.moe_layers), self.num_experts
        self.idle = torch.ones((L, E), dtype=torch.float32, device=self.device)
        # mark[l, 1 + e]: expert e unused at layer l in this step; columns 0 and E + 1 are trash
        self._mark = torch.ones((L, E + 2), dtype=torch.float32, device=self.device)
        self._weight = torch.zeros((), dtype=torch.float32, device=self.device)  # 1/W on a decode step, else 0
        # added to each row's ids: 1 on the step's real rows, E + 2 on padding rows (-> trash)
        self._row_off = torch.ones(self.max_rows, dtype=torch.int64, device=self.device)
        self._n_real = self.max_rows
        self._decode = False  # host mirror: eager forwards skip the ops on other steps
        self.steps = 0  # decode steps seen (host count)
        self._host = None  # CUDA: pinned host copy and its event, one publish behind
        self._event = None

    def begin_step(self, decode: bool, n_real: int) -> None:
        """Before a forward: a decode step of n_real tokens (rows past it are padding), or not."""
        self._decode = bool(decode)
        self._weight.fill_(1.0 / self.window if decode else 0.0)
        if not decode:
            return
        self.steps += 1
        n_real = min(int(n_real), self.max_rows)
        if n_real != self._n_real:  # the row map changes only with the batch size
            self._row_off[:n_real].fill_(1)
            self._row_off[n_real:].fill_(self.num_experts + 2)
            self._n_real = n_real

    def capture(self, layer_id: int | None, topk_ids: Any) -> None:
        """Fold one MoE layer's top-k ids [N, k] of the current forward into the table."""
        if layer_id is None or not 0 <= layer_id < len(self._row) or self._row[layer_id] < 0:
            return  # dense layer, or not one of the model's MoE layers
        if not self._decode:  # a CUDA graph records every forward (the weight 0 makes the others no-ops)
            if self.device.type != "cuda":
                return
            import torch

            if not torch.cuda.is_current_stream_capturing():
                return
        n = int(topk_ids.shape[0])
        if n > self.max_rows:
            return  # never on a decode step (max_rows covers the running batch)
        row, E = self._row[layer_id], self.num_experts
        # expert e -> column 1 + e; -1 (padding) -> 0; fused shared experts (>= E) and padding
        # rows -> E + 1. Five small ops per layer, no allocation but the index.
        idx = (topk_ids + self._row_off[:n].unsqueeze(1)).clamp_(0, E + 1)
        mark = self._mark[row]
        mark.fill_(1.0)
        mark.index_fill_(0, idx.reshape(-1), 0.0)
        self.idle[row].lerp_(mark[1 : E + 1], self._weight)

    def reset(self) -> None:
        """The running batch is empty: an empty batch uses no expert."""
        self.idle.fill_(1.0)

    def host_table(self) -> np.ndarray | None:
        """The table on the host. CUDA: the copy started at the previous call once it has
        landed (None before), and a new one started, so the scheduler never waits on the GPU."""
        if self.device.type != "cuda":
            return self.idle.numpy().copy()
        import torch

        if self._host is None:
            self._host = torch.empty(self.idle.shape, dtype=torch.float32, pin_memory=True)
            self._event = torch.cuda.Event()
            self._pending = False
        out = None
        if self._pending and self._event.query():
            out, self._pending = self._host.numpy().copy(), False
        if not self._pending:
            self._host.copy_(self.idle, non_blocking=True)
            self._event.record()
            self._pending = True
        return out


# --------------------------------------------------------------------------- the report file
def write_report(path: str, moe_layers: list[int], table: np.ndarray | None, steps: int = 0,
                 off: str | None = None) -> None:
    """Atomically replace `path` with a JSON header line and the float32 [L, E] table."""
    head = {"v": VERSION, "layers": list(moe_layers), "steps": int(steps), "off": off,
            "experts": 0 if table is None else int(table.shape[1])}
    body = b"" if table is None else np.ascontiguousarray(table, dtype="<f4").tobytes()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(json.dumps(head).encode() + b"\n" + body)
    os.replace(tmp, path)


def read_report(path: str) -> tuple[dict, np.ndarray | None]:
    """(header, table or None); raises ValueError on a malformed file, OSError when absent."""
    with open(path, "rb") as fh:
        raw = fh.read()
    head_raw, sep, body = raw.partition(b"\n")
    if not sep:
        raise ValueError("no header line")
    head = json.loads(head_raw)
    if head.get("v") != VERSION:
        raise ValueError(f"report version {head.get('v')!r}, expected {VERSION}")
    if head.get("off"):
        return head, None
    L, E = len(head["layers"]), int(head["experts"])
    if len(body) != L * E * 4:
        raise ValueError(f"table of {len(body)} bytes, expected {L} x {E} float32")
    return head, np.frombuffer(body, dtype="<f4").reshape(L, E)


# --------------------------------------------------------------------------- server side
def occupancy_refusal(args: dict) -> str | None:
    """Why a server with these (resolved) arguments does not keep occupancy, naming the flag;
    None when it does."""
    if not args.get("enable_eldr_occupancy"):
        return "--enable-eldr-occupancy not set"
    mode = args.get("disaggregation_mode", "null")
    if mode == "prefill":
        return "--disaggregation-mode prefill: occupancy is kept by decode servers"
    for key, flag in (("dp_size", "--dp-size"), ("pp_size", "--pp-size"), ("attn_cp_size", "--attn-cp-size")):
        n = int(args.get(key) or 1)
        if n > 1:
            return f"{flag} {n}: several DP ranks or stages: not supported yet"
    if args.get("enable_dp_attention"):
        return "--enable-dp-attention: several DP ranks: not supported yet"
    if args.get("enable_two_batch_overlap"):
        return "--enable-two-batch-overlap: each MoE layer's top-k ids arrive in two micro-batches"
    if args.get("speculative_algorithm"):
        return "--speculative-algorithm: decode steps are verify passes, which occupancy does not count"
    return None


def _asked() -> bool:
    """The steps source is asked: the flag, and --eldr-occupancy-source steps."""
    from eldr_sglang.sglang_ext.runtime import _flag

    try:
        return bool(_flag("enable_eldr_occupancy")) and _flag("eldr_occupancy_source", "signatures") == "steps"
    except Exception:  # not a server process of the patched series
        return False


def install(model_runner: Any) -> None:
    """Create this process's IdleEMA when the server asked for it and its layout allows it;
    otherwise log the reason once (silent on servers that never asked)."""
    global OCCUPANCY, REFUSAL
    if getattr(model_runner, "is_draft_worker", False) or not _asked():
        return
    try:
        from sglang.srt.runtime_context import get_server_args
        from sglang.srt.state_capturer.routed_experts import _is_scattered_a2a_backend

        from eldr_sglang.sglang_ext.runtime import moe_layer_ids, num_routed_experts

        REFUSAL = occupancy_refusal(get_server_args().resolved_dict())
        if REFUSAL is None and _is_scattered_a2a_backend():
            REFUSAL = "DeepEP: each rank's MoE layers see only its share of the batch"
        hf = model_runner.model_config.hf_text_config
        if REFUSAL is None:
            moe_layers, experts = moe_layer_ids(hf), num_routed_experts(hf)
    except Exception as exc:  # an unknown layout or a model without routed experts: stay off, loudly
        REFUSAL = f"cannot read the server's layout or model: {exc}"
    if REFUSAL is not None:
        logger.warning("ELDR occupancy off: %s", REFUSAL)
        return
    slots = int(model_runner.req_to_token_pool.req_to_token.shape[0])
    OCCUPANCY = IdleEMA(num_hidden_layers=int(hf.num_hidden_layers), moe_layers=moe_layers, num_experts=experts,
                        max_rows=max(slots, 8192), device=model_runner.device)
    logger.info("ELDR occupancy on: %d MoE layers x %d experts, window %d decode steps",
                len(moe_layers), experts, WINDOW_STEPS)


def begin_forward(model_runner: Any, forward_batch: Any) -> None:
    occ = OCCUPANCY
    if occ is None or getattr(model_runner, "is_draft_worker", False):
        return
    decode = bool(forward_batch.forward_mode.is_decode())
    occ.begin_step(decode, int(forward_batch.batch_size) if decode else 0)


def capture(layer_id: int | None, topk_ids: Any) -> None:
    occ = OCCUPANCY
    if occ is not None:
        occ.capture(layer_id, topk_ids)


def publish(writer: Any, load: Any) -> None:
    """Write the table beside the load snapshot's shared-memory file (SHM transport only)."""
    path = getattr(writer, "path", None)
    if path is None or (OCCUPANCY is None and REFUSAL is None):
        return
    try:
        occ = OCCUPANCY
        if occ is None:
            write_report(path + FILE_SUFFIX, [], None, off=REFUSAL)
            return
        if int(load.num_running_reqs) == 0:
            occ.reset()
            table = np.ones((len(occ.moe_layers), occ.num_experts), np.float32)
        else:
            table = occ.host_table()
            if table is None:
                return
        write_report(path + FILE_SUFFIX, occ.moe_layers, table, occ.steps)
    except Exception:  # never take the scheduler down for a report
        logger.exception("ELDR occupancy publish failed")


# --------------------------------------------------------------------------- /v1/loads
def split_include(include: list[str] | None) -> tuple[list[str] | None, bool]:
    """(include without "eldr", whether "eldr" was asked); "eldr" alone leaves "core"."""
    if not include or "eldr" not in include:
        return include, False
    rest = [s for s in include if s != "eldr"]
    return (rest or ["core"]), True


def _parse_layers(text: str | None, known: list[int]) -> list[int]:
    if text is None or not text.strip():
        return list(known)
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        try:
            layer = int(tok)
        except ValueError:
            raise ValueError(f"eldr_layers: {tok!r} is not a layer id") from None
        if layer not in known:
            raise ValueError(f"layer {layer} is not a MoE layer of this model (MoE layers: "
                             f"{','.join(map(str, known))})")
        out.append(layer)
    return out


def answer(load_results: list, eldr_layers: str | None, snapshot_path: str | None, flag_on: bool,
           num_dp_ranks: int) -> dict:
    """The top-level field(s) /v1/loads adds when `eldr` is in include: {"eldr_occupancy": ...}
    or {"eldr_occupancy_error": "<one line why>"}."""
    def err(why: str) -> dict:
        return {"eldr_occupancy_error": why}

    if not flag_on:
        return err("off (--enable-eldr-occupancy not set)")
    if num_dp_ranks > 1:
        return err("several DP ranks: not supported yet")
    if not snapshot_path:
        return err("no shared-memory load snapshot on this server (zmq transport): not supported yet")
    try:
        head, table = read_report(snapshot_path + FILE_SUFFIX)
    except OSError:
        return err("no occupancy report yet (the scheduler writes one at its first load snapshot)")
    except (ValueError, KeyError, TypeError) as exc:
        return err(f"unreadable occupancy report: {exc}")
    if table is None:
        return err(f"off ({head.get('off')})")
    try:
        layers = _parse_layers(eldr_layers, list(head["layers"]))
    except ValueError as exc:
        return err(str(exc))
    running = sum(int(getattr(l, "num_running_reqs", 0)) for l in load_results)
    rows = [head["layers"].index(l) for l in layers]
    idle = [[1.0] * table.shape[1] for _ in rows] if running == 0 else \
        [[round(float(x), 4) for x in table[r]] for r in rows]
    return {"eldr_occupancy": {"version": VERSION, "experts": int(table.shape[1]), "layers": layers,
                               "window_steps": WINDOW_STEPS, "running": running, "idle": idle}}


def answer_for(load_results: list, eldr_layers: str | None, tokenizer_manager: Any) -> dict:
    """`answer` (or `answer_signatures`) with this HTTP process's flags, DP ranks and snapshot
    path (never raises)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        from eldr_sglang.sglang_ext.runtime import _flag

        source, why = http_source()
        if source == "signatures":
            return answer_signatures(load_results, eldr_layers, why, _model_moe_layers(tokenizer_manager))
        path = getattr(getattr(tokenizer_manager, "load_snapshot_reader", None), "path", None)
        return answer(load_results, eldr_layers, path, bool(_flag("enable_eldr_occupancy")),
                      int(get_parallel().num_dp_ranks or 1))
    except Exception as exc:
        return {"eldr_occupancy_error": f"occupancy report failed: {type(exc).__name__}: {exc}"}


# --------------------------------------------------------------------------- source "signatures"
PROFILES = None  # this HTTP process's ProfileOccupancy (source "signatures"), made at first use


def profiles():
    """The process-wide ProfileOccupancy."""
    global PROFILES
    if PROFILES is None:
        from eldr_sglang.sglang_ext.profile_occupancy import ProfileOccupancy

        PROFILES = ProfileOccupancy()
    return PROFILES


def signatures_refusal(mode: str, tokenizer_workers: int) -> str | None:
    """Why an HTTP process with the signatures source does not count profiles; None when it does."""
    if mode == "prefill":
        return "--disaggregation-mode prefill: occupancy is kept by decode servers"
    if int(tokenizer_workers or 1) > 1:
        return (f"--tokenizer-worker-num {tokenizer_workers}: each HTTP worker holds only its share "
                "of the requests: not supported yet")
    return None


def http_source() -> tuple[str | None, str | None]:
    """(source, refusal) of this HTTP process: (None, why) when the flag is off; the refusal
    is None when the source runs."""
    from sglang.srt.runtime_context import get_disagg, get_serving

    disagg = get_disagg()
    if not getattr(disagg, "enable_eldr_occupancy", False):
        return None, "--enable-eldr-occupancy not set"
    source = getattr(disagg, "eldr_occupancy_source", "signatures")
    if source != "signatures":
        return source, None
    return source, signatures_refusal(getattr(disagg, "disaggregation_mode", "null"),
                                      getattr(get_serving(), "tokenizer_worker_num", 1))


async def while_served(request: Any, served: Any) -> Any:
    """Await a handler's response (`served`, a coroutine) with the request's `eldr_profile`
    counted in PROFILES: removed when the response ends (`hold_until_sent`), or at once when
    the handler raises. Another source, the flag off, or a body without a profile: just the
    response. The body is the one the route already parsed (Starlette caches it)."""
    try:
        source, why = http_source()
        body = await request.json() if source == "signatures" and why is None else None
    except Exception:  # not JSON (the route answers that), or not a patched server process
        body = None
    profile = body.get("eldr_profile") if isinstance(body, dict) else None
    token = profiles().add(profile) if profile is not None else None
    if token is None:  # none, or malformed (counted in PROFILES.dropped)
        return await served
    try:
        response = await served
    except BaseException:
        PROFILES.remove(token)
        raise
    return hold_until_sent(response, token)


def hold_until_sent(response: Any, token: int) -> Any:
    """Keep `token` counted until `response` is sent: a streaming body's iterator is wrapped so
    that its end or close (client disconnect) removes it; any other response is complete."""
    body = getattr(response, "body_iterator", None)
    if body is None:
        PROFILES.remove(token)
        return response
    response.body_iterator = _release_after(body, token)
    return response


async def _release_after(body: Any, token: int):
    try:
        async for chunk in body:
            yield chunk
    finally:
        PROFILES.remove(token)
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()


def _model_moe_layers(tokenizer_manager: Any) -> list[int] | None:
    """The served model's MoE layer ids from the HTTP process's model config, or None."""
    try:
        from eldr_sglang.sglang_ext.runtime import moe_layer_ids

        return moe_layer_ids(tokenizer_manager.model_config.hf_text_config)
    except Exception:
        return None


def answer_signatures(load_results: list, eldr_layers: str | None, why: str | None,
                      known: list[int] | None) -> dict:
    """The /v1/loads field of the signatures source: ProfileOccupancy.report for the asked
    layers (all MoE layers when none are asked), `running` from the loads."""
    if why is not None:
        return {"eldr_occupancy_error": f"off ({why})"}
    if known is None and not (eldr_layers or "").strip():
        return {"eldr_occupancy_error": "eldr_layers: the layers to report are needed (the model's MoE layers are unknown here)"}
    try:
        layers = _parse_layers(eldr_layers, known) if known is not None else \
            [int(t) for t in eldr_layers.split(",")]
    except ValueError as exc:
        msg = str(exc) if known is not None else f"eldr_layers {eldr_layers[:80]!r} is not a comma-separated list of layer ids"
        return {"eldr_occupancy_error": msg}
    running = sum(int(getattr(l, "num_running_reqs", 0)) for l in load_results)
    return profiles().report(",".join(map(str, layers)), running)
