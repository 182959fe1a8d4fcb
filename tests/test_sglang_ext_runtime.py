"""The glue the patched SGLang calls: emission into customized_info, OpenAI events."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from eldr_sglang.sglang_ext import runtime
from eldr_sglang.sglang_ext.payload import META_KEY, decode_payload


def test_openai_event_once_per_choice():
    seen: set = set()
    sig = {"v": 1, "layers": [0], "E": 2, "n": 1, "enc": "dense", "bits": 1, "d": "AQ=="}
    content = {"index": 0, "meta_info": {"id": "r1", META_KEY: [sig]}}
    ev = runtime.openai_chunk(content, seen)
    assert ev.startswith("data: ") and ev.endswith("\n\n")
    body = json.loads(ev[6:])
    assert body["sglext"][META_KEY] == sig and body["choices"] == [] and body["id"] == "r1"
    assert runtime.openai_chunk(content, seen) is None  # later chunks re-report it: sent once
    assert runtime.openai_chunk({"index": 0, "meta_info": {}}, set()) is None


class _FakeAcc:
    moe_layers = [1, 2]
    num_experts = 4

    def __init__(self, valid):
        self.valid = valid

    def take(self, slots):
        c = np.arange(len(slots) * 8, dtype=np.uint32).reshape(len(slots), 2, 4)
        return c, [self.valid] * len(slots), [3] * len(slots)


@pytest.mark.parametrize("valid", [True, False])
def test_emit_attaches_payload_to_first_token_and_streams_only_streamed(monkeypatch, valid):
    monkeypatch.setattr(runtime, "ACCUMULATOR", _FakeAcc(valid))
    calls = []
    sched = types.SimpleNamespace(output_streamer=types.SimpleNamespace(stream_output=lambda reqs, lp: calls.append((reqs, lp))))
    reqs = [
        types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=3), customized_info=None, output_ids=[7], stream=True),
        types.SimpleNamespace(req_pool_idx=4, kv=None, customized_info={"other": [1]}, output_ids=[9], stream=False),
    ]
    runtime.emit(sched, reqs)
    for r in reqs:
        vals = r.customized_info[META_KEY]
        assert len(vals) == len(r.output_ids) == 1  # token-aligned: rides the first output token
        if valid:
            d = decode_payload(vals[0])
            assert d.layers == (1, 2) and d.exact and d.num_tokens == 3
        else:
            assert vals[0] == {"v": 1, "none": "unattributed_rows"}
    assert reqs[1].customized_info["other"] == [1]
    assert len(calls) == 1 and calls[0][0] == [reqs[0]] and calls[0][1] is False


def test_emit_is_off_without_accumulator(monkeypatch):
    monkeypatch.setattr(runtime, "ACCUMULATOR", None)
    req = types.SimpleNamespace(customized_info=None)
    runtime.emit(None, [req])
    assert req.customized_info is None


def test_dp_attention_deepep_layout_refusal_names_the_flag_and_status_merges():
    from eldr_sglang.sglang_ext.runtime import layout_refusal, merge_status

    base = {"enable_eldr_signature": True, "disaggregation_mode": "prefill", "pp_size": 1, "attn_cp_size": 1}
    # DP attention and DeepEP are attributable: nothing to refuse
    assert layout_refusal(dict(base, attn_dp_size=32, moe_a2a_backend="deepep", deepep_mode="normal")) is None
    assert layout_refusal(dict(base, enable_eldr_signature=False)) == "--enable-eldr-signature not set"
    assert layout_refusal(dict(base, disaggregation_mode="decode")).startswith("--disaggregation-mode decode")
    assert layout_refusal(dict(base, pp_size=2)).startswith("--pp-size 2")
    assert layout_refusal(dict(base, attn_cp_size=4)).startswith("--attn-cp-size 4")
    assert layout_refusal(dict(base, enable_two_batch_overlap=True)).startswith("--enable-two-batch-overlap")
    # the DP controller's merge: "on" only if every scheduler is on
    assert merge_status(["on", "on"]) == "on"
    assert merge_status(["on", "off (--pp-size 2: x)"]) == "off (--pp-size 2: x)"
    assert merge_status([None]).startswith("off (")


def test_dp_attention_deepep_router_reads_off_reason_from_server_info():
    from eldr_sglang.router.loads import prefill_signature_state

    assert prefill_signature_state({"eldr_signature": "on", "enable_eldr_signature": True}) == (True, None)
    assert prefill_signature_state({"eldr_signature": "off (--pp-size 2: stages)", "enable_eldr_signature": True}) == (
        False, "--pp-size 2: stages")
    assert prefill_signature_state({"enable_eldr_signature": True}) == (True, None)  # an older series
    signs, reason = prefill_signature_state({})
    assert not signs and "unpatched" in reason
