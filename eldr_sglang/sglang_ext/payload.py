"""The signature payload a prefill worker sends to the router: compact expert counts.

A prefill worker counts, for each MoE layer l and expert e, how many prompt tokens chose e
in their top-k at l (`c[l][e]`). The router turns those counts into the request's signature
(IDF, layer weights, L2 norm: the Rust `SignatureSpec`), so the prefill side needs no
calibration data. The payload is a small JSON object:

| key      | meaning                                                                    |
|----------|----------------------------------------------------------------------------|
| `v`      | payload version (1)                                                         |
| `layers` | hidden-layer ids of the rows (the MoE layers; dense layers are left out)    |
| `E`      | experts per layer                                                            |
| `n`      | tokens counted                                                              |
| `enc`    | `dense`, `sparse` (both exact) or `log` (lossy, only when nothing exact fits)|
| `bits`   | bit width of each packed value                                              |
| `nnz`    | (`sparse`) number of non-zero entries                                       |
| `q`      | (`log`) per-layer maximum count, the scale of the log quantizer             |
| `d`      | base64 of the packed data                                                   |

The encoder takes the smallest exact encoding that fits `max_bytes` (of compact JSON), else
the finest log quantization that fits. For DeepSeek-V3 (58 MoE layers x 256 experts) that is
at most 16 KiB whatever the prompt length; short prompts travel exactly. The decoder is the
Rust one (rust/core/src/payload.rs, `_core.decode_payload` / `_core.decode_event`): it
validates everything and raises `PayloadError` (the router then falls back and counts it),
and keeps the counts packed, so the router reads them straight into the signature.
"""

from __future__ import annotations

import base64
import json
import math

import numpy as np

from eldr_sglang import _core
from eldr_sglang._core import DecodedCounts, PayloadError

PAYLOAD_VERSION = 1
DEFAULT_MAX_BYTES = 16 * 1024
META_KEY = _core.PAYLOAD_KEY  # the meta_info / sglext field that carries the payload ("eldr_signature")


def _pack(values: np.ndarray, bits: int) -> bytes:
    """Little-endian bit packing of non-negative integers < 2**bits."""
    v = np.ascontiguousarray(values, dtype=np.uint32)
    if bits in (8, 16, 32):
        return v.astype({8: "<u1", 16: "<u2", 32: "<u4"}[bits]).tobytes()
    planes = ((v[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def _bits_for(max_value: int) -> int:
    b = max(1, int(max_value).bit_length())
    return b if b <= 16 else 32


def _dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def encode_counts(
    counts: np.ndarray,
    layers: list[int] | tuple[int, ...],
    num_tokens: int,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict:
    """Counts [L, E] (non-negative integers) of the given hidden layers -> payload dict."""
    c = np.asarray(counts)
    if c.ndim != 2 or c.shape[0] != len(layers):
        raise ValueError(f"counts must be [len(layers)={len(layers)}, E], got shape {c.shape}")
    if c.size and (c.min() < 0):
        raise ValueError("counts must be non-negative")
    c = c.astype(np.uint32, copy=False)
    L, E = c.shape
    base = {"v": PAYLOAD_VERSION, "layers": [int(x) for x in layers], "E": int(E), "n": int(num_tokens)}
    flat = c.reshape(-1)
    bits = _bits_for(int(flat.max()) if flat.size else 0)
    nz = np.flatnonzero(flat)
    idx_dtype = "<u2" if flat.size <= 1 << 16 else "<u4"
    candidates = [
        dict(base, enc="dense", bits=bits, d=base64.b64encode(_pack(flat, bits)).decode()),
    ]
    sparse_bytes = nz.size * (np.dtype(idx_dtype).itemsize) + (nz.size * bits + 7) // 8
    if sparse_bytes < (flat.size * bits + 7) // 8:
        blob = nz.astype(idx_dtype).tobytes() + _pack(flat[nz], bits)
        candidates.append(dict(base, enc="sparse", bits=bits, nnz=int(nz.size), d=base64.b64encode(blob).decode()))
    best = min(candidates, key=lambda p: len(p["d"]))
    if len(_dumps(best)) <= max_bytes:
        return best
    # Lossy: per-layer log quantization; every used expert stays non-zero.
    qmax = c.max(axis=1).astype(np.int64)
    logmax = np.log1p(qmax.astype(np.float64))
    for b in range(min(bits, 15, worst_case_bits(L, E, max_bytes) + 1), 0, -1):
        levels = (1 << b) - 1
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(logmax[:, None] > 0, np.log1p(c) / logmax[:, None] * levels, 0.0)
        q = np.rint(q).astype(np.uint32)
        q[(c > 0) & (q == 0)] = 1
        p = dict(base, enc="log", bits=b, q=[int(x) for x in qmax], d=base64.b64encode(_pack(q.reshape(-1), b)).decode())
        if len(_dumps(p)) <= max_bytes:
            return p
    raise ValueError(f"no encoding of {L}x{E} counts fits {max_bytes} bytes")


def payload_size(payload: dict) -> int:
    return len(_dumps(payload))


# The bounds the decoder enforces before it allocates (defined in rust/core/src/payload.rs).
MAX_ENTRIES = _core.PAYLOAD_MAX_ENTRIES  # largest count grid (L*E) a payload may claim
MAX_LAYERS = _core.PAYLOAD_MAX_LAYERS
MAX_COUNT = _core.PAYLOAD_MAX_COUNT  # a count (and a log-quantizer maximum) is at most the tokens counted


def decode_payload(payload: object, max_bytes: int = 1 << 20,
                   layout: tuple[int, int] | None = None) -> DecodedCounts:
    """Validate and decode a payload (a dict, a one-request list of one, or its JSON text).
    Raises PayloadError.

    The decoder is the Rust one the router uses (`_core.decode_payload`): at most `max_bytes`
    of data, at most MAX_ENTRIES counts, and with `layout` = (num_layers, num_experts) of the
    centroid file the payload must fit it (same E, layer ids below num_layers) or it is
    refused unread. The result keeps the counts packed; `.counts` makes the dense array."""
    if not isinstance(payload, (str, bytes)):
        try:
            payload = _dumps(payload)
        except (TypeError, ValueError, RecursionError) as exc:
            raise PayloadError(f"payload is not JSON-serializable ({exc.__class__.__name__})") from None
    return _core.decode_payload(payload, max_bytes, layout)


def to_layout(counts: DecodedCounts, num_layers: int, num_experts: int) -> np.ndarray:
    """Counts in the centroid file's layout: [num_layers, E] float32.

    The centroid file holds either only the MoE layers (num_layers == len(counts.layers):
    rows are taken in order) or every hidden layer (dense rows stay zero and carry weight 0).
    Raises PayloadError when the two cannot be aligned.
    """
    return counts.to_layout(num_layers, num_experts)


def worst_case_bits(num_layers: int, num_experts: int, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Bits per count the log encoding can afford for this shape within max_bytes."""
    overhead = 64 + 12 * num_layers  # header, layer ids and per-layer maxima
    usable = (max_bytes - overhead) * 3 // 4
    return max(0, min(15, int(math.floor(usable * 8 / (num_layers * num_experts)))))
