"""The emulator refuses bad flags up front with one argparse line and exit status 2. Before,
`--base-port 70000` was reported as 70000 while the socket took it modulo 65536 (4464), and
`--max-running-requests 0` started a decode worker that never served."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")

CLUSTER = ["cluster", "--trace", "t.npz"]
DECODE = ["decode", "--trace", "t.npz", "--port", "31010"]
PREFILL = ["prefill", "--trace", "t.npz", "--port", "31000", "--bootstrap-port", "31100"]
CASES = [
    (CLUSTER + ["--base-port", "70000"], "--base-port: must be an integer 1..65535, got 70000"),
    (CLUSTER + ["--base-port", "0"], "--base-port: must be an integer 1..65535"),
    (CLUSTER + ["--base-port", "65500"], "--base-port: 65500 puts the last worker on port 65601, above 65535"),
    (CLUSTER + ["--base-port", "31000", "--prefill", "11"], "--prefill: must be an integer 0..10"),
    (CLUSTER + ["--base-port", "31000", "--decode", "91"], "--decode: must be an integer 0..90"),
    (DECODE + ["--max-running-requests", "0"], "--max-running-requests: must be an integer 1..1048576, got 0"),
    (DECODE + ["--time-scale", "0"], "--time-scale: must be a finite number > 0"),
    (DECODE + ["--time-scale", "nan"], "--time-scale: must be a finite number > 0"),
    (DECODE + ["--bootstrap-timeout-secs", "-1"], "--bootstrap-timeout-secs: must be a finite number > 0"),
    (["decode", "--trace", "t.npz", "--port", "65536"], "--port: must be an integer 1..65535"),
    (PREFILL[:-1] + ["31000"], "--bootstrap-port: must differ from --port"),
]


@pytest.mark.parametrize("argv, msg", CASES, ids=[" ".join(a[3:]) or a[0] for a, _ in CASES])
def test_bad_emulator_flag_is_one_line_and_exit_2(argv, msg, tmp_path):
    # a subprocess with a timeout: a flag that is not refused starts a server that never returns
    try:
        r = subprocess.run([sys.executable, "-m", "eldr_sglang.emulate", *argv], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} was accepted: the emulator started")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"python -m eldr_sglang.emulate {argv[0]}: error: argument "), r.stderr
    assert msg in last, r.stderr
