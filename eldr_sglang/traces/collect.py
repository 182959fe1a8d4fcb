"""`eldr collect`: send a prompt dataset to a running SGLang server and record its routing.

Each prompt goes to SGLang's native `/generate` as
`{"text": ..., "sampling_params": {...}, "return_routed_experts": true}`; chat-style records
(`messages`) go to `/v1/chat/completions` with `"return_routed_experts": true`, so that the
server applies the model's chat template (the routed experts then come back in
`sglext.routed_experts`). Field names checked against the sglang 0.5.23 wheel
(srt/managers/io_struct.py GenerateReqInput, srt/entrypoints/openai/protocol.py). The server
must run with `--enable-return-routed-experts`.

- Concurrency: `concurrency` daemon worker threads, stdlib urllib only (Ctrl-C returns at
  once; requests still running are dropped and re-sent on the next run).
- Resumable: every answered request is appended (one checksummed JSON line, flushed, fsynced
  at least once a second) to a checkpoint `<out>.partial.jsonl` next to the output, keyed by
  a hash of the request it answers, under an exclusive lock (a concurrent second run is
  refused). A re-run skips every prompt whose request is already there; a damaged line (torn
  by an interruption, or garbled by a crash) is skipped with a warning and its prompt sent
  again. The checkpoint is only ever appended to, never rewritten.
- Transient failures (connection errors, timeouts, HTTP 5xx/429) are retried with backoff;
  other HTTP errors are not. If requests still fail, nothing is written but the checkpoint,
  and the error names the first failure (re-run to retry them, or `allow_failures`).
- Routing that does not fit the declared model (bad base64, wrong layer count, ids out of
  range, no routed_experts at all) stops the run at once with that error.
- The trace is written atomically once every prompt is answered: a trace v2 by default (each
  request's prompt counts, from its routed_experts or, without them, from the eldr_signature
  payload of a patched prefill; decode routing of the first `keep_decode` prompts), or v1
  (every token); the checkpoint is then removed unless `keep_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .sglang_responses import (
    ModelSpec,
    RequestCounts,
    RequestRouting,
    RoutedExpertsError,
    build_trace,
    response_counts,
    response_routing,
)
from .format import Trace, save_trace

LABEL_KEYS = ("domain", "category", "subject", "dataset", "source")


@dataclass
class Prompt:
    index: int
    text: str | None = None
    messages: list | None = None
    domain: str | None = None
    max_new_tokens: int | None = None


def _label(rec: dict) -> str | None:
    for k in LABEL_KEYS:
        v = rec.get(k)
        if isinstance(v, (str, int)) and str(v):
            return str(v)
    return None


def _prompt_from_record(rec, index: int, where: str) -> Prompt:
    if isinstance(rec, str):
        return Prompt(index, text=rec)
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object or string, got {type(rec).__name__}")
    mnt = rec.get("max_new_tokens", rec.get("max_tokens"))
    if mnt is not None and (not isinstance(mnt, int) or mnt < 1):
        raise ValueError(f"{where}: max_new_tokens must be a positive integer")
    for key in ("prompt", "text"):
        if key in rec:
            if not isinstance(rec[key], str) or not rec[key]:
                raise ValueError(f"{where}: {key!r} must be a non-empty string")
            return Prompt(index, text=rec[key], domain=_label(rec), max_new_tokens=mnt)
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return Prompt(index, messages=msgs, domain=_label(rec), max_new_tokens=mnt)
    if "conversations" in rec:  # ShareGPT: the first human turn is the prompt
        conv = rec["conversations"]
        if isinstance(conv, list):
            for turn in conv:
                if isinstance(turn, dict) and turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str) and turn["value"]:
                    return Prompt(index, text=turn["value"], domain=_label(rec), max_new_tokens=mnt)
        raise ValueError(f"{where}: ShareGPT record has no human turn")
    raise ValueError(f"{where}: record has none of 'prompt', 'text', 'messages', 'conversations'")


def load_prompts(path: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    """Prompts from JSONL ({"prompt"|"text"} or {"messages"} or ShareGPT records, one a
    line) or a JSON list (ShareGPT's format). A label key (domain, category, subject,
    dataset, source) becomes the request's domain label."""
    path = Path(path)
    if not path.exists():
        raise OSError(f"dataset not found: {path}")
    with open(path, "r", encoding="utf-8") as fh:
        head = fh.read(1 << 16).lstrip()
    recs: list[tuple[object, str]] = []
    if head.startswith("["):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        recs = [(r, f"{path}[{i}]") for i, r in enumerate(data)]
    else:
        with open(path, "r", encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    recs.append((json.loads(line), f"{path}:{n}"))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
                if limit is not None and len(recs) >= limit:
                    break
    if limit is not None:
        recs = recs[:limit]
    prompts = [_prompt_from_record(r, i, w) for i, (r, w) in enumerate(recs)]
    if not prompts:
        raise ValueError(f"{path}: the dataset holds no prompts")
    return prompts


@dataclass
class CollectConfig:
    url: str
    spec: ModelSpec
    max_new_tokens: int = 256
    temperature: float = 0.0
    ignore_eos: bool = False
    concurrency: int = 8
    timeout_s: float = 600.0
    retries: int = 2
    backoff_s: float = 1.0
    served_model: str = "default"
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)
    routed_experts: bool = True  # ask for every token's routing; False: counts from eldr_signature only

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if self.retries < 0 or self.timeout_s <= 0:
            raise ValueError("--retries must be >= 0 and --timeout > 0")


