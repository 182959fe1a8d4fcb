"""Reading SGLang's routed experts (meta_info / sglext, base64 int32 [rows, hidden, k])."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from eldr_sglang.traces.sglang_responses import (
    ModelSpec,
    RoutedExpertsError,
    decode_routed_experts,
    read_bench_serving_output,
    read_responses_jsonl,
    read_sglang,
    response_routing,
)
from eldr_sglang.testing.payloads import encode_routed_experts
from eldr_sglang.traces import load_trace, save_trace

from _fake_sglang import routing_for

SPEC = ModelSpec.from_args(6, 2, 8, first_k_dense_replace=2, model="fake/moe")


def _resp(text: str, completion: int, arr=None) -> dict:
    arr = routing_for(text, completion) if arr is None else arr
    return {"text": "...", "meta_info": {"id": "r", "prompt_tokens": len(text.split()),
                                         "completion_tokens": completion,
                                         "routed_experts": encode_routed_experts(arr)}}


def test_decode_roundtrip_and_shape():
    arr = routing_for("a b c", 4)
    out = decode_routed_experts(encode_routed_experts(arr), 6, 2)
    assert out.shape == (6, 6, 2) and out.dtype == np.int32
    np.testing.assert_array_equal(out, arr)


def test_response_masks_dense_layers_and_splits_prefill():
    rr = response_routing(_resp("one two three four five", 3), SPEC)
    arr = routing_for("one two three four five", 3)
    assert rr.prefill_len == 5  # 5 prompt rows, then 3 - 1 decode rows
    assert rr.ids.shape == (7, 4, 2)
    np.testing.assert_array_equal(rr.ids, arr[:, 2:, :])


def test_inferred_moe_layers_match_declared():
    inferred = ModelSpec(6, 2, 8)  # no layer list: all-zero layers are the dense ones
    a = response_routing(_resp("x y z", 5), inferred)
    b = response_routing(_resp("x y z", 5), SPEC)
    np.testing.assert_array_equal(a.ids, b.ids)


def test_moe_layer_list_equals_first_k_dense():
    spec = ModelSpec.from_args(6, 2, 8, moe_layers=[2, 3, 4, 5])
    np.testing.assert_array_equal(response_routing(_resp("p q", 4), spec).ids,
                                  response_routing(_resp("p q", 4), SPEC).ids)


@pytest.mark.parametrize("value, match", [
    ("not base64 !!", "not valid base64"),
    (base64.b64encode(b"\x00" * 6).decode(), "whole number of int32"),
    (base64.b64encode(np.zeros(5, np.int32).tobytes()).decode(), "not divisible"),
    (12, "base64 string"),
])
def test_bad_payloads(value, match):
    resp = _resp("a b", 2)
    resp["meta_info"]["routed_experts"] = value
    with pytest.raises(RoutedExpertsError, match=match):
        response_routing(resp, SPEC)


def test_ids_out_of_range():
    arr = routing_for("a b c", 2)
    arr[1, 3, 0] = 8
    with pytest.raises(RoutedExpertsError, match="out of range"):
        response_routing(_resp("a b c", 2, arr), SPEC)


def test_negative_ids():
    arr = routing_for("a b c", 2)
    arr[0, 4, 1] = -1
    with pytest.raises(RoutedExpertsError, match="out of range"):
        response_routing(_resp("a b c", 2, arr), SPEC)


def test_dense_layer_with_ids_is_an_error():
    arr = routing_for("a b c", 2)
    arr[0, 1, :] = [3, 4]
    with pytest.raises(RoutedExpertsError, match="hidden layer 1 is declared dense"):
        response_routing(_resp("a b c", 2, arr), SPEC)


def test_zero_moe_layer_is_caught():
    spec = ModelSpec.from_args(6, 2, 8, first_k_dense_replace=1)  # claims layer 1 is MoE
    with pytest.raises(RoutedExpertsError, match="hidden layer 1 repeats an expert"):
        response_routing(_resp("a b c", 2), spec)


def test_row_count_mismatch():
    resp = _resp("a b c", 4)
    resp["meta_info"]["completion_tokens"] = 9
    with pytest.raises(RoutedExpertsError, match="rows but prompt_tokens"):
        response_routing(resp, SPEC)


def test_missing_routed_experts_names_the_flag():
    resp = _resp("a b", 2)
    del resp["meta_info"]["routed_experts"]
    with pytest.raises(RoutedExpertsError, match="--enable-return-routed-experts"):
        response_routing(resp, SPEC)


def test_openai_format():
    arr = routing_for("hello there", 3)
    resp = {"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 2, "completion_tokens": 3},
            "sglext": {"routed_experts": encode_routed_experts(arr)}}
    rr = response_routing(resp, SPEC)
    assert rr.prefill_len == 2
    np.testing.assert_array_equal(rr.ids, arr[:, 2:, :])


def test_jsonl_responses_to_trace_roundtrip(tmp_path):
    texts = ["alpha beta gamma", "delta", "epsilon zeta eta theta"]
    lines = []
    for i, t in enumerate(texts):
        r = _resp(t, 3 + i)
        r["domain"] = f"d{i % 2}"
        lines.append(json.dumps(r))
    lines.append(json.dumps([_resp("batched one", 2), _resp("batched two two", 2)]))  # batched /generate
    path = tmp_path / "resp.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    tr = read_responses_jsonl(path, SPEC)
    assert tr.num_requests == 5
    assert tr.num_layers == 4 and tr.top_k == 2 and tr.num_experts == 8
    assert tr.prefill_len.tolist() == [3, 1, 4, 2, 3]
    np.testing.assert_array_equal(tr.decode_ids(2), routing_for(texts[2], 5)[4:, 2:, :])
    assert list(tr.domain[:3]) == ["d0", "d1", "d0"]
    out = tmp_path / "t.npz"
    save_trace(tr, out)
    back = load_trace(out)
    np.testing.assert_array_equal(back.expert_ids, tr.expert_ids)
    assert read_sglang(path, SPEC).num_requests == 5


def test_jsonl_bad_line_is_named(tmp_path):
    path = tmp_path / "resp.jsonl"
    path.write_text(json.dumps(_resp("a b", 2)) + "\n{oops\n")
    with pytest.raises(RoutedExpertsError, match=r"resp.jsonl:2: not valid JSON"):
        read_responses_jsonl(path, SPEC)


def _bench_record(details=True):
    rec = {"backend": "sglang", "dataset_name": "random", "completed": 2, "mean_tpot_ms": 10.0}
    if details:
        rec.update({"input_lens": [2, 3], "output_lens": [4, 2], "ttfts": [0.1, 0.1], "itls": [[], []],
                    "generated_texts": ["", ""], "errors": ["", ""]})
    return rec


def test_stock_bench_serving_output_explains_missing_experts(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(_bench_record()) + "\n")
    with pytest.raises(RoutedExpertsError, match="does not store the answers"):
        read_bench_serving_output(path, SPEC)
    path.write_text(json.dumps(_bench_record(details=False)) + "\n")
    with pytest.raises(RoutedExpertsError, match="without --output-details"):
        read_sglang(path, SPEC)


def test_bench_serving_output_with_routed_experts(tmp_path):
    rec = _bench_record()
    rec["routed_experts"] = [encode_routed_experts(routing_for("a b", 4)), None]
    rec["errors"] = ["", "timeout"]
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(_bench_record()) + "\n" + json.dumps(rec) + "\n")  # the last run is read
    tr = read_bench_serving_output(path, SPEC)
    assert tr.num_requests == 1 and tr.prefill_len.tolist() == [2]
    np.testing.assert_array_equal(tr.expert_ids, routing_for("a b", 4)[:, 2:, :])


def test_spec_validation():
    with pytest.raises(RoutedExpertsError, match="first_k_dense_replace"):
        ModelSpec.from_args(4, 2, 8, first_k_dense_replace=4)
    with pytest.raises(RoutedExpertsError, match="top_k"):
        ModelSpec.from_args(4, 9, 8)
    with pytest.raises(RoutedExpertsError, match="moe_layers"):
        ModelSpec.from_args(4, 2, 8, moe_layers=[1, 7])
    ds = ModelSpec.preset("deepseek-v3")
    assert ds.num_hidden_layers == 61 and ds.moe_layers == list(range(3, 61)) and ds.top_k == 8
