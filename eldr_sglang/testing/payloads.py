"""Wire payloads that real SGLang produces, built by hand for tests and fake servers."""

from __future__ import annotations

import base64

import numpy as np


def encode_routed_experts(arr: np.ndarray) -> str:
    """The inverse of `eldr_sglang.traces.sglang_responses.decode_routed_experts`: int32 little-endian, base64."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode("ascii")
