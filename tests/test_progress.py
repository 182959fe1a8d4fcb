"""eldr_sglang.progress: a tqdm bar on a terminal, a few plain lines elsewhere, nothing when off."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from eldr_sglang import progress as P


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    """A fake monotonic clock: each reading advances it by ``step`` seconds."""

    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def _lines(buf: io.StringIO) -> list[str]:
    return buf.getvalue().splitlines()


def test_terminal_gets_a_tqdm_bar():
    out = _Tty()
    with P.progress(100, desc="work", unit="req", file=out) as bar:
        for _ in range(100):
            bar.update(1)
    text = out.getvalue()
    assert "\r" in text and "work" in text and "100/100" in text


def test_pipe_gets_quarter_lines_not_frames():
    out = io.StringIO()
    with P.progress(100, desc="work", unit="req", file=out, interval_s=0) as bar:
        for _ in range(100):
            bar.update(1)
    lines = _lines(out)
    assert "\r" not in out.getvalue()
    assert [ln.split(" in ")[0] for ln in lines] == [
        "work: 25/100 req (25%)", "work: 50/100 req (50%)", "work: 75/100 req (75%)", "work: 100/100 req (100%)"]


def test_pipe_lines_are_rate_limited(monkeypatch):
    # Each clock reading is 1 s: a bar of 1000 single updates "takes" far longer than the
    # interval, yet prints at most one line per quarter plus none extra at close.
    monkeypatch.setattr(P, "_clock", _Clock(1.0))
    out = io.StringIO()
    with P.progress(1000, desc="sim", file=out, interval_s=5) as bar:
        for _ in range(1000):
            bar.update(1)
    assert 1 <= len(_lines(out)) <= 4
    assert _lines(out)[-1].startswith("sim: 1000/1000 it (100%)")


def test_quick_transient_bar_is_silent_on_a_pipe_and_a_kept_one_says_done():
    out = io.StringIO()
    with P.progress(10, desc="quick", file=out, leave=False, interval_s=1e9) as bar:
        bar.update(10)
    assert out.getvalue() == ""
    with P.progress(10, desc="kept", file=out, leave=True, interval_s=1e9) as bar:
        bar.update(10)
    assert len(_lines(out)) == 1 and _lines(out)[0].startswith("kept: 10/10 it (100%)")


def test_unknown_total_prints_every_interval(monkeypatch):
    monkeypatch.setattr(P, "_clock", _Clock(1.0))
    out = io.StringIO()
    with P.progress(desc="synth", unit="tok", unit_scale=True, file=out, interval_s=10) as bar:
        for _ in range(100):
            bar.update(1000)
    lines = _lines(out)
    # ~2 clock readings per due update: one line per ~10 s over ~200 s, and the closing line
    assert 5 <= len(lines) <= 25, lines
    assert lines[-1].startswith("synth: 100k tok")


def test_status_line(monkeypatch):
    monkeypatch.setattr(P, "_clock", _Clock(1.0))
    tty = _Tty()
    with P.status_line(desc="fit", file=tty) as line:
        line.status("k-means iter 1")
        line.status("k-means iter 2")
    assert "\r" in tty.getvalue() and "k-means iter 2" in tty.getvalue()

    out = io.StringIO()
    with P.status_line(desc="fit", file=out, interval_s=10) as line:
        for it in range(100):
            line.status(f"k-means iter {it}")
    lines = _lines(out)
    assert "\r" not in out.getvalue()
    assert 5 <= len(lines) <= 11, lines  # about one per 10 s of a 100 s run
    assert lines[-1] == "fit: k-means iter 99"  # the last state is always shown once anything was


def test_disabled_writes_nothing_anywhere():
    for out in (_Tty(), io.StringIO()):
        with P.progress(10, desc="off", file=out, enabled=False) as bar:
            bar.update(10)
        with P.status_line(desc="off", file=out, enabled=False) as line:
            line.status("x")
        assert out.getvalue() == ""


@pytest.mark.parametrize("flag", [[], ["--no-progress"]])
def test_demo_piped_to_a_file_has_no_bar_frames(tmp_path, flag):
    """`eldr demo` with stdout and stderr redirected to a file: no carriage-return frames and a
    bounded number of stderr lines (the demo's own step lines plus a few progress lines)."""
    pytest.importorskip("eldr_sglang._core")
    log = tmp_path / "demo.log"
    err = tmp_path / "demo.err"
    with open(log, "w") as fo, open(err, "w") as fe:
        rc = subprocess.run(
            [sys.executable, "-m", "eldr_sglang", "demo", "--out", str(tmp_path / "out"), "--model", "gpt-oss-20b",
             "--hardware", "h100", "--workers", "2", "--requests", "90", "--output-len", "12",
             "--concurrency", "4,8", *flag],
            stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120"}, timeout=600,
        ).returncode
    out_text, err_text = log.read_bytes().decode(), err.read_bytes().decode()  # read_text would turn '\r' into '\n'
    assert rc == 0, err_text
    assert "ELDR demo" in out_text
    assert "\r" not in out_text + err_text
    err_lines = err_text.splitlines()
    if flag:
        assert err_lines == [], err_lines
    else:
        assert any(ln.startswith("[1/4]") for ln in err_lines) and any(ln.startswith("[4/4]") for ln in err_lines)
        # 4 step lines, one per load, a few fit lines; at most 5 lines per bar were it slow
        assert len(err_lines) <= 40, err_text
