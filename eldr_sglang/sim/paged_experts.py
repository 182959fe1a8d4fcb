"""SGLang's paged experts (`--enable-paged-experts --paged-experts-num-resident C`), as the
simulator's expert-offload mode models it.

What SGLang 0.5.23 does (sglang/srt/layers/moe/paged_experts/):

- Each MoE layer keeps C of its E routed experts in a C-slot GPU table; every expert lives in a
  pinned host store (store.py `HostExpertStore`). Slots start holding experts 0..C-1
  (residency.py `LRUPolicy.__init__`). Single GPU only: tp, ep, pp and dp must be 1
  (method.py `check_paged_experts_compat`), and C >= the router's top-k.
- A step's distinct experts are ordered resident-first, then the missing ones, each part in
  ascending expert id (`torch.unique` in executor.py `EagerExecutor._run`), and cut into waves
  of at most C (residency.py `plan_waves`). Each wave is placed by the LRU (`LRUPolicy.place`):
  its resident experts move to the most-recent end, then each missing one takes the slot of
  the least recently used expert outside the wave. The wave's GEMMs run, then the next wave.
- A page-in copies every per-expert tensor of that expert (weights, and for quantized formats
  their scales; formats.py `expert_params`) from the host store into the slot, on the compute
  stream before the wave runs (store.py `page_in`, or `gather` for graph-captured steps): the
  copy is not overlapped with compute.
- Decode steps whose routed entries fit the slots (batch x top_k <= C) run a CUDA graph that
  decides and pages on the GPU (executor.py `DeviceExecutor`, kernel `paged_experts_decide`);
  decode CUDA graphs are captured only up to C // top_k requests (method.py
  `_cap_decode_capture_batch_sizes`), so larger batches run eagerly, in waves when needed.

Consequences the model below uses, derived from those rules:

- every touched expert that is not resident at the start of the step is paged in exactly once
  (later waves only hold experts missing at the start, disjoint from the resident set after
  wave 1), so page-ins = distinct - resident hits;
- after the step the recency list is the old one without the touched experts, followed by the
  ordered touched list, cut to its last C: the resident set is the C most recent of those.

The GPU decide kernel evicts the least recently used *step* and breaks ties by lowest slot,
where the host `LRUPolicy` keeps the order within a step; hit and page-in counts differ only
when experts last used in the same step tie for eviction. This module follows `LRUPolicy`.
"""

from __future__ import annotations

import numpy as np


class PagedExperts:
    """One decode worker's C-slot tables, one per MoE layer, with SGLang's LRU and waves.

    `access(touched)` takes the [L, E] mask of experts a step touches and returns
    (page-ins [L], waves [L]); it also counts hits, page-ins and steps for the worker."""

    def __init__(self, num_layers: int, num_experts: int, capacity: int):
        if not 0 < capacity <= num_experts:
            raise ValueError(f"paged experts: C must be in 1..{num_experts} resident experts per layer, got {capacity}")
        self.L, self.E, self.C = num_layers, num_experts, capacity
        self.resident = np.zeros((num_layers, num_experts), dtype=bool)
        self.resident[:, :capacity] = True
        # recency stamp per (layer, expert): larger = more recently used. Slots start holding
        # experts 0..C-1 with expert 0 least recent (LRUPolicy's OrderedDict order).
        self.stamp = np.full((num_layers, num_experts), np.iinfo(np.int64).min, dtype=np.int64)
        self.stamp[:, :capacity] = np.arange(capacity) - capacity
        self.clock = 0
        self._ids = np.arange(num_experts, dtype=np.int64)
        # per-worker counters
        self.steps = 0
        self.touched = 0  # sum over steps and layers of distinct experts
        self.page_ins = 0
        self.selections = 0  # token-expert selections served (batch x top_k x layers)

    def access(self, touched: np.ndarray, selections: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """touched [L, E] bool -> (page-ins per layer, waves per layer); updates the LRU."""
        E, res = self.E, self.resident
        miss = touched & ~res
        loads = miss.sum(axis=1)
        d = touched.sum(axis=1)
        # order inside the step: resident hits (ascending id), then the page-ins (ascending id)
        np.copyto(self.stamp, self.clock * 2 * E + self._ids + E * miss, where=touched)
        self.clock += 1
        res |= touched
        over = np.flatnonzero(loads)
        if over.size:  # keep the C most recent of the residents and the touched
            score = np.where(res[over], self.stamp[over], np.iinfo(np.int64).min)
            kth = np.partition(score, E - self.C, axis=1)[:, E - self.C : E - self.C + 1]
            res[over] = score >= kth
        self.steps += 1
        self.touched += int(d.sum())
        self.page_ins += int(loads.sum())
        self.selections += int(selections)
        waves = np.maximum(1, -(-d // self.C))
        return loads, waves

    def stats(self) -> dict:
        """Hit rate (resident experts over touched experts), page-ins per step (all layers),
        and reuse: token-expert selections served per page-in."""
        return {
            "steps": self.steps,
            "hit_rate": 1.0 - self.page_ins / self.touched if self.touched else float("nan"),
            "page_ins_per_step": self.page_ins / self.steps if self.steps else float("nan"),
            "reuse": self.selections / self.page_ins if self.page_ins else float("nan"),  # none paged in: undefined
            "page_ins": self.page_ins,
            "touched": self.touched,
            "selections": self.selections,
        }
