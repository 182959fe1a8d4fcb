"""Expert counts under DP attention and DeepEP equal SGLang 0.5.23's own per-request capture.

These layouts need several GPUs (NCCL, DeepEP), so each rank is played in one process on
constructed forward batches (tests/_capture_layouts_probe.py): SGLang's patched capture site
feeds both ELDR's accumulator and a real RoutedExpertsCapturer, and the streamed payload of each
request must equal the counts of the capturer's rows for that request, on every DP rank (uneven
token counts, an idle rank, SGLang's padding with valid-looking ids in the padding rows, both
DP padding modes), on every attention-TP rank under DeepEP (scattered rows, fused shared
experts), and for a request chunked across two forwards. Under CI=true (or
ELDR_REQUIRE_SGLANG=1) a missing sglang fails these tests instead of skipping them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _sglang_cpu import REQUIRE  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).with_name("_capture_layouts_probe.py")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    from eldr_sglang.testing.sglang_cpu.overlay import build_overlay
    from eldr_sglang.testing.sglang_cpu.stub import HarnessError

    try:
        overlay = build_overlay(tmp_path_factory.mktemp("capture_layouts") / "overlay", cpu_shim=True, eldr=True)
    except HarnessError as exc:
        if REQUIRE:
            pytest.fail(f"{exc} (CI=true or ELDR_REQUIRE_SGLANG=1: these tests must run)")
        pytest.skip(str(exc))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(REPO)]))
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # the CPU engine would load sgl_kernel (and need the libcuda stub)
    p = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path_factory.mktemp("probe_cwd"))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1][5:]), p.stderr


# requests per rank of the constructed batches, and their prompt lengths (slot: tokens)
DP_RANKS = {"0": {"2": 3, "5": 13}, "1": {"1": 4}, "2": {"3": 9, "4": 2, "6": 5}}
DEEPEP_REQS = {"1": 2, "3": 9, "7": 6}


def _check(ranks, want_of):
    for rank, got in ranks.items():
        assert got["status"] == "on"
        reqs, want = got["reqs"], want_of(rank)
        assert sorted(reqs) == sorted(want), (rank, reqs)
        for slot, r in reqs.items():
            tokens = want[slot]
            assert r.get("equal") is True, (rank, slot, r)
            assert r["tokens"] == tokens and r["layers"] == [1, 2, 3]
            assert r["total"] == tokens * 3 * 3  # tokens x top-k x MoE layers: a full count, nothing lost


@pytest.mark.parametrize("case", ["dp_attention_sum_len", "dp_attention_sum_len_attn_tp2", "dp_attention_max_len"])
def test_dp_attention_counts_equal_sglang_capturer_on_every_dp_rank(probe, case):
    _check(probe[0][case], DP_RANKS.__getitem__)


@pytest.mark.parametrize("case", ["deepep_tp4", "deepep_dp_attention_tp2_shared"])
def test_deepep_scattered_rows_counts_equal_sglang_capturer_on_every_attn_tp_rank(probe, case):
    ranks = probe[0][case]
    assert len(ranks) == (4 if case == "deepep_tp4" else 2)
    _check(ranks, lambda _rank: DEEPEP_REQS)  # every rank of the group holds the full counts


def test_dp_attention_forward_not_seen_in_python_is_reported_unattributed(probe):
    # a graph replay under DP attention: the row start was never read, so no guess is streamed
    assert probe[0]["dp_attention_graph_replay"] == {"4": {"none": "unattributed_rows"}}


def test_dp_attention_deepep_unattributable_layout_is_reported_off(probe):
    res, stderr = probe
    assert res["refused_pp"] == {"status": "off (--pp-size 2: each pipeline stage sees only its own layers' experts)",
                                 "accumulator": False}
    # one start-up line naming the flag
    lines = [ln for ln in stderr.splitlines() if "ELDR signature off" in ln]
    assert len(lines) == 1 and "--pp-size 2" in lines[0], lines
