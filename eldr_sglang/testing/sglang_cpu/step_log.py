"""Test-only decode-side capture: the distinct experts each MoE layer's batch touched, per forward.

The CPU shim's second patch calls `record` at the end of SGLang's `moe_forward_native`
(layers/moe/fused_moe_native.py: one F.linear pair per expert that has tokens), so each line is
exact: what the engine itself computed, not an estimate. It is on only in servers started with
ELDR_TEST_STEP_LOG=<path>; one line per MoE layer call, appended line-buffered:

    <perf_counter start> <layer id> <tokens> <distinct experts> <duration us>

`read_steps` groups the lines of a decode server into steps (a run of consecutive layers).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "ELDR_TEST_STEP_LOG"
_path = os.environ.get(ENV)
_fh = open(_path, "a", buffering=1) if _path else None  # noqa: SIM115 - lives as long as the server


def record(layer_id: int, tokens: int, tokens_per_expert, t0: float) -> None:
    if _fh is None:
        return
    dt = time.perf_counter() - t0
    _fh.write(f"{t0:.6f} {layer_id} {tokens} {int((tokens_per_expert > 0).sum())} {dt * 1e6:.0f}\n")


@dataclass(frozen=True)
class Step:
    t0: float  # perf_counter at the first MoE layer's start
    tokens: int  # rows in the batch (a decode step: its running requests)
    distinct: tuple[int, ...]  # distinct experts per MoE layer, in layer order
    moe_s: float  # time inside moe_forward_native, all layers


def read_steps(path: Path, layers: int) -> list[Step]:
    """The complete forwards in a step log (a torn last line or partial forward is dropped)."""
    steps, cur = [], []
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) != 5:
            continue
        t0, layer, tokens, distinct, us = float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), float(parts[4])
        if cur and (layer <= cur[-1][1] or tokens != cur[-1][2]):
            cur = []  # a new forward began before this one completed
        cur.append((t0, layer, tokens, distinct, us))
        if len(cur) == layers:
            steps.append(Step(cur[0][0], tokens, tuple(c[3] for c in cur), sum(c[4] for c in cur) * 1e-6))
            cur = []
    return steps
