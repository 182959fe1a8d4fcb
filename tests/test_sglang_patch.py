"""The patch series against the real sglang==0.5.23 (installed with `pip install sglang==0.5.23`).

The installed package is never modified: the tests build an overlay of it (symlinks, with
real copies of the files the series touches) and patch that. Skipped when sglang is not
installed, except under ELDR_REQUIRE_SGLANG=1, where they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eldr_sglang import patching

REPO = Path(__file__).resolve().parent.parent
REQUIRE = os.environ.get("ELDR_REQUIRE_SGLANG") == "1"


@pytest.fixture(scope="module")
def overlay(tmp_path_factory) -> Path:
    """A tree root whose sglang/ mirrors the installed package; touched files are real copies
    (eldr_sglang.testing.sglang_cpu.overlay, the one implementation), pristine."""
    from eldr_sglang.testing.sglang_cpu.overlay import build_overlay
    from eldr_sglang.testing.sglang_cpu.stub import HarnessError

    try:
        return build_overlay(tmp_path_factory.mktemp("sglang_overlay"))
    except HarnessError as exc:
        if REQUIRE:
            pytest.fail(f"{exc} and ELDR_REQUIRE_SGLANG=1")
        pytest.skip(str(exc))


def test_series_applies_cleanly_and_idempotently(overlay):
    _, states = patching.check(overlay)
    assert [s.state for s in states] == ["unapplied"] * len(states) == ["unapplied"] * 5, states
    _, done = patching.apply(overlay)
    assert done == [p.name for p in patching.read_series(patching.default_series_dir())]
    _, states = patching.check(overlay)
    assert {s.state for s in states} == {"applied"}
    assert patching.apply(overlay)[1] == []  # idempotent
    assert len(patching.revert(overlay)[1]) == 5
    assert patching.revert(overlay)[1] == []
    assert {s.state for s in patching.check(overlay)[1]} == {"unapplied"}
    patching.apply(overlay)


PROBE = textwrap.dedent(
    """
    import json, types
    import numpy as np, torch
    out = {}
    import sglang
    out["sglang_file"] = sglang.__file__
    import sglang.srt.layers.moe.topk as topk
    import sglang.srt.layers.moe.mega_gate as mega_gate
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.model_executor.model_runner as model_runner
    import sglang.srt.entrypoints.openai.serving_chat as serving_chat
    import sglang.srt.entrypoints.openai.serving_completions as serving_completions
    mods = [topk, mega_gate, prefill, model_runner, serving_chat, serving_completions]
    out["hooked"] = {m.__name__: m._eldr is not None for m in mods}

    # --- server flags parse, late binding turns on optimistic prefill
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
    a = prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
        "--enable-eldr-signature", "--eldr-signature-max-bytes", "8192", "--enable-eldr-late-binding"])
    b = prepare_server_args(["--model-path", "dummy"])
    handle_pd_disaggregation(a)
    out["flags"] = [a.enable_eldr_signature, a.eldr_signature_max_bytes, a.enable_eldr_late_binding,
                    resolving_view(a).optimistic_prefill_attempts]
    out["defaults"] = [b.enable_eldr_signature, b.eldr_signature_max_bytes, b.enable_eldr_late_binding]

    # --- the signature hook: SGLang's own capture site with a constructed batch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from eldr_sglang.sglang_ext import runtime
    from eldr_sglang.sglang_ext.payload import decode_payload
    HIDDEN, MOE, E, K = 4, [1, 2, 3], 8, 2          # layer 0 is dense (first_k_dense_replace=1)
    # publish the flags the way a prefill server process does, then let the patched
    # ModelRunner hook install the accumulator from a DeepSeek-style config
    from sglang.srt import runtime_context
    runtime_context.publish(prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
        "--enable-eldr-signature", "--eldr-signature-max-bytes", "4096", "--chunked-prefill-size", "64"]), role="scheduler")
    hf = types.SimpleNamespace(num_hidden_layers=HIDDEN, first_k_dense_replace=1, moe_layer_freq=1,
                               n_routed_experts=E, num_experts_per_tok=K)
    pool = types.SimpleNamespace(req_generation=torch.zeros(8, dtype=torch.int64),
                                 req_to_token=torch.zeros((8, 16), dtype=torch.int32))
    runner = types.SimpleNamespace(is_draft_worker=False, req_to_token_pool=pool, device="cpu",
                                   model_config=types.SimpleNamespace(hf_text_config=hf))
    runtime.install(runner)
    acc = runtime.ACCUMULATOR
    out["installed"] = None if acc is None else [acc.moe_layers, acc.num_experts, acc.top_k, acc.max_slots, runtime.MAX_BYTES]
    allow = types.SimpleNamespace(allow_routed_experts_capture=True)
    draft = types.SimpleNamespace(allow_routed_experts_capture=False)
    rng = np.random.default_rng(0)
    expected = {1: np.zeros((3, E), np.int64), 6: np.zeros((3, E), np.int64)}

    def forward(slots, lens, pad):
        pool.req_generation[slots] = 1
        fb = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND,
            extend_seq_lens_cpu=lens, req_pool_indices_cpu=torch.tensor(slots),
            req_pool_indices=torch.tensor(slots), extend_seq_lens=torch.tensor(lens))
        runtime.begin_forward(runner, fb)
        n = sum(lens)
        for layer in range(HIDDEN):
            ids = np.argsort(rng.random((n, E)), axis=1)[:, :K]
            start = 0
            for s, ln in zip(slots, lens):
                if layer in MOE:
                    np.add.at(expected[s][MOE.index(layer)], ids[start:start + ln].reshape(-1), 1)
                start += ln
            padded = np.concatenate([ids, np.full((pad, K), -1)])
            topk.capture_routed_experts_if_allowed(allow, layer, torch.tensor(padded, dtype=torch.int32))
            # a draft model's TopK opts out: it must not count
            topk.capture_routed_experts_if_allowed(draft, layer, torch.tensor(padded, dtype=torch.int32))

    forward([1, 6], [3, 5], pad=2)   # request at slot 1: first chunk; slot 6: whole prompt
    forward([1], [4], pad=0)         # slot 1: second chunk
    reqs = [types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=s)) for s in (1, 6)]
    payloads = runtime.payloads_for(reqs)
    got = [decode_payload(json.loads(json.dumps(p))) for p in payloads]
    out["exact"] = [bool(g.exact) for g in got]
    out["tokens"] = [g.num_tokens for g in got]
    out["layers"] = [list(g.layers) for g in got]
    out["match"] = [bool(np.array_equal(g.counts, expected[s])) for g, s in zip(got, (1, 6))]
    out["total"] = int(sum(g.counts.sum() for g in got))
    print("PROBE" + json.dumps(out))
    """
)


def test_patched_modules_import_hook_counts_exactly_flags_parse(overlay):
    patching.apply(overlay)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(REPO)]))
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    out = json.loads(lines[-1][5:])
    assert out["sglang_file"].startswith(str(overlay))
    assert all(out["hooked"].values()), out["hooked"]
    assert out["flags"] == [True, 8192, True, 1]
    assert out["defaults"] == [False, 16384, False]
    assert out["installed"] == [[1, 2, 3], 8, 2, 8, 4096]
    assert out["exact"] == [True, True]
    assert out["tokens"] == [7, 5]
    assert out["layers"] == [[1, 2, 3], [1, 2, 3]]
    assert out["match"] == [True, True]
    assert out["total"] == (7 + 5) * 2 * 3  # tokens x top-k x MoE layers: dense layer 0 masked


OCC_PROBE = textwrap.dedent(
    """
    import asyncio, json, sys, types
    import numpy as np, torch
    out = {}
    import sglang.srt.layers.moe.topk as topk
    import sglang.srt.layers.moe.mega_gate as mega_gate
    import sglang.srt.model_executor.model_runner as model_runner
    import sglang.srt.managers.scheduler as scheduler
    import sglang.srt.entrypoints.v1_loads as v1_loads
    out["hooked"] = {m.__name__: m._eldr_occ is not None for m in (topk, mega_gate, model_runner, scheduler, v1_loads)}
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt import runtime_context
    args = prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "decode", "--enable-eldr-occupancy"])
    out["flags"] = [args.enable_eldr_occupancy, prepare_server_args(["--model-path", "dummy"]).enable_eldr_occupancy]
    runtime_context.publish(args, role="scheduler")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.managers.load_snapshot import LoadSnapshot
    from eldr_sglang.sglang_ext import occupancy
    hf = types.SimpleNamespace(num_hidden_layers=4, first_k_dense_replace=1, moe_layer_freq=1,
                               n_routed_experts=8, num_experts_per_tok=2)
    pool = types.SimpleNamespace(req_to_token=torch.zeros((8, 16), dtype=torch.int32))
    runner = types.SimpleNamespace(is_draft_worker=False, req_to_token_pool=pool, device="cpu",
                                   model_config=types.SimpleNamespace(hf_text_config=hf))
    occupancy.install(runner)
    occ = occupancy.OCCUPANCY
    out["installed"] = None if occ is None else [occ.moe_layers, occ.num_experts, occupancy.REFUSAL]
    allow = types.SimpleNamespace(allow_routed_experts_capture=True)
    ids = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
    for mode, n in ((ForwardMode.EXTEND, 2), (ForwardMode.DECODE, 2), (ForwardMode.IDLE, 0)):
        occupancy.begin_forward(runner, types.SimpleNamespace(forward_mode=mode, batch_size=n))
        for layer in range(4):  # through SGLang's own capture site
            topk.capture_routed_experts_if_allowed(allow, layer, ids)
    out["steps"] = occ.steps
    out["used"] = (occ.host_table() < 1.0).astype(int).tolist()
    # the handler, with a tokenizer manager that serves one snapshot and the scheduler's report
    path = sys.argv[1]
    snap = LoadSnapshot(num_running_reqs=2)
    occupancy.publish(types.SimpleNamespace(path=path), snap)
    async def get_loads(include=None, dp_rank=None):
        return [snap]
    tm = types.SimpleNamespace(get_loads=get_loads, load_snapshot_reader=types.SimpleNamespace(path=path))
    def call(**q):
        r = asyncio.run(v1_loads.get_loads(**{"dp_rank": None, "include": None, "format": None,
                                               "eldr_layers": None, **q}, tokenizer_manager=tm))
        r.pop("timestamp")
        return r
    out["plain"] = call(include="core,disagg")
    out["eldr"] = call(include="core,disagg,eldr", eldr_layers="3,1")
    out["router_query"] = call(include="core,disagg", eldr_layers="3,1")  # what the router asks
    out["bad"] = call(include="core,disagg,eldr", eldr_layers="0")
    print("PROBE" + json.dumps(out))
    """
)


def test_occupancy_hooks_count_decode_steps_and_loads_answers(overlay, tmp_path):
    patching.apply(overlay)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(REPO)]))
    p = subprocess.run([sys.executable, "-c", OCC_PROBE, str(tmp_path / "snap.shm")], env=env, capture_output=True,
                       text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    out = json.loads(lines[-1][5:])
    assert all(out["hooked"].values()), out["hooked"]
    assert out["flags"] == [True, False]
    assert out["installed"] == [[1, 2, 3], 8, None]
    assert out["steps"] == 1  # the decode forward only
    assert out["used"] == [[1, 1, 1, 0, 0, 0, 0, 0]] * 3  # experts 0, 1, 2 at every MoE layer, once
    assert "eldr_occupancy" not in out["plain"] and "eldr_occupancy_error" not in out["plain"]
    eldr = dict(out["eldr"])
    body = eldr.pop("eldr_occupancy")
    assert eldr == out["plain"]  # the rest of the answer is today's
    w = round(1 - 1 / 32, 4)
    assert body == {"version": 1, "experts": 8, "layers": [3, 1], "window_steps": 32, "running": 2,
                    "idle": [[w, w, w, 1.0, 1.0, 1.0, 1.0, 1.0]] * 2}
    assert out["router_query"] == out["eldr"]  # eldr_layers alone asks too (an unpatched server ignores it)
    assert out["bad"]["eldr_occupancy_error"].startswith("layer 0 is not a MoE layer")
    assert "eldr_occupancy" not in out["bad"] and out["bad"]["loads"] == out["plain"]["loads"]


def test_other_sglang_versions_are_refused(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "_version.py").write_text("__version__ = version = '0.5.22'\n")
    with pytest.raises(patching.PatchError, match=r"sglang 0\.5\.22 found .* supports sglang 0\.5\.23 only"):
        patching.apply(tmp_path)


def test_cli_reports_refusal_without_traceback(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "_version.py").write_text("__version__ = '0.6.0'\n")
    p = subprocess.run(
        [sys.executable, "-m", "eldr_sglang", "patch", "check", "--target", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert p.returncode == 1
    assert "0.6.0" in p.stderr and "0.5.23 only" in p.stderr and "Traceback" not in p.stderr
