"""ELDR trace format, version 1 (NumPy .npz): reading, validating, writing.

| array        | dtype, shape     | meaning                                          |
|--------------|------------------|--------------------------------------------------|
| expert_ids   | integer [T, L, k]| top-k expert ids of every token at every MoE layer|
| req_offsets  | int64 [R+1]      | request r is rows req_offsets[r]:req_offsets[r+1] |
| prefill_len  | int32 [R]        | first prefill_len[r] rows of r are its prompt     |
| domain       | str [R]          | optional label, for evaluation only               |
| subdomain    | str [R]          | optional finer label                              |
| arrival_s    | float64 [R]      | optional arrival times                            |
| meta_json    | str scalar       | format, version, model, num_layers, num_experts, top_k, ... |

Labels (`domain`, `subdomain`) are for scoring only: no routing or fitting code may read them.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from eldr_sglang import _core

TRACE_FORMAT = "eldr-trace"
TRACE_VERSION = 1
# Bounds on meta_json's sizes (the core's bound on E, the centroid file's; no real model comes close).
MAX_EXPERTS = _core.MAX_EXPERTS
MAX_LAYERS = 4096


def span_rows(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[j], starts[j] + lens[j]) without a Python loop: the rows
    of many requests' spans of a trace."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    rows = np.arange(total, dtype=np.int64)
    rows += np.repeat(np.asarray(starts, dtype=np.int64) - offs[:-1], lens)
    return rows


class TraceError(ValueError):
    """A trace file is missing, malformed or inconsistent; the message names the problem."""


def read_member(z, name: str, path) -> np.ndarray:
    """Array `name` of an open `.npz` (`np.load`'s NpzFile), or a TraceError naming the file and
    the member when it cannot be read: a flipped byte fails the ZIP CRC check
    (zipfile.BadZipFile), a cut file ends early (EOFError, OSError), a damaged .npy header
    fails to parse (ValueError)."""
    try:
        return z[name]
    except KeyError:
        raise TraceError(f"{path}: member {name!r} is missing") from None
    except Exception as exc:  # noqa: BLE001 - zipfile, zlib and npy errors come in many types
        raise TraceError(f"{path}: member {name!r} is corrupt or truncated ({type(exc).__name__}: {exc}); "
                         "the file is damaged: write or copy it again") from None


def check_meta(meta) -> dict:
    """meta_json as a dict with well-typed fields: an object; format and model strings;
    version, num_layers, num_experts, top_k integers in range. Raises TraceError naming the
    field (a null, a list, 2^31 experts)."""
    from eldr_sglang import json_fields as F

    try:
        meta = F.as_object(meta, "meta_json", parse_text=False)
        F.get_str(meta, "format", "meta_json", default=TRACE_FORMAT)
        F.get_int(meta, "version", "meta_json", default=TRACE_VERSION)
        F.get_str(meta, "model", "meta_json", default="unknown")
        F.get_int(meta, "num_layers", "meta_json", 1, MAX_LAYERS)
        E = F.get_int(meta, "num_experts", "meta_json", 1, MAX_EXPERTS)
        F.get_int(meta, "top_k", "meta_json", 1, E)
    except ValueError as exc:
        raise TraceError(str(exc)) from None
    return meta


@dataclass
class Trace:
    expert_ids: np.ndarray  # [T, L, k] integer
    req_offsets: np.ndarray  # int64 [R+1]
    prefill_len: np.ndarray  # int32 [R]
    meta: dict = field(default_factory=dict)
    domain: np.ndarray | None = None
    subdomain: np.ndarray | None = None
    arrival_s: np.ndarray | None = None

    counts_only: ClassVar[bool] = False  # a TraceSource: every token's routing is here

    @property
    def num_requests(self) -> int:
        return int(self.req_offsets.shape[0] - 1)

    @property
    def num_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def model(self) -> str:
        return str(self.meta.get("model", "unknown"))

    def request_len(self) -> np.ndarray:
        return np.diff(self.req_offsets)

    def decode_len(self) -> np.ndarray:
        return self.request_len() - self.prefill_len.astype(np.int64)

    def prefill_ids(self, r: int) -> np.ndarray:
        """[prefill_len, L, k] top-k ids of request r's prompt."""
        s = int(self.req_offsets[r])
        return self.expert_ids[s : s + int(self.prefill_len[r])]

    def decode_ids(self, r: int) -> np.ndarray:
        """[decode_len, L, k] top-k ids of request r's generated tokens, in order."""
        s = int(self.req_offsets[r]) + int(self.prefill_len[r])
        return self.expert_ids[s : int(self.req_offsets[r + 1])]

    def subset(self, requests: np.ndarray) -> "Trace":
        """A new trace holding the given requests, in the given order."""
        requests = np.asarray(requests, dtype=np.int64)
        lens = self.request_len()[requests]
        offsets = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        rows = np.concatenate(
            [np.arange(self.req_offsets[r], self.req_offsets[r + 1]) for r in requests]
        ) if len(requests) else np.zeros(0, dtype=np.int64)
        pick = lambda a: None if a is None else a[requests]  # noqa: E731
        return Trace(
            expert_ids=self.expert_ids[rows],
            req_offsets=offsets,
            prefill_len=self.prefill_len[requests],
            meta=dict(self.meta),
            domain=pick(self.domain),
            subdomain=pick(self.subdomain),
            arrival_s=pick(self.arrival_s),
        )

    def validate(self) -> None:
        """Raise TraceError naming the first inconsistency."""
        ids = self.expert_ids
        if ids.ndim != 3:
            raise TraceError(f"expert_ids must be [T, L, k], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TraceError(f"expert_ids must be integers, got dtype {ids.dtype}")
        check_meta(self.meta)
        if int(self.meta["num_layers"]) != ids.shape[1]:
            raise TraceError(
                f"layer mismatch: meta_json says num_layers={self.meta['num_layers']}, "
                f"expert_ids has {ids.shape[1]} layers"
            )
        if int(self.meta["top_k"]) != ids.shape[2]:
            raise TraceError(
                f"top-k mismatch: meta_json says top_k={self.meta['top_k']}, expert_ids has k={ids.shape[2]}"
            )
        off = self.req_offsets
        if off.ndim != 1 or off.shape[0] < 1:
            raise TraceError("req_offsets must be a 1-D array of R+1 offsets")
        if self.num_requests == 0:
            raise TraceError("empty trace: it holds no requests")
        if off[0] != 0 or off[-1] != ids.shape[0] or np.any(np.diff(off) < 0):
            raise TraceError(
                f"req_offsets must rise from 0 to T={ids.shape[0]}, got {off[0]}..{off[-1]}"
            )
        if self.prefill_len.shape != (self.num_requests,):
            raise TraceError(
                f"prefill_len has shape {self.prefill_len.shape}, expected ({self.num_requests},)"
            )
        if np.any(self.prefill_len < 0) or np.any(self.prefill_len > np.diff(off)):
            raise TraceError("prefill_len must lie between 0 and each request's token count")
        E = int(self.meta["num_experts"])
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= E:
                raise TraceError(f"expert ids out of range: found {lo}..{hi}, num_experts={E}")
        for name in ("domain", "subdomain", "arrival_s"):
            a = getattr(self, name)
            if a is not None and a.shape != (self.num_requests,):
                raise TraceError(f"{name} has shape {a.shape}, expected ({self.num_requests},)")
        if self.arrival_s is not None and not np.all(np.isfinite(self.arrival_s)):
            raise TraceError("arrival_s holds NaN or infinite values")

    def close(self) -> None:
        """Nothing to release (a TraceSource: a v2 trace closes its file)."""

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def trace_meta(path: str | os.PathLike) -> dict | None:
    """A v1 trace's checked meta_json (only that small member is read); None when unreadable or
    invalid (load_trace then reports what is wrong)."""
    try:
        with np.load(Path(path), allow_pickle=False) as z:
            return check_meta(json.loads(str(z["meta_json"])))
    except Exception:  # noqa: BLE001 - a TraceError or an unreadable file: load_trace reports it
        return None


def load_trace(path: str | os.PathLike, validate: bool = True) -> Trace:
    """Read an ELDR v1 trace (.npz). Raises TraceError with a clear message."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace file not found: {path}")
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as exc:  # zipfile/npy errors come in many types
        raise TraceError(f"{path}: not a readable .npz trace ({exc})") from None
    with z:
        if "meta_json" in z.files and "expert_ids" not in z.files:
            version = None
            with contextlib.suppress(Exception):  # a bad meta_json is reported below
                version = json.loads(str(read_member(z, "meta_json", path))).get("version")
            if version == 2:
                raise TraceError(f"{path}: a trace v2 (prompt counts; it does not store every prompt token's routing): "
                                 "eldr fit reads it; commands that replay every token need a trace v1 "
                                 "(eldr synth --format v1)")
        missing = [k for k in ("expert_ids", "req_offsets", "prefill_len", "meta_json") if k not in z.files]
        if missing:
            raise TraceError(f"{path}: not an ELDR trace, missing arrays {missing}")
        try:
            meta = json.loads(str(read_member(z, "meta_json", path)))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: meta_json is not valid JSON ({exc})") from None
        if isinstance(meta, dict) and meta.get("format", TRACE_FORMAT) != TRACE_FORMAT:
            raise TraceError(f"{path}: format {meta.get('format')!r} is not {TRACE_FORMAT!r}")
        try:
            meta = check_meta(meta)
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None
        if int(meta.get("version", TRACE_VERSION)) != TRACE_VERSION:
            raise TraceError(f"{path}: trace version {meta.get('version')} is not supported (only {TRACE_VERSION})")
        get = lambda k: read_member(z, k, path)  # noqa: E731
        opt = lambda k: get(k) if k in z.files else None  # noqa: E731
        arrival_s = opt("arrival_s")
        trace = Trace(
            expert_ids=get("expert_ids"),
            req_offsets=get("req_offsets").astype(np.int64, copy=False),
            prefill_len=get("prefill_len").astype(np.int32, copy=False),
            meta=meta,
            domain=opt("domain"),
            subdomain=opt("subdomain"),
            arrival_s=None if arrival_s is None else arrival_s.astype(np.float64, copy=False),
        )
    if validate:
        try:
            trace.validate()
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None
    return trace


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Validate, then write atomically: nothing is left behind on failure."""
    trace.validate()
    meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **trace.meta}
    meta["format"], meta["version"] = TRACE_FORMAT, TRACE_VERSION
    arrays = {
        "expert_ids": trace.expert_ids,
        "req_offsets": trace.req_offsets.astype(np.int64),
        "prefill_len": trace.prefill_len.astype(np.int32),
        "meta_json": np.array(json.dumps(meta)),
    }
    for name in ("domain", "subdomain", "arrival_s"):
        if getattr(trace, name) is not None:
            arrays[name] = getattr(trace, name)
    from eldr_sglang.io_safe import atomic_output

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path, "wb", what="trace") as fh:
        np.savez(fh, **arrays)