def build_request(p: Prompt, cfg: CollectConfig) -> tuple[str, dict]:
    """(endpoint path, JSON body) for one prompt."""
    n = p.max_new_tokens or cfg.max_new_tokens
    if p.messages is not None:
        body = {"model": cfg.served_model, "messages": p.messages, "max_tokens": n,
                "temperature": cfg.temperature, "return_routed_experts": cfg.routed_experts, "stream": False}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        return "/v1/chat/completions", {**body, **cfg.extra_body}
    sp = {"max_new_tokens": n, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        sp["ignore_eos"] = True
    return "/generate", {"text": p.text, "sampling_params": sp, "return_routed_experts": cfg.routed_experts,
                         "stream": False, **cfg.extra_body}


def request_key(endpoint: str, body: dict) -> str:
    return hashlib.sha256(json.dumps([endpoint, body], sort_keys=True).encode()).hexdigest()[:32]


class _Transient(Exception):
    pass


class _Permanent(Exception):
    pass


def _post(url: str, body: dict, timeout: float, api_key: str | None) -> dict:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read().decode("utf-8", "replace")[:300]
        except Exception:
            detail = ""
        msg = f"HTTP {exc.code} from {url}: {detail or exc.reason}"
        if exc.code >= 500 or exc.code == 429:
            raise _Transient(msg) from None
        raise _Permanent(msg) from None
    except urllib.error.URLError as exc:
        raise _Transient(f"cannot reach {url}: {exc.reason}") from None
    except (TimeoutError, OSError) as exc:
        raise _Transient(f"request to {url} failed: {exc}") from None
    try:
        out = json.loads(raw)
    except json.JSONDecodeError:
        raise _Permanent(f"{url} answered with something that is not JSON: {raw[:120]!r}") from None
    if isinstance(out, list) and len(out) == 1:
        out = out[0]
    if not isinstance(out, dict):
        raise _Permanent(f"{url} answered with a JSON {type(out).__name__}, expected an object")
    return out


def _compact(resp: dict) -> dict:
    """The parts of a response the trace needs (drops text, logprobs, ...)."""
    keep = {}
    if isinstance(resp.get("meta_info"), dict):
        m = resp["meta_info"]
        keep["meta_info"] = {k: m[k] for k in ("id", "prompt_tokens", "completion_tokens", "routed_experts",
                                               "finish_reason", "cached_tokens", "eldr_signature") if k in m}
    for k in ("usage", "sglext", "id"):
        if k in resp:
            keep[k] = resp[k]
    if "sglext" in keep and isinstance(keep["sglext"], dict):
        keep["sglext"] = {k: keep["sglext"].get(k) for k in ("routed_experts", "eldr_signature") if k in keep["sglext"]}
    return keep


def checkpoint_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial.jsonl")


def _checkpoint_line(rec: dict) -> bytes:
    """One checkpoint record: `<crc32 hex> <json>\n`, so a damaged line is recognised as one."""
    body = json.dumps(rec, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def _parse_checkpoint_line(line: bytes):
    """The record of a complete line, or None when it is damaged (bad checksum, not JSON,
    not a record). Lines without a checksum (older checkpoints) are plain JSON records."""
    body = line.rstrip(b"\n")
    if len(body) > 9 and body[8:9] == b" " and not body.startswith(b"{"):
        head, body = body[:8], body[9:]
        try:
            if int(head, 16) != zlib.crc32(body):
                return None
        except ValueError:
            return None
    try:
        rec = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or "key" not in rec or "response" not in rec:
        return None
    return rec


def read_checkpoint(path: Path, on_record: Callable[[dict], None] | None = None,
                    damaged: list | None = None) -> dict[str, dict]:
    """Stream the checkpoint: key -> {"index", "domain"} of every intact record, calling
    `on_record(record)` on each (the raw response is not kept, so memory stays small).
    A damaged line (a torn last line, a checksum that does not match, as a crash can leave)
    is skipped and its line number appended to `damaged`: its prompt is simply sent again.
    The file is never rewritten here."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip(b"\x00 \n"):
                continue
            rec = _parse_checkpoint_line(line) if line.endswith(b"\n") else None
            if rec is None:
                if damaged is not None:
                    damaged.append(n)
                continue
            if on_record is not None:
                on_record(rec)
            done[rec["key"]] = {"index": rec.get("index"), "domain": rec.get("domain")}
    return done


class _CheckpointWriter:
    """Appends records to the checkpoint, crash-safe: an exclusive lock (a second run of the
    same command is refused, not interleaved), a newline first when the file ends in a torn
    line, one checksummed line per record, and an fsync at least every `sync_s` seconds and
    on close, so a crash or power loss costs at most the last moments' answers."""

    def __init__(self, path: Path, sync_s: float = 1.0):
        import fcntl

        self.fh = open(path, "ab")
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.close()
            raise ValueError(f"{path} is in use by another eldr collect run; wait for it or give another --out") from None
        if self.fh.tell() > 0:
            with open(path, "rb") as rd:
                rd.seek(-1, os.SEEK_END)
                if rd.read(1) != b"\n":
                    self.fh.write(b"\n")  # the torn line stays a line of its own, skipped on read
        self.sync_s = sync_s
        self.last_sync = time.monotonic()

    def append(self, rec: dict) -> None:
        self.fh.write(_checkpoint_line(rec))
        self.fh.flush()
        if time.monotonic() - self.last_sync >= self.sync_s:
            os.fsync(self.fh.fileno())
            self.last_sync = time.monotonic()

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()  # releases the lock

    def __enter__(self) -> "_CheckpointWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class CollectResult:
    trace: Trace | None  # the v1 trace (None for v2: it was streamed to the file)
    requests: int
    tokens: int  # prompt + decode tokens of the requests written
    total: int
    reused: int
    sent: int
    failed: list[tuple[int, str]]
    checkpoint: Path


def collect(
    prompts: list[Prompt],
    cfg: CollectConfig,
    out: str | os.PathLike,
    progress: bool | Callable[[int], None] = True,
    allow_failures: bool = False,
    keep_checkpoint: bool = False,
    fmt: str = "v2",
    keep_decode: int | None = None,
) -> CollectResult:
    """Collect routing for every prompt and write the trace to `out` (atomically): a v2 trace
    (prompt counts, and the decode routing of the first `keep_decode` prompts, all when None)
    or, with fmt="v1", every token's routing."""
    if fmt not in ("v1", "v2"):
        raise ValueError(f"unknown trace format {fmt!r} (v1 or v2)")
    cfg.validate()
    out = Path(out)
    ckpt = checkpoint_path(out)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    reqs = [build_request(p, cfg) for p in prompts]
    keys = [request_key(ep, body) for ep, body in reqs]
    parse = _parser(keys, cfg, fmt, keep_decode)
    # parse what the checkpoint holds (checked against the model before sending anything)
    parsed: dict[str, RequestRouting | RequestCounts] = {}
    wanted = set(keys)

    def take(rec: dict) -> None:
        if rec["key"] in wanted:
            parsed[rec["key"]] = parse(rec["response"], rec["key"], f"{ckpt.name} (prompt {rec.get('index')})")

    todo, reused = _resume(ckpt, keys, take, parsed)
    bar, tick = _progress(progress, len(prompts), reused)
    try:
        sent, failed, fatal = _send_all(prompts, reqs, keys, todo, cfg, ckpt, parse, parsed, tick)
    finally:
        if bar is not None:
            bar.close()
    if fatal:
        raise ValueError(f"collection stopped: {fatal[0]} (answers so far are kept in {ckpt})")
    if failed and not allow_failures:
        i, msg = failed[0]
        raise ValueError(f"{len(failed)} of {len(prompts)} requests failed (first: prompt {i}: {msg}); "
                         f"answers so far are kept in {ckpt}; re-run to retry them")
    trace, n_req, n_tok = _write_collected(prompts, keys, parsed, cfg, out, fmt)
    if not keep_checkpoint:
        ckpt.unlink(missing_ok=True)
    return CollectResult(trace, n_req, n_tok, len(prompts), reused, sent, failed, ckpt)


def _parser(keys: list[str], cfg: CollectConfig, fmt: str, keep_decode: int | None):
    """parse(response, key, where): a response as the trace keeps it (v1: every token's
    routing; v2: prompt counts, and decode routing for the first `keep_decode` prompts)."""
    first_of: dict[str, int] = {}
    for i, k in enumerate(keys):
        first_of.setdefault(k, i)

    def parse(resp: dict, key: str, where: str):
        if fmt == "v1":
            return response_routing(resp, cfg.spec, where=where)
        keep = keep_decode is None or first_of[key] < keep_decode
        return response_counts(resp, cfg.spec, keep_decode=keep, where=where)  # only what the trace keeps

    return parse


def _progress(progress: bool | Callable[[int], None], total: int, initial: int):
    """(a bar to close or None, tick(n) or None): the caller's callback, or a bar when `progress`."""
    if callable(progress):
        return None, progress
    if progress:
        from eldr_sglang.progress import progress as progress_bar

        bar = progress_bar(total, initial=initial, unit="req", desc="collect")
        return bar, bar.update
    return None, None


def _send_all(prompts, reqs, keys, todo, cfg: CollectConfig, ckpt: Path, parse, parsed: dict, tick):
    """Send the prompts of `todo`, each answer appended to the checkpoint and parsed into
    `parsed`. Returns (sent, failed [(prompt, why)], fatal [why]): an unreachable server or a
    response without routing stops the feeding (the in-flight ones still land)."""
    failed: list[tuple[int, str]] = []
    fatal: list[str] = []
    sent = 0
    feeder = _Feeder(_sender(cfg, reqs), min(cfg.concurrency, max(1, len(todo))))
    try:
        with _CheckpointWriter(ckpt) as fh:
            for i, resp, exc in feeder.run(todo, stop=lambda: bool(fatal)):
                sent += 1
                if exc is not None:
                    if not isinstance(exc, (_Transient, _Permanent)):
                        raise exc
                    failed.append((i, str(exc)))
                    if isinstance(exc, _Transient) and "cannot reach" in str(exc):
                        fatal.append(str(exc))  # stop feeding; let the in-flight ones land
                    continue
                rec = {"key": keys[i], "index": i, "domain": prompts[i].domain, "response": _compact(resp)}
                fh.append(rec)
                try:
                    parsed[keys[i]] = parse(rec["response"], keys[i], f"prompt {i}")
                except RoutedExpertsError as exc2:
                    fatal.append(str(exc2))
                if tick:
                    tick(1)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(parsed)} answers are kept in {ckpt}; run the same command again to resume",
              file=sys.stderr)
        raise
    finally:
        feeder.close()
    return sent, failed, fatal


