"""`eldr collect` against an in-process fake SGLang server on 127.0.0.1 (tests/_fake_sglang.py)."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from eldr_sglang.cli import main
import functools

from eldr_sglang.traces.collect import CollectConfig, checkpoint_path, load_prompts, read_checkpoint
from eldr_sglang.traces.collect import collect as collect_any

# Most tests check every id of a v1 trace; the v2 tests at the end use collect_any.
collect = functools.partial(collect_any, fmt="v1")
from eldr_sglang.traces.sglang_responses import ModelSpec
from eldr_sglang.testing.payloads import encode_routed_experts
from eldr_sglang.traces import load_trace

from _fake_sglang import FakeSGLang, routing_for

SPEC = ModelSpec.from_args(6, 2, 8, first_k_dense_replace=2, model="fake/moe")
MAX_NEW = 4


def _dataset(tmp_path, n=12, extra=()):
    recs = []
    for i in range(n):
        words = " ".join(f"w{i}_{j}" for j in range(2 + i % 5))
        if i % 4 == 3:
            recs.append({"messages": [{"role": "user", "content": words}], "domain": f"d{i % 3}"})
        else:
            recs.append({"prompt": words, "domain": f"d{i % 3}"})
    recs.extend(extra)
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path, recs


def _text(rec):
    return rec.get("prompt") or " ".join(m["content"] for m in rec["messages"])


def _cfg(url, **kw):
    base = dict(url=url, spec=SPEC, max_new_tokens=MAX_NEW, concurrency=4, retries=1, backoff_s=0.01, timeout_s=10)
    base.update(kw)
    return CollectConfig(**base)


def _check_trace(tr, recs):
    assert tr.num_requests == len(recs)
    for r, rec in enumerate(recs):
        text = _text(rec)
        want = routing_for(text, MAX_NEW)[:, 2:, :]
        assert tr.prefill_len[r] == len(text.split())
        np.testing.assert_array_equal(tr.expert_ids[tr.req_offsets[r]:tr.req_offsets[r + 1]], want)
        assert tr.domain[r] == rec["domain"]


def test_collect_writes_trace_in_dataset_order(tmp_path):
    path, recs = _dataset(tmp_path)
    out = tmp_path / "trace.npz"
    with FakeSGLang() as srv:
        res = collect(load_prompts(path), _cfg(srv.url), out, progress=False)
        assert sum(srv.received.values()) == len(recs)
    tr = load_trace(out)
    _check_trace(tr, recs)
    assert tr.num_layers == 4 and tr.meta["model"] == "fake/moe"
    assert res.sent == len(recs) and res.reused == 0
    assert not checkpoint_path(out).exists()


def test_interrupt_then_resume_skips_answered_prompts(tmp_path):
    path, recs = _dataset(tmp_path, n=16)
    out = tmp_path / "trace.npz"
    prompts = load_prompts(path)
    seen = []

    def stop_after_five(n):
        seen.append(n)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with FakeSGLang() as srv:
        with pytest.raises(KeyboardInterrupt):
            collect(prompts, _cfg(srv.url), out, progress=stop_after_five)
    assert not out.exists()  # nothing final on an interruption
    ckpt = checkpoint_path(out)
    kept = read_checkpoint(ckpt)
    assert len(kept) >= 5
    # a torn line, as an interruption in the middle of a write leaves it
    with open(ckpt, "a") as fh:
        fh.write('{"key": "abc", "index": 99, "resp')
    with FakeSGLang() as srv2:
        res = collect(prompts, _cfg(srv2.url), out, progress=False)
        assert sum(srv2.received.values()) == len(recs) - len(kept)
        for key_rec in kept.values():
            assert srv2.received[_text(recs[key_rec["index"]])] == 0
    assert res.reused == len(kept)
    _check_trace(load_trace(out), recs)
    assert not ckpt.exists()


def test_server_error_keeps_checkpoint_and_writes_nothing(tmp_path):
    path, recs = _dataset(tmp_path, n=6, extra=[{"prompt": "this one FAIL500 always", "domain": "d0"}])
    out = tmp_path / "trace.npz"
    prompts = load_prompts(path)
    with FakeSGLang() as srv:
        with pytest.raises(ValueError, match=r"1 of 7 requests failed .*HTTP 500.*re-run"):
            collect(prompts, _cfg(srv.url), out, progress=False)
        assert srv.received["this one FAIL500 always"] == 2  # one retry of a 5xx
    assert not out.exists()
    assert len(read_checkpoint(checkpoint_path(out))) == 6
    with FakeSGLang() as srv:
        res = collect(prompts, _cfg(srv.url), out, progress=False, allow_failures=True)
        assert sum(srv.received.values()) == 2  # only the failing prompt is retried
    tr = load_trace(out)
    assert tr.num_requests == 6 and len(res.failed) == 1
    _check_trace(tr, recs[:6])


def test_crashed_server_then_resume(tmp_path):
    path, recs = _dataset(tmp_path, n=10)
    out = tmp_path / "trace.npz"
    prompts = load_prompts(path)
    with FakeSGLang(die_after=4) as srv:
        with pytest.raises(ValueError, match="requests failed"):
            collect(prompts, _cfg(srv.url, concurrency=2), out, progress=False)
    assert len(read_checkpoint(checkpoint_path(out))) == 4
    with FakeSGLang() as srv:
        collect(prompts, _cfg(srv.url), out, progress=False)
        assert sum(srv.received.values()) == 6
    _check_trace(load_trace(out), recs)


def test_transient_error_is_retried(tmp_path):
    path, recs = _dataset(tmp_path, n=3, extra=[{"prompt": "a FLAKY prompt", "domain": "d1"}])
    out = tmp_path / "trace.npz"
    with FakeSGLang() as srv:
        collect(load_prompts(path), _cfg(srv.url), out, progress=False)
        assert srv.received["a FLAKY prompt"] == 2
    _check_trace(load_trace(out), recs)


def test_client_error_is_not_retried(tmp_path):
    path, _ = _dataset(tmp_path, n=2, extra=[{"prompt": "BADREQ here"}])
    with FakeSGLang() as srv:
        with pytest.raises(ValueError, match="HTTP 400"):
            collect(load_prompts(path), _cfg(srv.url), tmp_path / "t.npz", progress=False)
        assert srv.received["BADREQ here"] == 1


def test_server_without_routed_experts_stops_early(tmp_path):
    path, _ = _dataset(tmp_path, n=40)
    with FakeSGLang(return_experts=False) as srv:
        with pytest.raises(ValueError, match="enable-return-routed-experts"):
            collect(load_prompts(path), _cfg(srv.url, concurrency=2), tmp_path / "t.npz", progress=False)
        assert sum(srv.received.values()) < 40  # it did not send the whole dataset


def test_wrong_model_layout_is_reported(tmp_path):
    path, _ = _dataset(tmp_path, n=3)
    with FakeSGLang(hidden=5) as srv:  # the server's model has 5 hidden layers, we claim 6
        with pytest.raises(ValueError, match="not divisible|rows but prompt_tokens"):
            collect(load_prompts(path), _cfg(srv.url), tmp_path / "t.npz", progress=False)


def test_unreachable_server(tmp_path):
    path, _ = _dataset(tmp_path, n=2)
    srv = FakeSGLang()  # bound, never served: then closed, so the port refuses
    url = srv.url
    srv.server.server_close()
    with pytest.raises(ValueError, match="cannot reach"):
        collect(load_prompts(path), _cfg(url, retries=0), tmp_path / "t.npz", progress=False)


def test_load_prompts_formats(tmp_path):
    share = tmp_path / "sharegpt.json"
    share.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "hi there"},
                                      {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "second"}], "category": "chat"},
    ]))
    ps = load_prompts(share)
    assert [p.text for p in ps] == ["hi there", "second"] and ps[1].domain == "chat"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: record has none of"):
        load_prompts(bad)
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_prompts(bad)
    assert len(load_prompts(tmp_path / "sharegpt.json", limit=1)) == 1


def test_cli_collect_and_convert(tmp_path, capsys):
    path, recs = _dataset(tmp_path, n=5)
    out = tmp_path / "cli.npz"
    with FakeSGLang() as srv:
        rc = main(["collect", str(path), "--url", srv.url, "--out", str(out), "--format", "v1", "--num-hidden-layers", "6",
                   "--top-k", "2", "--num-experts", "8", "--first-k-dense-replace", "2",
                   "--max-new-tokens", str(MAX_NEW), "--no-progress", "--concurrency", "3"])
    assert rc == 0
    _check_trace(load_trace(out), recs)
    # errors are one clear line, exit code 1, nothing written
    rc = main(["collect", str(path), "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "x.npz"),
               "--num-hidden-layers", "6", "--top-k", "2", "--no-progress"])
    assert rc == 1 and "missing --num-experts" in capsys.readouterr().err
    # --from-file converts saved /generate responses
    resp = tmp_path / "resp.jsonl"
    resp.write_text(json.dumps({"meta_info": {"prompt_tokens": 2, "completion_tokens": 3,
                                              "routed_experts": encode_routed_experts(routing_for("a b", 3))}}) + "\n")
    rc = main(["collect", "--from-file", str(resp), "--out", str(tmp_path / "conv.npz"), "--num-hidden-layers", "6",
               "--top-k", "2", "--num-experts", "8"])
    assert rc == 0
    assert load_trace(tmp_path / "conv.npz").prefill_len.tolist() == [2]


def test_repeated_prompt_is_sent_once(tmp_path):
    path, recs = _dataset(tmp_path, n=4, extra=[{"prompt": "w0_0 w0_1", "domain": "d0"}])  # = record 0
    out = tmp_path / "trace.npz"
    with FakeSGLang() as srv:
        collect(load_prompts(path), _cfg(srv.url), out, progress=False)
        assert srv.received["w0_0 w0_1"] == 1
    _check_trace(load_trace(out), recs)


def test_damaged_checkpoint_lines_are_skipped_and_named(tmp_path, capsys):
    from eldr_sglang.traces.collect import _checkpoint_line

    path, recs = _dataset(tmp_path, n=4)
    out = tmp_path / "trace.npz"
    with FakeSGLang() as srv:  # a complete checkpoint of all four prompts
        collect(load_prompts(path), _cfg(srv.url), out, progress=False, keep_checkpoint=True)
    ckpt = checkpoint_path(out)
    lines = ckpt.read_bytes().splitlines(keepends=True)
    assert len(lines) == 4 and all(line[8:9] == b" " and line.endswith(b"\n") for line in lines)  # crc32, space, JSON
    assert _checkpoint_line({"key": "k", "response": {}}) == b"%08x " % zlib.crc32(b'{"key":"k","response":{}}') + b'{"key":"k","response":{}}\n'
    flipped = bytearray(lines[1])
    flipped[len(flipped) // 2] ^= 0x01  # one bit flipped by a crash: the checksum catches it
    ckpt.write_bytes(lines[0] + bytes(flipped) + b"\x00" * 64 + b"\n" + b"not json\n" + lines[2] + lines[3][:20])
    out.unlink()
    with FakeSGLang() as srv2:
        res = collect(load_prompts(path), _cfg(srv2.url), out, progress=False)
        assert sum(srv2.received.values()) == 2  # the flipped record and the torn one, sent again
    err = capsys.readouterr().err
    assert "skipped 3 damaged checkpoint line(s) (line 2, 4, 6)" in err
    assert res.reused == 2
    _check_trace(load_trace(out), recs)


def test_a_second_run_on_the_same_checkpoint_is_refused(tmp_path):
    from eldr_sglang.traces.collect import _CheckpointWriter

    path, _ = _dataset(tmp_path, n=2)
    out = tmp_path / "trace.npz"
    with _CheckpointWriter(checkpoint_path(out)):
        with pytest.raises(ValueError, match="in use by another eldr collect run"):
            collect(load_prompts(path), _cfg("http://127.0.0.1:9"), out, progress=False)

def test_collect_writes_v2_counts_and_the_decode_routing_asked_for(tmp_path, capsys):
    from eldr_sglang.traces.counts_file import open_counts_trace

    path, recs = _dataset(tmp_path, n=9)
    v1, v2 = tmp_path / "v1.npz", tmp_path / "v2.npz"
    with FakeSGLang() as srv:
        collect(load_prompts(path), _cfg(srv.url), v1, progress=False)
        res = collect_any(load_prompts(path), _cfg(srv.url), v2, progress=False, keep_decode=4)
    assert res.trace is None and res.requests == 9
    t1 = load_trace(v1)
    with open_counts_trace(v2) as t2:
        C = t2.counts().toarray()
        for r in range(9):  # the prompt counts of every request, by numpy from the v1 ids
            ids = t1.prefill_ids(r).astype(np.int64)
            want = np.bincount((np.arange(t1.num_layers)[None, :, None] * t1.num_experts + ids).ravel(),
                               minlength=t1.num_layers * t1.num_experts)
            np.testing.assert_array_equal(C[r], want)
        np.testing.assert_array_equal(t2.decode_len(), t1.decode_len())
        np.testing.assert_array_equal(t2.decode_requests(), np.arange(4))
        np.testing.assert_array_equal(t2.decode_trace().expert_ids, np.concatenate([t1.decode_ids(r) for r in range(4)]))
        np.testing.assert_array_equal(t2.domain, t1.domain)
        assert t2.counts_exact.all()


def test_collect_counts_only_reads_the_signature_payload(tmp_path):
    from eldr_sglang.traces.counts_file import open_counts_trace

    path, recs = _dataset(tmp_path, n=5)
    v1, v2 = tmp_path / "v1.npz", tmp_path / "v2.npz"
    with FakeSGLang() as srv:
        collect(load_prompts(path), _cfg(srv.url), v1, progress=False)
    with FakeSGLang(signature=True) as srv:
        cfg = _cfg(srv.url)
        cfg.routed_experts = False
        collect_any(load_prompts(path), cfg, v2, progress=False, keep_decode=0)
        assert not any(b.get("return_routed_experts") for b in srv.bodies)
    t1 = load_trace(v1)
    with open_counts_trace(v2) as t2:
        for r in range(5):
            ids = t1.prefill_ids(r).astype(np.int64)
            want = np.bincount((np.arange(t1.num_layers)[None, :, None] * t1.num_experts + ids).ravel(),
                               minlength=t1.num_layers * t1.num_experts)
            np.testing.assert_array_equal(t2.counts([r]).toarray()[0], want)
        assert t2.decode_requests().size == 0 and t2.counts_exact.all()
    with FakeSGLang() as srv:  # an unpatched server sends no payload: a clear error, nothing written
        cfg = _cfg(srv.url)
        cfg.routed_experts = False
        with pytest.raises(ValueError, match="no routed_experts"):
            collect_any(load_prompts(path), cfg, tmp_path / "x.npz", progress=False, keep_decode=0)
    assert not (tmp_path / "x.npz").exists()
