"""Decode expert occupancy (eldr_sglang.sglang_ext.occupancy) without SGLang: the idle EMA
against a plain reference, the report file and the /v1/loads answer."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eldr_sglang.sglang_ext import occupancy as occ  # noqa: E402


def _ema(**kw):
    args = dict(num_hidden_layers=4, moe_layers=[1, 3], num_experts=6, max_rows=16)
    args.update(kw)
    return occ.IdleEMA(**args)


def _reference(steps, L, E, W=occ.WINDOW_STEPS):
    """idle[l][e] <- (1 - 1/W) idle + (1/W) [e unused at l], from 1.0, over (layer -> ids) steps."""
    idle = np.ones((L, E))
    for used in steps:
        for l in range(L):
            unused = np.ones(E)
            unused[[e for e in used[l] if 0 <= e < E]] = 0.0
            idle[l] = (1 - 1 / W) * idle[l] + (1 / W) * unused
    return idle


def test_ema_equals_the_definition_over_decode_steps():
    acc = _ema()
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(40):
        n = int(rng.integers(1, 5))
        used = {}
        acc.begin_step(True, n)
        for row, layer in enumerate([1, 3]):
            ids = rng.integers(0, 6, size=(n, 2))
            used[row] = ids.reshape(-1).tolist()
            acc.capture(layer, torch.tensor(ids))
        steps.append(used)
    want = _reference(steps, 2, 6)
    assert acc.steps == 40
    np.testing.assert_allclose(acc.host_table(), want, atol=1e-5)
    assert acc.host_table().min() < 1.0


def test_prefill_and_idle_forwards_leave_the_table_alone_dense_layers_ignored():
    acc = _ema()
    acc.begin_step(False, 0)  # an extend forward: its top-k ids must not count
    acc.capture(1, torch.tensor([[0, 1], [2, 3]]))
    assert (acc.host_table() == 1.0).all() and acc.steps == 0
    acc.begin_step(True, 1)
    acc.capture(0, torch.tensor([[0, 1]]))  # layer 0 is dense: no row
    acc.capture(2, torch.tensor([[0, 1]]))
    acc.capture(None, torch.tensor([[0, 1]]))
    assert (acc.host_table() == 1.0).all()


def test_padding_rows_and_foreign_ids_count_as_unused():
    acc = _ema(num_experts=4)
    acc.begin_step(True, 2)  # rows 2.. are CUDA-graph padding
    ids = torch.tensor([[0, 0], [1, -1], [2, 3], [3, 3]])  # -1: padding; row 2, 3: padded rows
    acc.capture(1, ids)
    acc.capture(3, torch.tensor([[5, 4], [9, 1]]))  # >= E: fused shared experts, trash
    got = acc.host_table()
    w = 1 / occ.WINDOW_STEPS
    np.testing.assert_allclose(got[0], [1 - w, 1 - w, 1, 1], atol=1e-6)
    np.testing.assert_allclose(got[1], [1, 1 - w, 1, 1], atol=1e-6)


def test_reset_brings_the_table_back_to_one():
    acc = _ema()
    acc.begin_step(True, 1)
    acc.capture(1, torch.tensor([[0, 1]]))
    assert acc.host_table().min() < 1.0
    acc.reset()
    assert (acc.host_table() == 1.0).all()


def test_report_file_round_trip_and_malformed(tmp_path):
    path = str(tmp_path / "snap.shm")
    table = np.array([[0.5, 1.0], [0.25, 0.125]], np.float32)
    occ.write_report(path + occ.FILE_SUFFIX, [3, 7], table, steps=9)
    head, got = occ.read_report(path + occ.FILE_SUFFIX)
    assert head["layers"] == [3, 7] and head["steps"] == 9 and head["experts"] == 2
    np.testing.assert_array_equal(got, table)
    (tmp_path / "bad").write_bytes(b'{"v": 1, "layers": [3], "experts": 4, "off": null}\n' + b"\0" * 5)
    with pytest.raises(ValueError, match="expected 1 x 4"):
        occ.read_report(str(tmp_path / "bad"))


def _loads(*running):
    return [types.SimpleNamespace(num_running_reqs=r) for r in running]


def test_answer_shape_layer_selection_and_rounding(tmp_path):
    path = str(tmp_path / "snap.shm")
    table = np.array([[0.123456, 1.0, 0.5], [0.0, 0.99999, 0.3333333]], np.float32)
    occ.write_report(path + occ.FILE_SUFFIX, [3, 7], table)
    got = occ.answer(_loads(2), "7,3", path, True, 1)
    assert list(got) == ["eldr_occupancy"]
    body = got["eldr_occupancy"]
    assert list(body) == ["version", "experts", "layers", "window_steps", "running", "idle"]
    assert body["version"] == 1 and body["experts"] == 3 and body["layers"] == [7, 3]
    assert body["window_steps"] == 32 and body["running"] == 2
    assert body["idle"] == [[0.0, 1.0, 0.3333], [0.1235, 1.0, 0.5]]
    assert occ.answer(_loads(1), None, path, True, 1)["eldr_occupancy"]["layers"] == [3, 7]  # absent: all


def test_answer_empty_batch_is_all_idle(tmp_path):
    path = str(tmp_path / "snap.shm")
    occ.write_report(path + occ.FILE_SUFFIX, [3], np.array([[0.2, 0.4]], np.float32))
    body = occ.answer(_loads(0), "3", path, True, 1)["eldr_occupancy"]
    assert body["running"] == 0 and body["idle"] == [[1.0, 1.0]]


@pytest.mark.parametrize("layers,flag,dp,why", [
    ("3,5", True, 1, "layer 5 is not a MoE layer of this model (MoE layers: 3,7)"),
    ("3,x", True, 1, "eldr_layers: 'x' is not a layer id"),
    ("3", False, 1, "off (--enable-eldr-occupancy not set)"),
    ("3", True, 2, "several DP ranks: not supported yet"),
])
def test_answer_errors_are_one_line_and_omit_the_field(tmp_path, layers, flag, dp, why):
    path = str(tmp_path / "snap.shm")
    occ.write_report(path + occ.FILE_SUFFIX, [3, 7], np.ones((2, 4), np.float32))
    assert occ.answer(_loads(1), layers, path, flag, dp) == {"eldr_occupancy_error": why}


def test_answer_without_report_or_with_a_refusal(tmp_path):
    path = str(tmp_path / "snap.shm")
    assert "no occupancy report yet" in occ.answer(_loads(1), None, path, True, 1)["eldr_occupancy_error"]
    occ.write_report(path + occ.FILE_SUFFIX, [], None, off="--disaggregation-mode prefill: occupancy is kept by decode servers")
    assert occ.answer(_loads(1), None, path, True, 1) == {
        "eldr_occupancy_error": "off (--disaggregation-mode prefill: occupancy is kept by decode servers)"}


def test_split_include_keeps_todays_sections():
    assert occ.split_include(None) == (None, False)
    assert occ.split_include(["core", "disagg"]) == (["core", "disagg"], False)
    assert occ.split_include(["core", "disagg", "eldr"]) == (["core", "disagg"], True)
    assert occ.split_include(["eldr"]) == (["core"], True)


def test_refusal_names_the_flag():
    assert occ.occupancy_refusal({}) == "--enable-eldr-occupancy not set"
    on = {"enable_eldr_occupancy": True}
    assert occ.occupancy_refusal({**on, "disaggregation_mode": "decode"}) is None
    assert occ.occupancy_refusal({**on, "disaggregation_mode": "null"}) is None
    assert "prefill" in occ.occupancy_refusal({**on, "disaggregation_mode": "prefill"})
    assert occ.occupancy_refusal({**on, "dp_size": 2}).startswith("--dp-size 2")
    assert occ.occupancy_refusal({**on, "enable_two_batch_overlap": True}).startswith("--enable-two-batch-overlap")
    assert occ.occupancy_refusal({**on, "speculative_algorithm": "EAGLE"}).startswith("--speculative-algorithm")


def test_publish_writes_beside_the_snapshot_and_resets_on_empty_batch(tmp_path, monkeypatch):
    acc = _ema()
    monkeypatch.setattr(occ, "OCCUPANCY", acc)
    writer = types.SimpleNamespace(path=str(tmp_path / "snap.shm"))
    acc.begin_step(True, 1)
    acc.capture(1, torch.tensor([[0, 1]]))
    occ.publish(writer, types.SimpleNamespace(num_running_reqs=1))
    head, table = occ.read_report(writer.path + occ.FILE_SUFFIX)
    assert head["layers"] == [1, 3] and table[0, 0] < 1.0 and head["steps"] == 1
    occ.publish(writer, types.SimpleNamespace(num_running_reqs=0))
    _, table = occ.read_report(writer.path + occ.FILE_SUFFIX)
    assert (table == 1.0).all() and (acc.host_table() == 1.0).all()


# ---------------------------------------------------------------- source "signatures"
def _profile(cells, p):
    keep = [round(np.log(1 - x) * (1 << 24)) for x in p]
    return {"layers": [1, 3], "experts": 6, "cells": cells, "log_keep": keep}


def test_signatures_refusal_names_the_flag():
    assert occ.signatures_refusal("decode", 1) is None and occ.signatures_refusal("null", 1) is None
    assert occ.signatures_refusal("prefill", 1) == "--disaggregation-mode prefill: occupancy is kept by decode servers"
    assert occ.signatures_refusal("decode", 2).startswith("--tokenizer-worker-num 2: ")


def test_answer_signatures_layers_errors_and_running(monkeypatch):
    from eldr_sglang.sglang_ext.profile_occupancy import ProfileOccupancy

    monkeypatch.setattr(occ, "PROFILES", ProfileOccupancy())
    loads = [types.SimpleNamespace(num_running_reqs=2), types.SimpleNamespace(num_running_reqs=1)]
    tok = occ.profiles().add(_profile([0, 7], [0.5, 0.2]))
    got = occ.answer_signatures(loads, None, None, [1, 3])["eldr_occupancy"]  # no layers asked: every MoE layer
    assert got["layers"] == [1, 3] and got["running"] == 3 and got["source"] == "signatures"
    assert [[round(v, 4) for v in row] for row in got["idle"]] == [[0.5] + [1.0] * 5, [1.0, 0.8] + [1.0] * 4]
    assert occ.answer_signatures(loads, "3,1", None, [1, 3])["eldr_occupancy"]["idle"] is None  # another layout
    assert occ.answer_signatures(loads, "1,3", None, None)["eldr_occupancy"]["experts"] == 6  # model unknown: as asked
    assert occ.answer_signatures(loads, "0", None, [1, 3])["eldr_occupancy_error"].startswith("layer 0 is not a MoE layer")
    assert "not a comma-separated list" in occ.answer_signatures(loads, "x", None, None)["eldr_occupancy_error"]
    assert occ.answer_signatures(loads, None, None, None)["eldr_occupancy_error"].startswith("eldr_layers: ")
    assert occ.answer_signatures(loads, "1,3", "why", [1, 3]) == {"eldr_occupancy_error": "off (why)"}
    occ.PROFILES.remove(tok)
    assert occ.answer_signatures(loads, "1,3", None, [1, 3])["eldr_occupancy"]["idle"] is None


def test_a_streamed_body_holds_its_profile_until_it_ends_or_closes(monkeypatch):
    import asyncio

    from eldr_sglang.sglang_ext.profile_occupancy import ProfileOccupancy

    monkeypatch.setattr(occ, "PROFILES", ProfileOccupancy())

    async def body():
        for i in range(3):
            yield f"chunk{i}"

    async def main():
        whole = types.SimpleNamespace(body_iterator=body())
        occ.hold_until_sent(whole, occ.profiles().add(_profile([0], [0.5])))
        cut = types.SimpleNamespace(body_iterator=body())
        occ.hold_until_sent(cut, occ.profiles().add(_profile([1], [0.5])))
        plain = types.SimpleNamespace()  # a complete response: released at once
        occ.hold_until_sent(plain, occ.profiles().add(_profile([2], [0.5])))
        held = [occ.PROFILES.running]
        chunks = [c async for c in whole.body_iterator]
        held.append(occ.PROFILES.running)
        await cut.body_iterator.__anext__()
        held.append(occ.PROFILES.running)
        await cut.body_iterator.aclose()  # the client went away after one chunk
        held.append(occ.PROFILES.running)
        return chunks, held

    chunks, held = asyncio.run(main())
    assert chunks == ["chunk0", "chunk1", "chunk2"]
    assert held == [2, 1, 1, 0]