def _resume(ckpt: Path, keys: list[str], take: Callable[[dict], None], done: dict) -> tuple[list[int], int]:
    """Read the checkpoint (each good record goes to `take`, which fills `done`; damaged lines
    are skipped and said) and return (the prompt indices still to send, the number of prompts answered
    already). A prompt repeated in the dataset is sent once."""
    damaged: list[int] = []
    read_checkpoint(ckpt, take, damaged)
    if damaged:
        shown = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        print(f"eldr collect: {ckpt}: skipped {len(damaged)} damaged checkpoint line(s) (line {shown}); "
              "their prompts are sent again", file=sys.stderr)
    todo, queued = [], set()
    for i, k in enumerate(keys):
        if k not in done and k not in queued:
            todo.append(i)
            queued.add(k)
    return todo, sum(1 for k in keys if k in done)


def _sender(cfg: CollectConfig, reqs: list[tuple[str, dict]]) -> Callable[[int], dict]:
    """POST request i, retrying transient failures with exponential back-off."""
    base = cfg.url.rstrip("/")

    def work(i: int) -> dict:
        ep, body = reqs[i]
        delay = cfg.backoff_s
        for attempt in range(cfg.retries + 1):
            try:
                return _post(base + ep, body, cfg.timeout_s, cfg.api_key)
            except _Transient:
                if attempt == cfg.retries:
                    raise
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    return work


