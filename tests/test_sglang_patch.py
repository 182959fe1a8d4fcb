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


def _run_probe(overlay, probe: str, *args: str) -> dict:
    """Patch the overlay, run `probe` in a fresh interpreter that imports SGLang from it, and
    return the JSON the probe printed last on a line starting with PROBE."""
    patching.apply(overlay)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(REPO)]))
    p = subprocess.run([sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][5:])


def test_patched_modules_import_hook_counts_exactly_flags_parse(overlay):
    out = _run_probe(overlay, PROBE)
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
    dflt = prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "decode", "--enable-eldr-occupancy"])
    out["default_source"] = [dflt.enable_eldr_occupancy, dflt.eldr_occupancy_source]
    runtime_context.publish(dflt, role="scheduler")
    from eldr_sglang.sglang_ext import occupancy
    occupancy.install(types.SimpleNamespace(is_draft_worker=False))  # signatures: no device hooks
    out["signatures_installs"] = occupancy.OCCUPANCY is not None
    args = prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "decode", "--enable-eldr-occupancy",
                                "--eldr-occupancy-source", "steps"])
    out["flags"] = [args.enable_eldr_occupancy, args.eldr_occupancy_source,
                    prepare_server_args(["--model-path", "dummy"]).enable_eldr_occupancy]
    runtime_context.publish(args, role="scheduler")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.managers.load_snapshot import LoadSnapshot
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
    out = _run_probe(overlay, OCC_PROBE, str(tmp_path / "snap.shm"))
    assert all(out["hooked"].values()), out["hooked"]
    assert out["default_source"] == [True, "signatures"]
    assert out["signatures_installs"] is False  # the signatures source keeps no per-step table
    assert out["flags"] == [True, "steps", False]
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


SIG_PROBE = textwrap.dedent(
    """
    import asyncio, json, math, types
    out = {}
    import sglang.srt.entrypoints.http_server as hs
    import sglang.srt.entrypoints.v1_loads as v1_loads
    out["hooked"] = hs._eldr_occ is not None
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt import runtime_context
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.load_snapshot import LoadSnapshot
    from eldr_sglang.sglang_ext import occupancy
    runtime_context.publish(prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "decode",
                                                 "--enable-eldr-occupancy"]), role="tokenizer")
    hf = types.SimpleNamespace(num_hidden_layers=4, first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=8)
    S = float(1 << 24)

    def profile(cells, ps):
        return {"layers": [1, 2], "experts": 8, "cells": cells, "log_keep": [round(math.log(1 - p) * S) for p in ps]}

    class Req:  # the parsed body FastAPI caches on the request
        def __init__(self, body):
            self.body, self.headers = body, {}
        async def json(self):
            return self.body
        async def is_disconnected(self):
            return False

    async def main():
        gate = asyncio.Event()
        class TM:  # the tokenizer manager: every request waits for the gate, then one output
            model_config = types.SimpleNamespace(hf_text_config=hf)
            load_snapshot_reader = None
            async def generate_request(self, obj, request):
                await gate.wait()
                yield {"text": "x", "meta_info": {"id": "r"}}
            def create_abort_task(self, obj):
                return None
            async def get_loads(self, include=None, dp_rank=None):
                return [LoadSnapshot(num_running_reqs=3)]
        tm = TM()
        hs.set_global_state(types.SimpleNamespace(tokenizer_manager=tm))
        async def chat_handle(request, raw):
            await gate.wait()
            return {"choices": []}
        app = types.SimpleNamespace(state=types.SimpleNamespace(
            openai_serving_chat=types.SimpleNamespace(handle_request=chat_handle)))

        async def report(layers="1,2"):
            r = await v1_loads.get_loads(dp_rank=None, include="core", format=None, eldr_layers=layers, tokenizer_manager=tm)
            return r.get("eldr_occupancy", r.get("eldr_occupancy_error"))

        def gen(body):
            return hs.generate_request(GenerateReqInput(text="t", stream=body.get("stream", False)), Req(body))

        out["idle_at_rest"] = await report()
        streamed = await gen({"text": "t", "stream": True, "eldr_profile": profile([0, 9], [0.5, 0.25])})
        out["streamed_type"] = type(streamed).__name__
        plain = asyncio.ensure_future(gen({"text": "t", "eldr_profile": profile([0, 3], [0.6, 0.1])}))
        bad = asyncio.ensure_future(gen({"text": "t", "eldr_profile": {"layers": [1, 2], "experts": 8, "cells": [99],
                                                                        "log_keep": [-5]}}))
        raw = Req({"messages": [], "eldr_profile": profile([15], [0.5])})
        raw.app = app
        chat = asyncio.ensure_future(hs.openai_v1_chat_completions(types.SimpleNamespace(), raw))
        await asyncio.sleep(0.05)
        out["in_flight"] = await report()
        out["dropped"] = occupancy.PROFILES.dropped
        out["bad_layers"] = await report("0,9")
        gate.set()
        await asyncio.gather(plain, bad, chat)
        out["handlers_done_stream_open"] = await report()  # the stream's body has not been sent yet
        out["chunks"] = [c.decode() async for c in streamed.body_iterator]
        out["idle_after"] = await report()
        # a client that disconnects: the body iterator is closed after its first chunk
        gate.clear()
        gone = await gen({"text": "t", "stream": True, "eldr_profile": profile([1], [0.5])})
        it = gone.body_iterator
        gate.set()
        await it.__anext__()
        out["before_close"] = occupancy.PROFILES.running
        await it.aclose()
        out["after_close"] = [occupancy.PROFILES.running, await report()]
        # the steps source counts no profile
        runtime_context.publish(prepare_server_args(["--model-path", "dummy", "--disaggregation-mode", "decode",
            "--enable-eldr-occupancy", "--eldr-occupancy-source", "steps"]), role="tokenizer")
        added = occupancy.PROFILES.added
        await gen({"text": "t", "eldr_profile": profile([0], [0.5])})
        out["steps_counts"] = occupancy.PROFILES.added - added

    asyncio.run(main())
    print("PROBE" + json.dumps(out))
    """
)


