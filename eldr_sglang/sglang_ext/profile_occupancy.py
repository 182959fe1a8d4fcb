"""A decode server's expert occupancy from its running requests' profiles (issue 32).

The router sends each request's expert profile with it (`eldr_profile`: its MoE layers, the
experts per layer, the cells and each cell's `log(1 - p)` in units of 2^-24; the core's
`ExpertProfile::to_wire_json`). The server adds a request's cells to its sums when it arrives
and takes them away when it ends, so the sums are exactly what every router replica's own
expert state holds for its requests here, all replicas together. Its `/v1/loads` answers
`eldr_layers=...` with `exp(sum)`, each cell's idle share: the shape in
eldr_sglang/router/occupancy.py, `"source": "signatures"`. No work per decode step.

The emulated decode worker uses this class (its default source). A profile that is malformed or too
large is ignored (counted in `dropped`); the request is served as any other."""

from __future__ import annotations

import itertools

import numpy as np

VERSION = 1
LOG_SCALE = float(1 << 24)  # rust/core/src/policies/locality.rs, LOG_SCALE
MAX_LAYERS, MAX_EXPERTS, MAX_CELLS = 1024, 4096, 1 << 20


def _ints(v, lo: int, hi: int) -> np.ndarray | None:
    """A JSON list of integers in [lo, hi) as int64, or None (vectorized: a profile has
    thousands of cells on DeepSeek-V3)."""
    if not isinstance(v, list):
        return None
    if not v:
        return np.zeros(0, np.int64)
    try:
        a = np.asarray(v)
    except (ValueError, TypeError):
        return None
    if a.ndim != 1 or a.dtype.kind not in "iu":
        return None
    a = a.astype(np.int64, copy=False)
    return a if (a.min() >= lo and a.max() < hi) else None


def parse_profile(p: object) -> tuple[tuple[tuple[int, ...], int], np.ndarray, np.ndarray] | None:
    """((layers, experts), cells, log_keep) of a request's `eldr_profile`, or None when it is
    absent or not one."""
    if not isinstance(p, dict):
        return None
    layers, experts = p.get("layers"), p.get("experts")
    if not (isinstance(layers, list) and 0 < len(layers) <= MAX_LAYERS and type(experts) is int and 0 < experts <= MAX_EXPERTS):
        return None
    lay = _ints(layers, 0, 1 << 20)
    cells = _ints(p.get("cells"), 0, len(layers) * experts)
    keep = _ints(p.get("log_keep"), -(1 << 40), 1)
    if lay is None or cells is None or keep is None or len(cells) != len(keep) or len(cells) > MAX_CELLS:
        return None
    if len(cells) > 1 and not np.all(cells[1:] > cells[:-1]):  # the core writes them ascending, once each
        return None
    return (tuple(int(x) for x in lay), experts), cells, keep


class ProfileOccupancy:
    """Per layout, the sum of the running requests' `log(1 - p)` per cell."""

    def __init__(self):
        self._sums: dict[tuple[tuple[int, ...], int], np.ndarray] = {}
        self._users: dict[tuple[tuple[int, ...], int], int] = {}
        self._held: dict[int, tuple] = {}
        self._ids = itertools.count()
        self.dropped = 0  # profiles that were not one
        self.added = 0  # profiles counted, all told

    def add(self, profile: object) -> int | None:
        """Count a request's profile (None: it carries none or a bad one); returns the token
        `remove` takes when the request ends."""
        if profile is None:
            return None
        parsed = parse_profile(profile)
        if parsed is None:
            self.dropped += 1
            return None
        key, cells, keep = parsed
        sums = self._sums.get(key)
        if sums is None:
            sums = self._sums[key] = np.zeros(len(key[0]) * key[1], dtype=np.int64)
        sums[cells] += keep  # cells are distinct (checked)
        self._users[key] = self._users.get(key, 0) + 1
        self.added += 1
        tok = next(self._ids)
        self._held[tok] = parsed
        return tok

    def remove(self, token: int | None) -> None:
        held = self._held.pop(token, None) if token is not None else None
        if held is None:
            return
        key, cells, keep = held
        self._sums[key][cells] -= keep
        self._users[key] -= 1
        if self._users[key] == 0:  # the layout's last request: exact zeros again, and no leak
            del self._users[key], self._sums[key]

    @property
    def running(self) -> int:
        return len(self._held)

    def report(self, layers_param: str, running: int | None = None) -> dict:
        """The /v1/loads field for `eldr_layers=<layers_param>`: for the running requests'
        layout with exactly these layers, each cell's idle share; `"idle": null` when no
        running request has that layout (nothing of these layers is known to be in use)."""
        try:
            layers = [int(x) for x in layers_param.split(",")]
        except ValueError:
            return {"eldr_occupancy_error": f"eldr_layers {layers_param[:80]!r} is not a comma-separated list of layer ids"}
        key = next((k for k in self._sums if list(k[0]) == layers), None)
        occ = {"version": VERSION, "source": "signatures", "layers": layers,
               "running": self.running if running is None else running, "experts": None, "idle": None}
        if key is not None:
            idle = np.exp(self._sums[key] / LOG_SCALE).reshape(len(layers), key[1])
            occ.update(experts=key[1], idle=np.round(idle, 6).tolist())
        return {"eldr_occupancy": occ}