class _Feeder:
    """Daemon worker threads fed through queues (not a ThreadPoolExecutor, whose non-daemon
    workers would hold Ctrl-C until every in-flight request finished or timed out). At most
    two requests per thread are queued, so a stop leaves little unsent work behind."""

    def __init__(self, work: Callable[[int], dict], threads: int):
        self.work = work
        self.tasks: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._worker, daemon=True, name=f"eldr-collect-{n}")
                        for n in range(threads)]
        for t in self.threads:
            t.start()

    def _worker(self) -> None:
        while True:
            i = self.tasks.get()
            if i is None:
                return
            try:
                self.results.put((i, self.work(i), None))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.results.put((i, None, exc))

    def run(self, todo: list[int], stop: Callable[[], bool]):
        """Yield (index, response or None, exception or None) as answers land; no new work is
        fed once `stop()` is true, and the ones in flight still land."""
        source = iter(todo)
        in_flight = 0
        while True:
            while not stop() and in_flight < 2 * len(self.threads):
                i = next(source, None)
                if i is None:
                    break
                self.tasks.put(i)
                in_flight += 1
            if in_flight == 0:
                return
            got = self.results.get()
            in_flight -= 1
            yield got

    def close(self) -> None:
        """Drop the queued requests; running ones finish unrecorded in their daemon threads."""
        while True:
            try:
                self.tasks.get_nowait()
            except queue.Empty:
                break
        for _ in self.threads:
            self.tasks.put(None)


