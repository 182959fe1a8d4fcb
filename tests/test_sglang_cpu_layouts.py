"""Real SGLang 0.5.23 on this CPU with a multi-rank prefill, each rank's threads bound to one of
the two cores, one decode, the project's router binding late. The layouts SGLang's CPU engine
runs (the test ids name them, so `pytest -k dp_attention` selects DP attention):

- `dp_attention`: `--tp 2 --dp 2 --enable-dp-attention`. The MoE layers see the gathered rows of
  both DP ranks; the ELDR prefill keeps its own rank's slice (the rank's start from SGLang's
  `get_dp_local_slice_cpu`), and the rank that ran a request's forward streams its signature.
- `tp2`: `--tp 2`. Both TP ranks see every row; rank 0 streams.

The invariant, end to end: the counts the prefill streams (seen by a tap between prefill and
router) equal the counts from `return_routed_experts` of the same prefill forward. DeepEP does
not run on a CPU; tests/test_capture_layouts.py checks its attribution against SGLang's own
capturer on constructed forward batches.

The CPU shim (eldr_sglang/testing/sglang_cpu/cpu_shim/0001) makes the two-rank prefill start on a
machine without CUDA: no PyNccl communicator, the torch-native backend's DP padding value.
Skipped when sglang 0.5.23 or the mooncake prerequisites are missing, except under CI=true or
ELDR_REQUIRE_SGLANG=1, where the tests fail instead.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiohttp")

from _sglang_cpu import EXPERTS, LAYERS, STARTUP_TIMEOUT, TOP_K, counts_of, generate, harness_or_skip  # noqa: E402
from _sglang_cpu import prompt_rows, signature_counts  # noqa: E402
from _sim_helpers import make_trace  # noqa: E402
from eldr_sglang.testing.pd_cluster import get_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"dp_attention": ["--tp", "2", "--dp", "2", "--enable-dp-attention"], "tp2": ["--tp", "2"]}
# Prompts of different lengths, so that the rows of one DP rank's slice start past the other's
# in the gathered batch.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "def mul(a, b):\n    return a * b\n" * 3,
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Guten Tag! Hola, que tal?",
    "Summarise: " + "mixture of experts routing " * 8,
    "Prefill computes the key value cache",
]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, tmp_path_factory):
    from eldr_sglang.testing.sglang_cpu.cluster import free_port_block, wait_ready
    from eldr_sglang.testing.sglang_cpu.harness import PD_TRANSFER
    from eldr_sglang.testing.sglang_cpu.tap import Tap
    from eldr_sglang.traces import save_trace

    layout = request.param
    h = harness_or_skip(tmp_path_factory.mktemp(f"sglang_cpu_{layout}"))
    servers, taps = [], []
    try:
        # The router needs a centroid file of the model's shape to bind late; which worker a
        # request goes to does not matter here (one decode: K = 1), so a fit on random routing will do.
        rng = np.random.default_rng(0)
        rows = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(32 * 20 * LAYERS)]).reshape(32 * 20, LAYERS, TOP_K)
        trace, cents = h.workdir / "random.npz", h.workdir / "random.eldr"
        save_trace(make_trace(rows.astype(np.int16), [20] * 32, [16] * 32, EXPERTS), trace)
        p = subprocess.run([sys.executable, "-m", "eldr_sglang", "fit", str(trace), "--workers", "1", "--layers", "all",
                            "--out", str(cents), "--quiet"], capture_output=True, text=True, timeout=600, cwd=REPO)
        assert p.returncode == 0, p.stderr[-3000:]

        model = h.model("qwen3_moe")
        boot = free_port_block()
        # SGLang's CPU engine binds each rank's OpenMP threads to the cores named here (it
        # refuses more ranks than NUMA nodes without it)
        prefill = h.start("dp-prefill", model, [
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot), *PD_TRANSFER,
            "--enable-eldr-signature", "--enable-eldr-late-binding", "--enable-return-routed-experts",
            "--random-seed", "0", *LAYOUTS[layout]], env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
        decode = h.start("dp-decode", model, ["--disaggregation-mode", "decode", *PD_TRANSFER, "--random-seed", "0"])
        servers += [prefill, decode]
        wait_ready(servers, STARTUP_TIMEOUT)
        ptap, dtap = Tap("prefill", prefill.url), Tap("decode", decode.url)
        taps += [ptap, dtap]
        router = h.start_router("dp-router", [(ptap.url, boot)], [dtap.url], [
            "--disagg-router", "eldr", "--eldr-centroids", str(cents), "--no-eldr-drift",
            "--eldr-signature-timeout-secs", "120", "--request-timeout-secs", "600",
            "--load-monitor-interval", "3", "--health-check-interval-secs", "5", "--log-level", "info"])
        servers.append(router)
        wait_ready([router], 120)
        yield {"layout": layout, "prefill": prefill, "router": router, "ptap": ptap}
    finally:
        h.stop(servers)
        for t in taps:
            t.close()
        h.close()


def _wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return found


def test_multi_rank_prefill_reports_its_signature_on(cluster):
    info = get_json(cluster["prefill"].url + "/server_info")
    assert info.get("eldr_signature") == "on", info.get("eldr_signature")
    st = _wait_for(lambda: (s := get_json(cluster["router"].url + "/eldr/status"))["prefill_signatures"] == [True] and s,
                   60, "the router to see the prefill's signature on")
    assert st["prefill_signature_off"] == [None]


def _ranks_that_prefilled(log: str) -> set[str]:
    """DP ranks whose scheduler logged a prefill batch of a real prompt (SGLang's own health
    checks prefill one token)."""
    return set(re.findall(r"DP(\d) TP\d\] Prefill batch, #new-seq: \d+, #new-token: (?!1,)", log))


def test_multi_rank_streamed_counts_equal_return_routed_experts(cluster):
    """Exact counts, prompt by prompt: the streamed signature equals the counts of
    return_routed_experts of the same prefill forward. Under DP attention SGLang picks a
    request's prefill DP rank from its bootstrap room, so prompts are sent until both DP ranks
    have served some (at most 16: a 2^-15 chance of one rank taking them all)."""
    dp = cluster["layout"] == "dp_attention"
    ptap, url = cluster["ptap"], cluster["router"].url
    compared, ranks, sent = 0, set(), 0
    for i in range(16):
        text = PROMPTS[i % len(PROMPTS)] + f" (variant {i})"
        headers, _ = generate(url, text, max_new=2, return_routed_experts=True)
        sent += 1
        assert headers.get("X-ELDR-Reason") not in ("no_signature", "timeout"), headers
        room = int(headers["X-ELDR-Bootstrap-Room"])
        sig = _wait_for(lambda: [e for e in ptap.snapshot() if e["room"] == room and e["event"] == "signature"],
                        60, f"the signature of room {room}")
        assert len(sig) == 1, sig
        ends = _wait_for(lambda: [e for e in ptap.snapshot() if e["room"] == room and e["event"] == "stream_end"],
                         120, f"the end of the prefill stream of room {room}")
        counts, dec = signature_counts(sig[0]["payload"])
        rows = prompt_rows(json.loads(ends[0]["last"][5:]))
        cached = sig[0]["meta"]["cached_tokens"]  # radix-cache hits are not recomputed, not counted
        truth = counts_of(rows[cached:])
        assert dec.exact and list(dec.layers) == list(range(LAYERS))
        assert dec.num_tokens == len(rows) - cached
        assert np.array_equal(counts, truth), (text, counts, truth)
        compared += int(truth.sum())
        ranks = _ranks_that_prefilled(cluster["prefill"].log.read_text(errors="replace")) if dp else set()
        if sent >= len(PROMPTS) and (not dp or ranks == {"0", "1"}):
            break
    if dp:
        assert ranks == {"0", "1"}, f"only DP ranks {ranks} prefilled {sent} prompts"
    print(f"\n[sglang-cpu {cluster['layout']}] exact counts: {sent} prompts, {compared} (token, layer, expert) "
          f"choices compared" + (f", prefill DP ranks {sorted(ranks)}" if dp else ""))
