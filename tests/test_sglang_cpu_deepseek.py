"""DeepSeek-V3's own architecture (DeepseekV3ForCausalLM) on real SGLang 0.5.23, on this CPU.

A tiny DeepSeek-V3 (grouped top-k with a correction bias, a shared expert, MLA, the first
hidden layer dense) in PD mode: one patched prefill, one decode, mooncake over TCP, the ELDR
router binding late. Its routing reaches SGLang's capture point by another path than
Qwen3-MoE's; the test checks that the signature the prefill streams counts exactly what
return_routed_experts reports for the same forward, with the dense layer left out.

Skipped without sglang 0.5.23 and the mooncake prerequisites, except under CI=true or
ELDR_REQUIRE_SGLANG=1, where it fails instead.
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from _sglang_cpu import STARTUP_TIMEOUT, harness_or_skip  # noqa: E402
from eldr_sglang.testing.pd_cluster import post  # noqa: E402

HIDDEN, TOP_K, EXPERTS, MOE_LAYERS = 3, 4, 16, [1, 2]  # model.DEEPSEEK_V3: first_k_dense_replace 1

PROMPTS = [
    "DeepSeek routes each token to four of sixteen experts.",
    "def add(a, b):\n    return a + b\n",
    "The weather today is sunny with a light breeze from the west.",
    "1 2 3 4 5 6 7 8 9 10",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from eldr_sglang.testing.sglang_cpu.cluster import wait_ready
    from eldr_sglang.testing.sglang_cpu.tap import Tap

    h = harness_or_skip(tmp_path_factory.mktemp("sglang_cpu_dsv3"))
    tap = None
    try:
        model = h.model("deepseek_v3")
        prefill, boot, decodes = h.start_pd(model, 1, prefill_extra=[
            "--enable-eldr-signature", "--enable-eldr-late-binding", "--enable-return-routed-experts"],
            prefix="dsv3-")
        wait_ready([prefill, *decodes], STARTUP_TIMEOUT)
        tap = Tap("dsv3-prefill", prefill.url)
        router = h.start_router("dsv3-router", [(tap.url, boot)], [decodes[0].url], [
            "--disagg-router", "round_robin", "--eldr-bind", "late", "--eldr-signature-timeout-secs", "120",
            "--request-timeout-secs", "600", "--load-monitor-interval", "0"])
        wait_ready([router], 120)
        yield h, tap, router
    finally:
        h.close()
        if tap is not None:
            tap.close()
        print(f"\n[sglang-cpu] DeepSeek-V3 PD: peak RSS sum {h.memory.peak / 2**30:.2f} GiB; ready after: "
              + ", ".join(f"{s.name} {s.ready_s:.0f}s" for s in h.servers if s.ready_s))


def test_deepseek_v3_signature_counts_equal_return_routed_experts_dense_layer_masked(cluster):
    from eldr_sglang.sglang_ext.payload import decode_payload

    _, tap, router = cluster
    compared = 0
    for text in PROMPTS:
        status, headers, raw = post(router.url + "/generate", {"text": text, "return_routed_experts": True,
                                                                "sampling_params": {"max_new_tokens": 3, "temperature": 0.0,
                                                                                    "ignore_eos": True}}, timeout=600)
        assert status == 200, raw[:2000]
        assert len(json.loads(raw)["output_ids"]) == 3
        room = int(headers["X-ELDR-Bootstrap-Room"])
        # the prefill's last event may trail the decode's answer (the router drains it after
        # answering): wait for it, bounded
        deadline = time.monotonic() + 120
        while True:
            events = [e for e in tap.snapshot() if e["room"] == room]
            end = [e for e in events if e["event"] == "stream_end"]
            if end or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        sig = [e for e in events if e["event"] == "signature"]
        assert len(sig) == 1 and len(end) == 1, events
        payload = sig[0]["payload"]
        dec = decode_payload(payload[0] if isinstance(payload, list) else payload)
        meta = json.loads(end[0]["last"][5:])["meta_info"]
        arr = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, HIDDEN, TOP_K)
        n = meta["prompt_tokens"]
        assert not arr[:, 0].any()  # the dense first layer: nothing routed
        truth = np.zeros((len(MOE_LAYERS), EXPERTS), np.int64)
        for row, layer in enumerate(MOE_LAYERS):
            np.add.at(truth[row], arr[:n, layer].reshape(-1), 1)
        assert dec.exact and list(dec.layers) == MOE_LAYERS and dec.num_tokens == n
        assert np.array_equal(dec.counts.astype(np.int64), truth), (text, dec.counts, truth)
        # grouped top-k picks from at most topk_group=2 of n_group=4 groups of 4 experts
        groups = arr[:n, MOE_LAYERS] // (EXPERTS // 4)
        assert max(len(set(g.tolist())) for g in groups.reshape(-1, TOP_K)) <= 2
        compared += int(truth.sum())
    print(f"\n[sglang-cpu] DeepSeek-V3 exact counts: {len(PROMPTS)} prompts, {compared} choices compared")