def _write_collected(prompts, keys, parsed: dict, cfg, out: Path, fmt: str):
    """The collected requests, in prompt order, written to `out`: (v1 Trace or None, requests, tokens)."""
    rows = []
    for i, k in enumerate(keys):
        if k in parsed:
            rr = parsed[k]
            rr.domain = prompts[i].domain
            rows.append(rr)
    source = f"eldr collect {cfg.url}"
    if fmt == "v1":
        trace = build_trace(rows, cfg.spec, source=source)
        if all(r.domain is None for r in rows):
            trace.domain = None
        save_trace(trace, out)
        return trace, trace.num_requests, int(trace.expert_ids.shape[0])
    n_req, n_tok = write_counts(rows, cfg.spec, out, source)
    return None, n_req, n_tok


def write_counts(rows: list[RequestCounts], spec: ModelSpec, out: str | os.PathLike, source: str,
                 chunk_requests: int = 4096) -> tuple[int, int]:
    """Write collected requests as a trace v2; (requests, tokens)."""
    import numpy as np
    import scipy.sparse as sp

    from .counts_file import CountsTraceWriter

    if not rows:
        raise ValueError("no requests: the trace would be empty")
    L = rows[0].num_layers
    if any(r.num_layers != L for r in rows):
        raise ValueError("requests disagree on the number of MoE layers; give moe_layers or first_k_dense_replace")
    E, k = spec.num_experts, spec.top_k
    labels = any(r.domain is not None for r in rows)
    meta = {"model": spec.model, "source": source, "num_hidden_layers": spec.num_hidden_layers,
            **({"moe_layers": spec.moe_layers} if spec.moe_layers is not None else {})}
    dtype = np.uint8 if E <= 256 else np.int16
    with CountsTraceWriter(out, num_layers=L, num_experts=E, top_k=k, meta=meta) as w:
        for a in range(0, len(rows), chunk_requests):
            part = rows[a : a + chunk_requests]
            indptr = np.zeros(len(part) + 1, dtype=np.int64)
            np.cumsum([r.index.size for r in part], out=indptr[1:])
            counts = sp.csr_matrix((np.concatenate([r.counts for r in part]), np.concatenate([r.index for r in part]),
                                    indptr), shape=(len(part), L * E))
            kept = [j for j, r in enumerate(part) if r.decode_ids is not None]
            decode = None
            if kept:
                d_off = np.zeros(len(kept) + 1, dtype=np.int64)
                np.cumsum([part[j].decode_len for j in kept], out=d_off[1:])
                decode = (np.array(kept, dtype=np.int64), d_off,
                          np.concatenate([part[j].decode_ids for j in kept]).astype(dtype))
            w.write_chunk(counts, [r.prefill_len for r in part], [r.decode_len for r in part],
                          exact=[r.exact for r in part],
                          domain=np.array([r.domain or "" for r in part]) if labels else None, decode=decode)
    return len(rows), sum(r.prefill_len + r.decode_len for r in rows)
