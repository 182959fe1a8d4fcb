"""The device-side expert-count accumulator (torch on CPU): exact counts per request."""

from __future__ import annotations

import os

import numpy as np
import pytest

if os.environ.get("ELDR_REQUIRE_SGLANG") == "1":
    import torch  # noqa: F401  (fail, not skip, where torch is required)
torch = pytest.importorskip("torch")

from eldr_sglang.sglang_ext.accumulator import CountsAccumulator  # noqa: E402
from eldr_sglang.sglang_ext.runtime import moe_layer_ids  # noqa: E402

E, K = 8, 2
HIDDEN, MOE = 5, [1, 2, 4]  # layers 0 and 3 are dense


def _acc(**kw):
    args = dict(num_hidden_layers=HIDDEN, moe_layers=MOE, num_experts=E, top_k=K, max_slots=6, max_tokens=64)
    args.update(kw)
    return CountsAccumulator(**args)


class Oracle:
    """Counts by hand: per slot, per MoE layer row, how many tokens chose each expert."""

    def __init__(self):
        self.c = {}

    def add(self, slot, layer, ids):
        if layer not in MOE:
            return
        row = self.c.setdefault(slot, np.zeros((len(MOE), E), np.int64))[MOE.index(layer)]
        for e in ids.reshape(-1):
            if 0 <= e < E:
                row[e] += 1


def _forward(acc, oracle, rng, slots, lens, gens, pad=0, pad_value=-1):
    acc.begin_forward(slots, lens, gens)
    n = sum(lens)
    for layer in range(HIDDEN):
        ids = np.argsort(rng.random((n, E)), axis=1)[:, :K]
        if pad:
            ids = np.concatenate([ids, np.full((pad, K), pad_value)])
        start = 0
        for s, ln in zip(slots, lens):
            oracle.add(s, layer, ids[start : start + ln])
            start += ln
        acc.capture(layer, torch.tensor(ids, dtype=torch.int32))


def test_counts_are_exact_across_chunks_with_padding_and_dense_layers():
    rng = np.random.default_rng(0)
    acc, oracle = _acc(), Oracle()
    # forward 1: request A (slot 2) first chunk of 3 tokens, request B (slot 5) 4 tokens, 3 pad rows
    _forward(acc, oracle, rng, [2, 5], [3, 4], [1, 1], pad=3)
    # forward 2: request A's second chunk; pad rows carry an out-of-range (shared-expert) id
    _forward(acc, oracle, rng, [2], [2], [1], pad=2, pad_value=E)
    counts, valid, tokens = acc.take([2, 5])
    assert valid == [True, True] and tokens == [5, 4]
    np.testing.assert_array_equal(counts[0], oracle.c[2])
    np.testing.assert_array_equal(counts[1], oracle.c[5])
    assert counts.sum() == (5 + 4) * K * len(MOE)


def test_reused_slot_starts_from_zero():
    rng = np.random.default_rng(1)
    acc, oracle = _acc(), Oracle()
    _forward(acc, oracle, rng, [3], [4], [7])
    # the slot goes to another request (new pool generation) without a take()
    fresh = Oracle()
    _forward(acc, fresh, rng, [3], [2], [8])
    counts, valid, tokens = acc.take([3])
    np.testing.assert_array_equal(counts[0], fresh.c[3])
    assert tokens == [2] and valid == [True]


def test_rows_that_do_not_match_tokens_invalidate_instead_of_guessing():
    acc = _acc()
    acc.begin_forward([1, 4], [5, 5], [1, 1])
    acc.capture(1, torch.zeros((6, K), dtype=torch.int32))  # 6 rows for 10 tokens
    _, valid, _ = acc.take([1, 4])
    assert valid == [False, False]


def test_forward_larger_than_buffer_invalidates():
    acc = _acc(max_tokens=8)
    acc.begin_forward([1], [9], [1])
    acc.capture(1, torch.zeros((9, K), dtype=torch.int32))
    counts, valid, _ = acc.take([1])
    assert valid == [False] and counts.sum() == 0


def test_decode_forward_captures_nothing():
    acc = _acc()
    acc.begin_forward([1], [2], [1])
    acc.deactivate()
    acc.capture(1, torch.zeros((2, K), dtype=torch.int32))
    counts, _, _ = acc.take([1])
    assert counts.sum() == 0


def test_moe_layer_ids_from_hf_configs():
    class C:
        pass

    ds = C()
    ds.num_hidden_layers, ds.first_k_dense_replace, ds.moe_layer_freq = 61, 3, 1
    assert moe_layer_ids(ds) == list(range(3, 61))
    qw = C()
    qw.num_hidden_layers, qw.decoder_sparse_step, qw.mlp_only_layers = 6, 1, [0, 5]
    assert moe_layer_ids(qw) == [1, 2, 3, 4]
    mx = C()
    mx.num_hidden_layers = 4
    assert moe_layer_ids(mx) == [0, 1, 2, 3]


def test_dp_attention_row_start_is_read_at_first_capture_and_a_failed_read_refuses():
    # gathered rows of 3 DP ranks: this rank's 4 tokens sit at rows 6..9 once SGLang padded them
    rng = np.random.default_rng(3)
    acc, oracle = _acc(max_rows=64), Oracle()
    start = {"row": None}
    acc.begin_forward([4], [4], [1], row_start=lambda: start["row"])
    start["row"] = 6  # known only after begin_forward, as under DP attention
    for layer in range(HIDDEN):
        ids = np.argsort(rng.random((13, E)), axis=1)[:, :K]  # every row a valid id: padding must not count
        oracle.add(4, layer, ids[6:10])
        acc.capture(layer, torch.tensor(ids, dtype=torch.int32))
    counts, valid, tokens = acc.take([4])
    assert valid == [True] and tokens == [4]
    np.testing.assert_array_equal(counts[0], oracle.c[4])

    def broken():
        raise ValueError("no global_num_tokens_cpu")

    acc.begin_forward([5], [2], [1], row_start=broken)
    acc.capture(1, torch.zeros((4, K), dtype=torch.int32))
    assert acc.take([5])[1] == [False]
    # rows that end before this rank's tokens do: refused, not guessed
    acc.begin_forward([2], [3], [1], row_start=lambda: 5)
    acc.capture(1, torch.zeros((6, K), dtype=torch.int32))
    assert acc.take([2])[1] == [False]
