"""The emulated decode worker's measured expert occupancy (`--occupancy-source steps`; the
answer's shape: eldr_sglang/router/occupancy.py): per MoE layer and expert, a moving average
over the last `window_steps` decode steps of "no request of the batch selected this expert".
The default source, the requests' profiles, is eldr_sglang/sglang_ext/profile_occupancy.py."""

from __future__ import annotations

import numpy as np

from eldr_sglang.router.occupancy import VERSION

WINDOW_STEPS = 32


class Occupancy:
    def __init__(self, num_layers: int, num_experts: int, window_steps: int = WINDOW_STEPS):
        self.num_layers, self.num_experts, self.window_steps = num_layers, num_experts, window_steps
        self.idle = np.ones((num_layers, num_experts), dtype=np.float64)
        self._used = np.zeros((num_layers, num_experts), dtype=bool)
        self._rows = None

    def step(self, ids: np.ndarray) -> None:
        """One decode step's top-k ids, [B, L, k]."""
        if self._rows is None or self._rows.shape != ids.shape:
            self._rows = np.broadcast_to(np.arange(self.num_layers)[None, :, None], ids.shape)
        self._used[:] = False
        self._used[self._rows.ravel(), ids.ravel()] = True
        a = 1.0 / self.window_steps
        self.idle *= 1.0 - a
        self.idle += a * ~self._used

    def report(self, layers_param: str, running: int) -> dict:
        """The /v1/loads field for `eldr_layers=<layers_param>` (empty: every layer)."""
        try:
            layers = [int(x) for x in layers_param.split(",")] if layers_param.strip() else list(range(self.num_layers))
        except ValueError:
            return {"eldr_occupancy_error": f"eldr_layers {layers_param[:80]!r} is not a comma-separated list of layer ids"}
        bad = [x for x in layers if not 0 <= x < self.num_layers]
        if bad:
            return {"eldr_occupancy_error": f"layer {bad[0]} is not a MoE layer (0..{self.num_layers - 1})"}
        idle = np.ones((len(layers), self.num_experts)) if running == 0 else self.idle[layers]
        return {"eldr_occupancy": {"version": VERSION, "source": "steps", "experts": self.num_experts, "layers": layers,
                                   "window_steps": self.window_steps, "running": running,
                                   "idle": np.round(idle, 4).tolist()}}
