"""Per-request expert counts, accumulated on the device during prefill (torch).

The MoE layers already produce each token's top-k expert ids. `capture(layer, topk_ids)`
adds them into a device tensor `counts[slot, moe_layer, expert]` with one accumulating
`index_put_`, where `slot` is the request's row in SGLang's ReqToTokenPool (stable across
chunked-prefill chunks). Nothing is read back per token: the host reads one [L, E] row per request when its
prefill completes (`take`).

- Dense layers never call the capture hook in SGLang; a layer id outside `moe_layers` is
  ignored here as well, so they are masked twice.
- A slot's counts are zeroed the first time a forward sees it under a new pool generation
  (`ReqToTokenPool.req_generation` grows on every allocation), so a reused slot never
  carries counts of a request that was aborted or re-queued.
- All buffers have fixed addresses and the per-forward state is written outside the model
  call, so the capture is safe inside CUDA-graph capture and replay. Rows past the forward's
  real tokens (padding) map to a trash slot; ids outside [0, E) (padding -1, fused shared
  experts) go to a trash column.
- Under DP attention the MoE layers see the rows of every DP rank, gathered; this rank's
  tokens start at `row_start` among them. `begin_forward` takes it as a number, or as a
  callable that the first capture of the forward calls (SGLang pads the gathered layout
  inside the forward, after `begin_forward`). A forward whose deferred start was never read
  in Python (a CUDA-graph replay) cannot be attributed: its requests are marked invalid.
  The layout itself (which rows, how they are gathered) is SGLang's: see `runtime`.
- If a forward's top-k rows cannot be matched to its tokens (fewer rows than tokens, e.g. a
  two-batch-overlap micro-batch, or more tokens than the buffer holds), the affected requests
  are marked invalid: their payload says so and the router falls back, never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass
class _SlotState:
    generation: int = -1
    tokens: int = 0
    valid: bool = True


class CountsAccumulator:
    def __init__(
        self,
        *,
        num_hidden_layers: int,
        moe_layers: list[int],
        num_experts: int,
        top_k: int,
        max_slots: int,
        max_tokens: int,
        max_rows: int | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        """max_tokens: this rank's tokens in one forward; max_rows: the rows a MoE layer may
        see in one forward (under DP attention, the gathered rows of all DP ranks)."""
        if not moe_layers:
            raise ValueError("a signature needs at least one MoE layer")
        if any(not 0 <= l < num_hidden_layers for l in moe_layers):
            raise ValueError(f"MoE layer ids must lie in [0, {num_hidden_layers})")
        self.moe_layers = list(moe_layers)
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.max_slots = int(max_slots)
        self.max_tokens = int(max_tokens)
        self.max_rows = max(int(max_rows or 0), self.max_tokens)
        self.device = torch.device(device)
        self._row = [-1] * num_hidden_layers
        for i, layer in enumerate(self.moe_layers):
            self._row[layer] = i
        L, E = len(self.moe_layers), self.num_experts
        self.trash_slot = self.max_slots
        # [slots + trash, L, E + trash column]
        self.counts = torch.zeros((self.max_slots + 1, L, E + 1), dtype=torch.int32, device=self.device)
        self._flat = self.counts.view(-1)
        self._token_slot = torch.full((self.max_rows,), self.trash_slot, dtype=torch.int64, device=self.device)
        self._ones = torch.ones(self.max_rows * max(self.top_k, 1) * 2, dtype=torch.int32, device=self.device)
        self._slots: list[_SlotState] = [_SlotState() for _ in range(self.max_slots)]
        self._active = False
        self._n_real = 0
        self._rows_end = 0  # first row past this rank's tokens in the current forward
        self._batch_slots: list[int] = []
        # a forward whose row start is read at its first capture: (start callable, slots, lens)
        self._deferred: tuple[Callable[[], int], torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ per forward
    def deactivate(self) -> None:
        """The next forward is not a prefill: capture nothing (graph replays hit the trash slot)."""
        self._settle()
        if self._active or self._n_real:
            self._token_slot.fill_(self.trash_slot)
        self._active = False
        self._n_real = 0
        self._rows_end = 0

    def refuse_forward(self) -> None:
        """This forward's rows cannot be attributed: its requests' payloads say so."""
        for s in self._batch_slots:
            self._slots[s].valid = False
        self._active = False
        self._deferred = None

    def _settle(self) -> None:
        """The previous forward deferred its row start and no capture ever read it: its
        layers ran where Python does not (a CUDA graph), so its rows went to the trash."""
        if self._deferred is not None:
            self.refuse_forward()

    def begin_forward(
        self,
        slots: list[int],
        lens: list[int],
        generations: list[int],
        slots_dev: torch.Tensor | None = None,
        lens_dev: torch.Tensor | None = None,
        row_start: int | Callable[[], int] = 0,
    ) -> None:
        """Map this forward's token rows to request slots: request r owns the next lens[r] rows,
        from row `row_start` on (a callable: read at the forward's first capture)."""
        if len(slots) != len(lens) or len(slots) != len(generations):
            raise ValueError("slots, lens and generations must have one entry per request")
        self._settle()
        n_real = int(sum(lens))
        fresh: list[int] = []
        for s, g in zip(slots, generations):
            if not 0 <= s < self.max_slots:
                raise ValueError(f"slot {s} outside [0, {self.max_slots})")
            st = self._slots[s]
            if st.generation != g:
                st.generation, st.tokens, st.valid = g, 0, True
                fresh.append(s)
        if fresh:
            self.counts[torch.tensor(fresh, dtype=torch.int64, device=self.device)] = 0
        self._batch_slots = list(slots)
        if n_real > self.max_tokens:
            for s in slots:
                self._slots[s].valid = False
            self._active = False
            return
        for s, n in zip(slots, lens):
            self._slots[s].tokens += int(n)
        if slots_dev is None or lens_dev is None:
            slots_dev = torch.tensor(slots, dtype=torch.int64, device=self.device)
            lens_dev = torch.tensor(lens, dtype=torch.int64, device=self.device)
        self._token_slot.fill_(self.trash_slot)
        self._n_real = n_real
        self._active = True
        if callable(row_start):
            self._rows_end = n_real  # a lower bound until the start is known
            self._deferred = (row_start, slots_dev, lens_dev)
        else:
            self._place(int(row_start), slots_dev, lens_dev)

    def _place(self, start: int, slots_dev: torch.Tensor, lens_dev: torch.Tensor) -> None:
        n_real = self._n_real
        if start < 0 or start + n_real > self.max_rows:
            self.refuse_forward()
            return
        if n_real:
            self._token_slot[start : start + n_real] = torch.repeat_interleave(
                slots_dev.to(torch.int64), lens_dev.to(torch.int64), output_size=n_real
            )
        self._rows_end = start + n_real

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Add one MoE layer's top-k ids [N, k] of the current forward (N >= real tokens)."""
        if layer_id is None or not 0 <= layer_id < len(self._row):
            return
        row = self._row[layer_id]
        if row < 0:  # dense layer: masked
            return
        n, k = int(topk_ids.shape[0]), int(topk_ids.shape[1])
        # While a CUDA graph is captured, record unconditionally: the replay reads whatever
        # begin_forward/deactivate left in the token->slot map.
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing and not self._active:
            return
        if not capturing and self._deferred is not None:
            start_of, slots_dev, lens_dev = self._deferred
            self._deferred = None
            try:
                start = int(start_of())
            except Exception:  # the layout could not be read: never take the forward down
                self.refuse_forward()
                return
            self._place(start, slots_dev, lens_dev)
            if not self._active:
                return
        if n > self.max_rows or n * k > self._ones.numel() or (not capturing and n < self._rows_end):
            # rows do not line up with this forward's tokens: refuse to guess
            self.refuse_forward()
            return
        L, E1 = len(self.moe_layers), self.num_experts + 1
        ids = topk_ids.to(torch.int64)
        ids = torch.where((ids >= 0) & (ids < self.num_experts), ids, self.num_experts)
        base = (self._token_slot[:n] * L + row) * E1
        # index_put_(accumulate=True) has a deterministic kernel, so this also runs under
        # torch.use_deterministic_algorithms (integer sums are exact either way).
        self._flat.index_put_(((base[:, None] + ids).reshape(-1),), self._ones[: n * k], accumulate=True)

    # ------------------------------------------------------------------ readout
    def take(self, slots: list[int]) -> tuple[np.ndarray, list[bool], list[int]]:
        """Counts [R, L, E] (uint32, host) of finished requests, their validity and token counts.

        One device-to-host copy for all of them. The slots keep their counts until the pool
        hands them to another request (new generation)."""
        self._settle()
        if not slots:
            return np.zeros((0, len(self.moe_layers), self.num_experts), np.uint32), [], []
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        rows = self.counts.index_select(0, idx)[:, :, : self.num_experts].cpu().numpy().astype(np.uint32)
        valid = [self._slots[s].valid for s in slots]
        tokens = [self._slots[s].tokens for s in slots]
        return rows, valid, tokens
