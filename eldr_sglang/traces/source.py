"""`TraceSource`: what a trace of either version offers its readers.

A v1 `Trace` holds every token's top-k ids in memory; a v2 `CountsTrace` holds each
request's prompt expert counts (read chunk by chunk from its file) and the decode routing of
the requests that kept it. Both are opened by `open_trace`, closed by `close()` or a `with`
block (a no-op for v1), and say which kind they are by `counts_only`, so a reader picks its
path from the trace's own answer, not from its class.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class TraceSource(Protocol):
    # True: prompts are known by their expert counts only (v2), not token by token (v1)
    counts_only: bool
    meta: dict
    prefill_len: np.ndarray  # int32 [R]
    domain: np.ndarray | None  # evaluation labels, never read by a fit
    arrival_s: np.ndarray | None

    @property
    def num_requests(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    @property
    def model(self) -> str: ...

    def decode_len(self) -> np.ndarray: ...

    def validate(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> "TraceSource": ...

    def __exit__(self, *exc) -> None: ...
