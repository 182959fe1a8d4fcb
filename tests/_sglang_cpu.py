"""Shared by the real-SGLang CPU tests (test_sglang_cpu_*.py): when to fail instead of skip."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest

# Under CI (or when asked) a missing prerequisite is a failure: the tests must run there.
REQUIRE = os.environ.get("ELDR_REQUIRE_SGLANG") == "1" or os.environ.get("CI", "").lower() == "true"
STARTUP_TIMEOUT = 900  # servers on two shared cores: 41-225 s measured, with headroom


def harness_or_skip(workdir):
    """A Harness in workdir, or a skip (a failure under REQUIRE) naming what is missing."""
    from eldr_sglang.testing.sglang_cpu.harness import Harness
    from eldr_sglang.testing.sglang_cpu.stub import HarnessError

    try:
        return Harness(workdir)
    except HarnessError as exc:
        msg = str(exc)
        if REQUIRE:
            pytest.fail(msg + " (CI=true or ELDR_REQUIRE_SGLANG=1: the real-SGLang CPU tests must run)")
        pytest.skip(msg)


# ---------------------------------------------------------------- requests and routed experts
LAYERS, TOP_K, EXPERTS = 2, 2, 8  # the tiny Qwen3-MoE (eldr_sglang/testing/sglang_cpu/model.py)
MAX_NEW = 12


def generate(url: str, text: str, max_new: int = MAX_NEW, stream: bool = False, **extra):
    """POST /generate (greedy, exactly max_new tokens); the answer, or a stream's last event."""
    from eldr_sglang.testing.pd_cluster import post

    status, headers, body = post(url + "/generate", {"text": text, "stream": stream, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}, **extra}, timeout=300)
    assert status == 200, body[:2000]
    if not stream:
        return headers, json.loads(body)
    events = [ev[6:] for ev in body.decode().split("\n\n") if ev.startswith("data: ")]
    assert events and events[-1] == "[DONE]", body[-500:]
    return headers, json.loads(events[-2])


def prompt_rows(resp: dict) -> np.ndarray:
    """The prompt's rows [prompt_tokens, layers, top_k] of meta_info.routed_experts."""
    arr = np.frombuffer(base64.b64decode(resp["meta_info"]["routed_experts"]), dtype="<i4").reshape(-1, LAYERS, TOP_K)
    n = resp["meta_info"]["prompt_tokens"]
    assert arr.shape[0] >= n, (arr.shape, n)
    return arr[:n]


def counts_of(rows: np.ndarray) -> np.ndarray:
    counts = np.zeros((LAYERS, EXPERTS), np.int64)
    for layer in range(LAYERS):
        np.add.at(counts[layer], rows[:, layer].reshape(-1), 1)
    return counts


def signature_counts(raw) -> tuple[np.ndarray, object]:
    """[layers, experts] counts of a streamed meta_info.eldr_signature (a per-token list)."""
    from eldr_sglang.sglang_ext.payload import decode_payload

    if isinstance(raw, list):
        raw = raw[0]
    dec = decode_payload(raw)
    return dec.counts.astype(np.int64), dec