def test_signatures_occupancy_counts_profiles_while_requests_are_served(overlay):
    """The default source on the patched overlay's real handlers: /generate (streamed and not)
    and /v1/chat/completions count their eldr_profile until the response ends (a stream: its
    body sent or closed), a malformed one is ignored and counted, and /v1/loads answers the
    product of the running requests' 1 - p."""
    out = _run_probe(overlay, SIG_PROBE)
    assert out["hooked"]
    rest = {"version": 1, "source": "signatures", "layers": [1, 2], "running": 3, "experts": None, "idle": None}
    assert out["idle_at_rest"] == rest
    assert out["streamed_type"] == "StreamingResponse"
    # layer 1: e0 0.5 x 0.4 (stream, plain), e3 0.9 (plain); layer 2: e1 0.75 (stream), e7 0.5 (chat)
    row1, row2 = [1.0] * 8, [1.0] * 8
    row1[0], row1[3], row2[1], row2[7] = 0.2, 0.9, 0.75, 0.5
    got = out["in_flight"]
    assert got["experts"] == 8 and got["running"] == 3 and got["source"] == "signatures"
    assert [[round(v, 5) for v in row] for row in got["idle"]] == [row1, row2], got["idle"]
    assert out["dropped"] == 1  # the malformed profile: ignored, counted, its request served
    assert out["bad_layers"].startswith("layer 0 is not a MoE layer")
    left = out["handlers_done_stream_open"]["idle"]
    assert [[round(v, 5) for v in row] for row in left] == [[0.5] + [1.0] * 7, [1.0, 0.75] + [1.0] * 6]
    assert out["chunks"] and out["chunks"][-1] == "data: [DONE]\n\n"
    assert out["idle_after"] == rest
    assert out["before_close"] == 1
    assert out["after_close"] == [0, rest]
    assert out["steps_counts"] == 0


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
