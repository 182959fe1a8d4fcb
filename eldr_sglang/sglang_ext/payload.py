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
at most 16 KiB whatever the prompt length; short prompts travel exactly. The decoder
validates everything and raises `PayloadError` (the router then falls back and counts it).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass

import numpy as np

PAYLOAD_VERSION = 1
DEFAULT_MAX_BYTES = 16 * 1024
META_KEY = "eldr_signature"  # the meta_info / sglext field that carries the payload


class PayloadError(ValueError):
    """A signature payload is malformed; the message says what is wrong."""


@dataclass(frozen=True)
class DecodedSignature:
    counts: np.ndarray  # float32 [len(layers), E]
    layers: tuple[int, ...]
    num_tokens: int
    exact: bool
    data_bytes: int  # length of the base64 data field


def _pack(values: np.ndarray, bits: int) -> bytes:
    """Little-endian bit packing of non-negative integers < 2**bits."""
    v = np.ascontiguousarray(values, dtype=np.uint32)
    if bits in (8, 16, 32):
        return v.astype({8: "<u1", 16: "<u2", 32: "<u4"}[bits]).tobytes()
    planes = ((v[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def _unpack(data: bytes, n: int, bits: int) -> np.ndarray:
    need = (n * bits + 7) // 8
    if len(data) != need:
        raise PayloadError(f"packed data holds {len(data)} bytes, expected {need} for {n} values of {bits} bits")
    if bits in (8, 16, 32):
        return np.frombuffer(data, dtype={8: "<u1", 16: "<u2", 32: "<u4"}[bits]).astype(np.uint32)
    flat = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=n * bits, bitorder="little")
    weights = (np.uint32(1) << np.arange(bits, dtype=np.uint32)).astype(np.uint32)
    return flat.reshape(n, bits).astype(np.uint32) @ weights


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


def _int(obj: dict, key: str, lo: int, hi: int) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        shown = repr(v) if not isinstance(v, int) or abs(v) < 1 << 64 else "a huge integer"
        raise PayloadError(f"field {key!r} must be an integer in [{lo}, {hi}], got {shown[:80]}")
    return v


# Largest count grid a payload may claim (L*E): DeepSeek-V3 is 61 x 256 = 15,616 with its
# dense layers; 1M entries leaves room for any MoE in sight and bounds the decoder's work.
MAX_ENTRIES = 1 << 20
MAX_LAYERS = 4096
MAX_COUNT = 1 << 40  # a count (and a log-quantizer maximum) is at most the tokens counted


def decode_payload(payload: object, max_bytes: int = 1 << 20,
                   layout: tuple[int, int] | None = None) -> DecodedSignature:
    """Validate and decode a payload (a dict, or a JSON string of one). Raises PayloadError.

    The cost is bounded before any array is made: at most `max_bytes` of data, at most
    MAX_ENTRIES counts, and with `layout` = (num_layers, num_experts) of the centroid file
    the payload must fit it (same E, layer ids below num_layers) or it is refused unread."""
    if isinstance(payload, (str, bytes)):
        if len(payload) > max_bytes:
            raise PayloadError(f"payload of {len(payload)} bytes exceeds {max_bytes}")
        try:
            payload = json.loads(payload)
        except (ValueError, RecursionError) as exc:
            raise PayloadError(f"payload is not JSON ({exc.__class__.__name__})") from None
    if isinstance(payload, list) and len(payload) == 1:  # meta_info lists per-request values
        payload = payload[0]
    if not isinstance(payload, dict):
        raise PayloadError(f"payload must be a JSON object, got {type(payload).__name__}")
    if payload.get("v") != PAYLOAD_VERSION:
        raise PayloadError(f"unsupported payload version {payload.get('v')!r} (expected {PAYLOAD_VERSION})")
    layers = payload.get("layers")
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_LAYERS:
        raise PayloadError(f"field 'layers' must be a non-empty list of at most {MAX_LAYERS} layer ids")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_LAYERS for x in layers):
        raise PayloadError(f"field 'layers' must hold layer ids in [0, {MAX_LAYERS})")
    if len(set(layers)) != len(layers):
        raise PayloadError("field 'layers' repeats a layer id")
    E = _int(payload, "E", 1, 1 << 16)
    n = _int(payload, "n", 0, MAX_COUNT)
    bits = _int(payload, "bits", 1, 32)
    if len(layers) * E > MAX_ENTRIES:
        raise PayloadError(f"{len(layers)} layers x {E} experts exceeds {MAX_ENTRIES} counts")
    if layout is not None:
        num_layers, num_experts = layout
        if E != num_experts:
            raise PayloadError(f"payload has {E} experts per layer, the centroids {num_experts}")
        if len(layers) != num_layers and max(layers) >= num_layers:
            raise PayloadError(f"payload layer id {max(layers)} is outside the centroids' {num_layers} layers")
    enc = payload.get("enc")
    d = payload.get("d")
    if not isinstance(d, str):
        raise PayloadError("field 'd' must be a base64 string")
    if len(d) > max_bytes:
        raise PayloadError(f"data of {len(d)} bytes exceeds {max_bytes}")
    try:
        raw = base64.b64decode(d, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(f"field 'd' is not valid base64 ({exc})") from None
    L = len(layers)
    size = L * E
    if enc == "dense":
        flat = _unpack(raw, size, bits).astype(np.float32)
        exact = True
    elif enc == "sparse":
        nnz = _int(payload, "nnz", 0, size)
        idx_dtype = np.dtype("<u2" if size <= 1 << 16 else "<u4")
        ib = nnz * idx_dtype.itemsize
        if len(raw) != ib + (nnz * bits + 7) // 8:
            raise PayloadError(f"sparse data holds {len(raw)} bytes, expected {ib + (nnz * bits + 7) // 8} for {nnz} entries")
        idx = np.frombuffer(raw[:ib], dtype=idx_dtype).astype(np.int64)
        if idx.size and (idx.max() >= size or np.any(np.diff(idx) <= 0)):
            raise PayloadError("sparse indices must be increasing and below layers*E")
        vals = _unpack(raw[ib:], nnz, bits)
        flat = np.zeros(size, dtype=np.float32)
        flat[idx] = vals
        exact = True
    elif enc == "log":
        q = payload.get("q")
        if not isinstance(q, list) or len(q) != L or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNT for x in q
        ):
            raise PayloadError(f"field 'q' must list one maximum count in [0, {MAX_COUNT}] per layer")
        if bits > 16:
            raise PayloadError("log encoding uses at most 16 bits")
        levels = (1 << bits) - 1
        codes = _unpack(raw, size, bits).reshape(L, E)
        if codes.size and codes.max() > levels:
            raise PayloadError("log code out of range")
        scale = np.log1p(np.asarray(q, dtype=np.float64))[:, None] / levels
        flat = np.expm1(codes * scale).astype(np.float32).reshape(-1)
        exact = False
    else:
        raise PayloadError(f"unknown encoding {enc!r} (expected dense, sparse or log)")
    counts = flat.reshape(L, E)
    if not np.all(np.isfinite(counts)):
        raise PayloadError("decoded counts are not finite")
    return DecodedSignature(
        counts=counts, layers=tuple(layers), num_tokens=n, exact=exact, data_bytes=len(d)
    )


def to_layout(sig: DecodedSignature, num_layers: int, num_experts: int) -> np.ndarray:
    """Counts in the centroid file's layout: [num_layers, E].

    The centroid file holds either only the MoE layers (num_layers == len(sig.layers): rows
    are taken in order) or every hidden layer (dense rows stay zero and carry weight 0).
    """
    if sig.counts.shape[1] != num_experts:
        raise PayloadError(f"payload has {sig.counts.shape[1]} experts per layer, the centroids {num_experts}")
    if num_layers == len(sig.layers):
        return sig.counts
    if max(sig.layers) < num_layers:
        out = np.zeros((num_layers, num_experts), dtype=np.float32)
        out[list(sig.layers)] = sig.counts
        return out
    raise PayloadError(
        f"payload covers {len(sig.layers)} layers (max id {max(sig.layers)}), "
        f"the centroids {num_layers}: cannot align them"
    )


def worst_case_bits(num_layers: int, num_experts: int, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Bits per count the log encoding can afford for this shape within max_bytes."""
    overhead = 64 + 12 * num_layers  # header, layer ids and per-layer maxima
    usable = (max_bytes - overhead) * 3 // 4
    return max(0, min(15, int(math.floor(usable * 8 / (num_layers * num_experts)))))
