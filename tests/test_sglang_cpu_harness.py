"""The test-only CPU harness itself (eldr_sglang/testing/sglang_cpu), without starting SGLang."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import _sglang_cpu
from eldr_sglang.testing.pd_cluster import post

DRIVER_SYMBOLS = """cuInit cuDriverGetVersion cuDeviceGetCount cuDeviceGet cuDeviceGetAttribute cuCtxGetDevice
cuCtxSetCurrent cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease_v2 cuGetProcAddress cuGetProcAddress_v2
cuGetErrorString cuGetErrorName cuPointerGetAttribute cuPointerSetAttribute cuMemCreate cuMemRelease cuMemMap
cuMemUnmap cuMemSetAccess cuMemAddressReserve cuMemAddressFree cuMemGetAllocationGranularity
cuMemExportToShareableHandle cuMemImportFromShareableHandle cuMemRetainAllocationHandle
cuMemGetHandleForAddressRange cuMemGetAddressRange_v2""".split()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_libcuda_stub_builds_and_reports_no_device(tmp_path):
    import ctypes

    from eldr_sglang.testing.sglang_cpu.stub import build_libcuda_stub

    d = build_libcuda_stub(tmp_path)
    assert build_libcuda_stub(tmp_path) == d  # cached by the source's hash
    lib = ctypes.CDLL(str(d / "libcuda.so.1"))
    for name in DRIVER_SYMBOLS:
        getattr(lib, name)  # AttributeError if missing
    assert lib.cuInit(0) == 100  # CUDA_ERROR_NO_DEVICE
    msg = ctypes.c_char_p()
    assert lib.cuGetErrorString(100, ctypes.byref(msg)) == 0 and b"no CUDA-capable device" in msg.value


def test_overlay_patches_a_private_copy_never_the_install(tmp_path):
    from eldr_sglang import patching
    from eldr_sglang.testing.sglang_cpu.overlay import CPU_SHIM, build_overlay, installed_sglang
    from eldr_sglang.testing.sglang_cpu.stub import HarnessError

    try:
        src = installed_sglang()
    except HarnessError as exc:
        if _sglang_cpu.REQUIRE:
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    touched = [f for p in patching.read_series(CPU_SHIM) + patching.read_series(patching.default_series_dir())
               for f in patching.touched_files(p)]
    before = {f: (src.parent / f).read_bytes() for f in touched}
    root = build_overlay(tmp_path / "ov", cpu_shim=True, eldr=True)
    assert {s.state for s in patching.check(root, CPU_SHIM)[1]} == {"applied"}
    assert {s.state for s in patching.check(root)[1]} == {"applied"}
    assert "CPU-only test shim" in (root / "sglang/srt/disaggregation/prefill.py").read_text()
    assert all((src.parent / f).read_bytes() == b for f, b in before.items())  # the install is untouched
    assert (root / "sglang/__init__.py").is_symlink() and not (root / touched[0]).is_symlink()
    with pytest.raises(HarnessError, match="fresh directory"):
        build_overlay(root)


def test_missing_prerequisite_fails_under_ci_and_skips_otherwise(tmp_path, monkeypatch):
    from eldr_sglang.testing.sglang_cpu import harness
    from eldr_sglang.testing.sglang_cpu.stub import HarnessError

    def missing(*_a, **_k):
        raise HarnessError("sglang is not installed (pip install 'sglang==0.5.23')")

    monkeypatch.setattr(harness, "build_overlay", missing)
    monkeypatch.setattr(harness, "build_libcuda_stub", lambda d: d)
    monkeypatch.setattr(_sglang_cpu, "REQUIRE", True)
    with pytest.raises(pytest.fail.Exception, match="not installed.*must run"):
        _sglang_cpu.harness_or_skip(tmp_path)
    monkeypatch.setattr(_sglang_cpu, "REQUIRE", False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        _sglang_cpu.harness_or_skip(tmp_path)


def test_tiny_tokenizer_gives_every_model_id_text(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from eldr_sglang.testing.sglang_cpu import model

    model._tokenizer(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == model.VOCAB
    assert all(tok.decode([i]) for i in range(model.VOCAB))
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>hi<|end|><|assistant|>"


def test_tap_records_rooms_signatures_and_stream_ends():
    from eldr_sglang.testing.sglang_cpu.tap import Tap

    sig = {"v": 1, "layers": [0], "E": 2, "n": 1, "enc": "dense", "bits": 2, "d": "AQ=="}

    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self):
            json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for ev in ({"text": "", "meta_info": {"eldr_signature": [sig]}}, {"text": "a", "meta_info": {"n": 2}}):
                self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    tap = Tap("t", f"http://127.0.0.1:{srv.server_address[1]}")
    try:
        status, _, body = post(tap.url + "/generate", {"text": "x", "bootstrap_room": 7, "stream": True})
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        ev = {e["event"]: e for e in tap.snapshot()}
        assert ev["request"]["room"] == 7 and ev["request"]["prompt"] == "x"
        assert ev["signature"]["payload"] == [sig] and ev["signature"]["t"] > ev["request"]["t"]
        assert json.loads(ev["stream_end"]["last"][5:])["meta_info"] == {"n": 2}
    finally:
        tap.close()
        srv.shutdown()


def test_model_builder_cli_refuses_an_unknown_arch(tmp_path):
    p = subprocess.run([sys.executable, "-m", "eldr_sglang.testing.sglang_cpu.model", str(tmp_path / "m"), "--arch", "gpt2"],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert p.returncode == 2 and "invalid choice" in p.stderr


def test_servers_die_when_the_test_process_is_sigkilled(tmp_path):
    """A SIGKILLed pytest cannot run its finalizers; the servers it started must not outlive it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, time\n"
         "from pathlib import Path\n"
         "from eldr_sglang.testing.sglang_cpu.cluster import Server\n"
         f"s = Server('sleeper', ['-c', 'import time; time.sleep(600)'], 'http://127.0.0.1:1', Path({str(tmp_path / 'log')!r}), dict(os.environ))\n"
         "print(s.proc.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # it runs
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie reparented to init is reaped quickly; /proc state Z also counts as dead
        try:
            if open(f"/proc/{child}/stat").read().split(")")[1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"server process {child} outlived its SIGKILLed parent")
