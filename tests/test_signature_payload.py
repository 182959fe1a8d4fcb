"""The prefill -> router signature payload: exact when it fits, bounded always, strict decoding."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from eldr_sglang.sglang_ext.payload import (
    DEFAULT_MAX_BYTES,
    META_KEY,
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


# ------------------------------------------------------------------ the Rust decoder
def _encodings(rng):
    """(payload, dense counts) of every encoding, at DeepSeek-V3 shape and small ones."""
    L = len(DSV3_MOE_LAYERS)
    out = []
    for tokens, max_bytes in ((1, DEFAULT_MAX_BYTES), (7, DEFAULT_MAX_BYTES), (300, DEFAULT_MAX_BYTES), (300, 1 << 20), (4096, DEFAULT_MAX_BYTES)):
        c = rng.multinomial(tokens * DSV3_K, rng.dirichlet(np.full(DSV3_E, 0.3)), size=L) if tokens > 1000 \
            else _counts(rng, tokens, L, DSV3_E, DSV3_K)
        out.append((encode_counts(c, DSV3_MOE_LAYERS, tokens, max_bytes=max_bytes), c))
    return out


def test_rust_decoder_matches_the_numpy_reference_for_every_encoding():
    from eldr_sglang.testing import reference

    encs = set()
    for p, c in _encodings(np.random.default_rng(3)):
        encs.add(p["enc"])
        got, want = decode_payload(p).counts, reference.decode_counts(p)
        if p["enc"] == "log":  # f64 math then f32 in both; Rust tables the row's values
            np.testing.assert_allclose(got, want, rtol=2e-7)
        else:
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got, c)
    assert encs == {"dense", "sparse", "log"}


def test_event_decode_finds_the_payload_where_the_endpoints_put_it():
    from eldr_sglang import _core

    p = _good()
    for event in ({"text": "a", "meta_info": {"id": "x", META_KEY: [p]}}, {"choices": [], "sglext": {META_KEY: p}},
                  {"meta_info": {META_KEY: json.dumps(p)}}):
        d = _core.decode_event(json.dumps(event).encode())
        np.testing.assert_array_equal(d.counts, np.ones((2, 4)))
    assert _core.decode_event(b'{"meta_info": {"eldr_signature": null}}') is None
    assert _core.decode_event(b'{"text": "no payload"}') is None
    assert _core.decode_event(b"not json") is None
    assert _core.decode_event(json.dumps({"meta_info": {META_KEY: {"v": 1, "none": "too_long"}}})) == "too_long"
    bad = dict(p, d="***")
    with pytest.raises(PayloadError, match="base64"):
        _core.decode_event(json.dumps({"meta_info": {META_KEY: bad}}).encode())


def test_route_from_wire_equals_route_from_dense(tmp_path):
    """The router's new path (payload read straight into the signature) against the old one
    (dense [L, E] counts in the centroid layout), for every encoding, both layouts."""
    from eldr_sglang import Router, write_centroids

    rng = np.random.default_rng(5)
    for num_layers in (len(DSV3_MOE_LAYERS), 61):  # the MoE rows only, or every hidden layer
        w = np.zeros(num_layers, np.float32)
        w[num_layers // 4: 3 * num_layers // 4] = 1.0
        idf = rng.uniform(0.1, 3.0, (num_layers, DSV3_E)).astype(np.float32)
        D = int((w > 0).sum()) * DSV3_E
        path = tmp_path / f"c{num_layers}.eldr"
        write_centroids(str(path), (rng.random((8, D)) ** 3).astype(np.float32), w, idf, tau=0.1)
        router = Router("eldr", centroids=str(path), reload_interval_ms=0)
        spec = router.centroid_set().spec()
        for p, _ in _encodings(rng):
            wire = decode_payload(p, layout=(num_layers, DSV3_E))
            dense = to_layout(wire, num_layers, DSV3_E)
            a = router.route_dense(dense, explain=True)
            b = router.route_counts(wire, explain=True, signature=True)
            assert (a.worker, a.reason, a.band) == (b.worker, b.reason, b.band)
            assert a.distances == b.distances  # bit for bit
            np.testing.assert_array_equal(b.unit_signature(), spec.from_dense(dense))
            assert router.route_counts(wire, explain=True).unit_signature() is None  # kept only when asked
