"""Memory checked up front: before `synth`, `fit` or `simulate` allocate anything, estimate the
bytes their largest arrays must hold (from the sizes alone: the trace's array headers, the
requested counts) and refuse, with a message, when that exceeds the memory available
(/proc/meminfo MemAvailable, or an explicit --max-memory). The estimates count only the
arrays a run cannot do without, so they are lower bounds: a refusal is always warranted, and a
run that passes may still need more (the CLI turns a MemoryError into one line as a last
resort).
"""

from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class InsufficientMemory(ValueError):
    """A run would need more memory than is available."""


def parse_size(text: str) -> int:
    """'512M', '8G', '1.5g', '1000000' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)i?[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"expected a size like 512M or 8G, got {text!r}")
    v = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not (v >= 1 and v < (1 << 62)):
        raise ValueError(f"size {text!r} is out of range")
    return int(v)


def fmt(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def require(need: float, what: str, max_memory: int | None = None) -> None:
    """Raise InsufficientMemory when `need` bytes exceed `max_memory` (or what is available)."""
    limit = max_memory if max_memory is not None else available_bytes()
    if limit is None or need <= limit:
        return
    source = "--max-memory" if max_memory is not None else "MemAvailable"
    raise InsufficientMemory(f"{what} needs at least {fmt(need)} of memory, more than the {fmt(limit)} available ({source}); "
                             "use smaller sizes, or raise --max-memory if you know better")


@dataclass(frozen=True)
class TraceShape:
    tokens: int  # T
    layers: int  # L
    top_k: int  # k
    id_bytes: int  # itemsize of expert_ids
    requests: int  # R

    @property
    def ids_bytes(self) -> int:
        return self.tokens * self.layers * self.top_k * self.id_bytes


def trace_shape(path: str | os.PathLike) -> TraceShape | None:
    """Shapes of a trace's arrays from the .npz headers, without reading the arrays (of a v2
    trace: its kept decode routing, what the simulator holds); None when the file cannot be
    read that way (load_trace then reports what is wrong)."""
    try:
        with zipfile.ZipFile(Path(path)) as z:
            def header(name):
                with z.open(name + ".npy") as fh:
                    major, _ = np.lib.format.read_magic(fh)
                    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(fh)
                return shape, dtype

            names = set(z.namelist())
            if "expert_ids.npy" not in names and "c0_indptr.npy" in names:
                # a v2 trace: what a reader holds in memory is its kept decode routing
                tokens = requests = 0
                ids_shape, ids_dtype = None, None
                for n in sorted(names):
                    if n.startswith("d") and n.endswith("_expert_ids.npy"):
                        ids_shape, ids_dtype = header(n[:-4])
                        tokens += int(ids_shape[0])
                        requests += int(header(n[: -len("_expert_ids.npy")] + "_requests")[0][0])
                if ids_shape is None or len(ids_shape) != 3:
                    return None
                return TraceShape(tokens, int(ids_shape[1]), int(ids_shape[2]), int(ids_dtype.itemsize), requests)
            (ids_shape, ids_dtype), (off_shape, _) = header("expert_ids"), header("req_offsets")
    except Exception:  # noqa: BLE001 - any unreadable file is load_trace's to report
        return None
    if len(ids_shape) != 3 or len(off_shape) != 1:
        return None
    return TraceShape(int(ids_shape[0]), int(ids_shape[1]), int(ids_shape[2]), int(ids_dtype.itemsize), max(0, int(off_shape[0]) - 1))


def synth_bytes(requests: int, mean_tokens: float, layers: int, top_k: int, num_experts: int) -> float:
    """synth holds the [T, L, k] ids (uint8 up to 256 experts, else int16) and, per token, its
    concept (int32) and request/position indices (int64 each) while drawing."""
    tokens = requests * mean_tokens
    return tokens * (layers * top_k * (1 if num_experts <= 256 else 2) + 4 + 8 + 8)


def streaming_synth_bytes(requests: int, block_tokens: int, layers: int, top_k: int, num_experts: int,
                          block_requests: int, jobs: int = 1) -> float:
    """synth to a v2 file holds about 160 bytes per request (the workload's arrays and the
    written per-request columns), and for one block of requests its tokens' ids (twice: the
    layer-major gather buffer), concepts and draw indices, and the block's dense count rows
    while counting. With `jobs` worker processes, each holds the per-request arrays and one
    block, and up to two finished blocks per worker wait in the parent (their ids as counts
    are smaller than the ids; bounded by them)."""
    block = block_tokens * (2 * layers * top_k * (1 if num_experts <= 256 else 2) + 4 + 8 + 8 + 8) \
        + block_requests * layers * num_experts * 4
    if jobs <= 1:
        return requests * 160 + block
    return (jobs + 1) * requests * 160 + jobs * block + 2 * jobs * block_tokens * layers * top_k


def fit_bytes(shape: TraceShape, num_experts: int, selected_layers: int, profile_sample: int, chunk_tokens: int) -> float:
    """fit holds the trace's ids, the final dense signatures [R, S*E] float32, the decode
    profiles of up to `profile_sample` requests [n, L, E] float32, and while counting a chunk
    of `chunk_tokens` tokens its int64 (layer, expert) keys and their flattened copy."""
    sig = shape.requests * selected_layers * num_experts * 4
    prof = min(shape.requests, profile_sample) * shape.layers * num_experts * 4
    keys = min(shape.tokens, chunk_tokens) * shape.layers * shape.top_k * 8 * 2
    return shape.ids_bytes + sig + prof + keys


@dataclass(frozen=True)
class CountsShape:
    requests: int  # R
    layers: int  # L
    experts: int  # E
    nnz: int  # stored (request, layer, expert) counts
    decode_requests: int  # requests that keep decode routing


def counts_shape(meta: dict | None) -> CountsShape | None:
    """Sizes of a trace v2 from its meta_json (the chunk table); None for v1 or bad meta."""
    try:
        if meta is None or meta.get("version") != 2:
            return None
        return CountsShape(int(meta["num_requests"]), int(meta["num_layers"]), int(meta["num_experts"]),
                           sum(int(c["nnz"]) for c in meta["chunks"]), int(meta.get("decode_requests", 0)))
    except (KeyError, TypeError, ValueError):
        return None


def counts_fit_bytes(shape: CountsShape, selected_layers: int, profile_sample: int) -> float:
    """fit of a trace v2 holds the sparse signatures of the selected layers (about their share
    of the stored counts, 8 bytes each: value and column), and the decode profiles of up to
    `profile_sample` requests that kept decode routing [n, L, E] float32."""
    sig = shape.nnz * selected_layers / max(1, shape.layers) * 8 + shape.requests * 8
    prof = min(shape.decode_requests, profile_sample) * shape.layers * shape.experts * 4
    return sig + prof


def simulate_bytes(shape: TraceShape, signature_dim: int, simulated_requests: int) -> float:
    """simulate holds the trace's ids, the eldr signatures [R, D] float32, and about a dozen
    8-byte per-request arrays of the simulated workload and its metrics."""
    return shape.ids_bytes + shape.requests * signature_dim * 4 + simulated_requests * 12 * 8
