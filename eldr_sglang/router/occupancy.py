"""A decode worker's expert occupancy report, read beside its load (issue 32).

With several router replicas each one sees only its own requests' experts on a worker. A
worker patched with `--enable-eldr-occupancy` (patches/sglang-0.5.23, 0005) answers
`/v1/loads?include=core,disagg&eldr_layers=3,7,11` with, beside `loads`:

    "eldr_occupancy": {"version": 1, "source": "signatures", "experts": E, "layers": [3, 7, 11],
                       "running": n, "idle": [[E floats], ... one row per layer]}

`idle[i][e]`: the chance that no request of its batch selects expert e at MoE layer
`layers[i]` in a step, the locality balancer's per-cell keep mass `exp(S)` for the whole batch,
every replica's requests included. Two sources (`"source"`):

- `"signatures"` (the default): the product over its running requests of `1 - p` from the
  profiles the routers sent with them (`eldr_profile`; eldr_sglang/sglang_ext/profile_occupancy.py):
  exactly what each replica's own state holds for its requests, summed over replicas, with
  no work per decode step. `"idle": null` (and `"experts": null`): no running request has
  these layers' profile, so nothing is known to be in use.
- `"steps"`: measured, the share of its recent decode steps (a moving average over
  `window_steps`) in which no request selected the expert; all 1.0 with no request running.

The core blends it as loads are blended (`Router.report_occupancy`: the report, minus this router's share at the poll, plus its own
requests since). The layers asked are the ones the balancer tracks (the centroid file's
selection). `eldr_layers` is a separate query parameter because SGLang 0.5.23 answers 500 to
an `include` section it does not know; an unpatched worker ignores it.

A patched worker without the flag answers `"eldr_occupancy_error": "off (...)"`: no report.
Anything else (another version, other layers or experts, values outside [0, 1], a worker that
says it cannot) is dropped with a cause, counted by the caller, and routing goes on from this
router's own view."""

from __future__ import annotations

import math

import numpy as np

VERSION = 1
QUERY_PARAM = "eldr_layers"


class OccupancyDropped(ValueError):
    """An occupancy report that cannot be used; `cause` labels the drop counter."""

    def __init__(self, cause: str, msg: str):
        super().__init__(msg)
        self.cause = cause


def query(layers: list[int] | None) -> str:
    """The /v1/loads query string: the load sections, and the occupancy layers when asked."""
    q = "include=core,disagg"
    if layers:
        q += f"&{QUERY_PARAM}=" + ",".join(str(int(x)) for x in layers)
    return q


def occupancy_from_loads(body: object, layers: list[int], experts: int) -> np.ndarray | None:
    """The report's idle shares as one float64 array, layer-major (`len(layers) * experts`),
    or None when the answer carries none (an unpatched worker, or the flag off). Raises
    OccupancyDropped when the report is there and unusable."""
    if not isinstance(body, dict):
        return None
    occ = body.get("eldr_occupancy")
    if occ is None:
        err = body.get("eldr_occupancy_error")
        if err is not None and not str(err).startswith("off"):  # "off (why)": patched, flag not set
            raise OccupancyDropped("worker_refused", str(err)[:200])
        return None
    if not isinstance(occ, dict):
        raise OccupancyDropped("malformed", "eldr_occupancy is not an object")
    if occ.get("version") != VERSION:
        raise OccupancyDropped("version", f"version {occ.get('version')!r}, this router reads {VERSION}")
    if occ.get("idle") is None and occ.get("layers") == list(layers):
        return np.ones(len(layers) * experts)  # no running request of this layout: nothing in use
    if occ.get("layers") != list(layers) or occ.get("experts") != experts:
        raise OccupancyDropped(
            "other_selection",
            f"layers {str(occ.get('layers'))[:80]} x {occ.get('experts')!r} experts, the balancer tracks {list(layers)} x {experts}")
    idle = occ.get("idle")
    if not isinstance(idle, list) or len(idle) != len(layers):
        raise OccupancyDropped("malformed", f"idle must be {len(layers)} rows")
    out = np.empty(len(layers) * experts, dtype=np.float64)
    for i, row in enumerate(idle):
        if not isinstance(row, list) or len(row) != experts:
            raise OccupancyDropped("malformed", f"idle row {i} must hold {experts} numbers")
        for e, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise OccupancyDropped("malformed", f"idle[{i}][{e}] = {str(v)[:40]} is not a share in [0, 1]")
            out[i * experts + e] = v
    return out
