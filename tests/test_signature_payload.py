"""The prefill -> router signature payload: exact when it fits, bounded always, strict decoding."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from eldr_sglang.sglang_ext.payload import (
    DEFAULT_MAX_BYTES,
    PayloadError,
    decode_payload,
    encode_counts,
    payload_size,
    to_layout,
)

DSV3_MOE_LAYERS = list(range(3, 61))  # DeepSeek-V3: 61 layers, the first 3 dense
DSV3_E, DSV3_K = 256, 8


def _counts(rng, tokens, L, E, k):
    ids = np.argsort(rng.random((tokens, L, E)), axis=2)[:, :, :k]  # k distinct experts per token
    c = np.zeros((L, E), np.int64)
    for layer in range(L):
        np.add.at(c[layer], ids[:, layer].reshape(-1), 1)
    return c


@pytest.mark.parametrize("tokens", [1, 7, 60])
def test_short_prompts_travel_exactly(tokens):
    rng = np.random.default_rng(tokens)
    c = _counts(rng, tokens, len(DSV3_MOE_LAYERS), DSV3_E, DSV3_K)
    p = encode_counts(c, DSV3_MOE_LAYERS, tokens)
    d = decode_payload(json.loads(json.dumps(p)))
    assert d.exact and p["enc"] in ("dense", "sparse")
    np.testing.assert_array_equal(d.counts, c)
    assert d.layers == tuple(DSV3_MOE_LAYERS) and d.num_tokens == tokens


@pytest.mark.parametrize("tokens", [300, 8192])
def test_deepseek_v3_payload_stays_under_16_kib(tokens):
    rng = np.random.default_rng(tokens)
    L = len(DSV3_MOE_LAYERS)
    if tokens > 1000:  # a long prompt: draw counts directly (same shape, big values)
        c = rng.multinomial(tokens * DSV3_K, rng.dirichlet(np.full(DSV3_E, 0.3)), size=L)
    else:
        c = _counts(rng, tokens, L, DSV3_E, DSV3_K)
    p = encode_counts(c, DSV3_MOE_LAYERS, tokens)
    assert payload_size(p) <= DEFAULT_MAX_BYTES == 16 * 1024
    d = decode_payload(p)
    # every used expert stays used, no unused expert appears
    np.testing.assert_array_equal(d.counts > 0, c > 0)
    if not d.exact:
        rel = np.abs(d.counts - c)[c > 0] / c[c > 0]
        assert rel.max() < 0.25  # 6-bit log codes for this shape
        cos = float(d.counts.ravel() @ c.ravel() / np.linalg.norm(d.counts) / np.linalg.norm(c))
        assert cos > 0.999


def test_sparse_index_width_for_big_shapes():
    c = np.zeros((300, 300), np.int64)
    c[299, 299] = 5
    c[0, 1] = 2
    p = encode_counts(c, list(range(300)), 3)
    assert p["enc"] == "sparse"
    np.testing.assert_array_equal(decode_payload(p).counts, c)


def test_layout_moe_rows_or_hidden_rows():
    c = np.arange(12, dtype=np.int64).reshape(3, 4)
    d = decode_payload(encode_counts(c, [1, 2, 4], 3))
    np.testing.assert_array_equal(to_layout(d, 3, 4), c)
    full = to_layout(d, 5, 4)
    np.testing.assert_array_equal(full[[1, 2, 4]], c)
    assert not full[[0, 3]].any()
    with pytest.raises(PayloadError, match="experts"):
        to_layout(d, 3, 8)
    with pytest.raises(PayloadError, match="align"):
        to_layout(d, 4, 4)


def _good():
    return encode_counts(np.ones((2, 4), np.int64), [0, 1], 1)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p: p.update(v=9), "version"),
        (lambda p: p.update(layers=[]), "layers"),
        (lambda p: p.update(layers=[0, 0]), "repeats"),
        (lambda p: p.update(E=0), "'E'"),
        (lambda p: p.update(bits=64), "'bits'"),
        (lambda p: p.update(enc="zip"), "encoding"),
        (lambda p: p.update(d="***"), "base64"),
        (lambda p: p.update(d=base64.b64encode(b"\x00" * 5).decode()), "bytes"),
        (lambda p: p.update(n=-1), "'n'"),
    ],
)
def test_malformed_payloads_raise(mutate, match):
    p = _good()
    mutate(p)
    with pytest.raises(PayloadError, match=match):
        decode_payload(p)


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", "3", json.dumps({"v": 1})])
def test_malformed_raw_payloads_raise(raw):
    with pytest.raises(PayloadError):
        decode_payload(raw)


def test_meta_info_list_form_is_accepted():
    p = _good()
    np.testing.assert_array_equal(decode_payload([p]).counts, decode_payload(p).counts)
