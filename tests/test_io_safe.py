"""Writers never destroy what stands at their output path (eldr_sglang.io_safe and the CLI
commands that use it): non-regular destinations, outputs equal to inputs, full disks,
interrupted demo re-runs."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid

import numpy as np
import pytest

from eldr_sglang import io_safe
from eldr_sglang.cli import main as eldr


def _listing(d):
    return sorted(p.name for p in d.iterdir())


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small synthetic trace and a 2-worker fit of it."""
    d = tmp_path_factory.mktemp("io")
    t, c = d / "t.npz", d / "c.eldr"
    assert eldr(["synth", "--model", "gpt-oss-20b", "--requests", "80", "--prompt-len", "16,32", "--output-len", "4",
                 "--out", str(t), "--no-progress", "--format", "v1"]) == 0  # v1: simulate and refit replay tokens
    assert eldr(["fit", str(t), "--workers", "2", "--out", str(c), "--restarts", "1", "--max-iter", "5", "-q"]) == 0
    return t, c


def test_non_regular_destinations_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target"
    target.write_text("keep me")
    link = tmp_path / "link"
    link.symlink_to(target)
    sub = tmp_path / "sub"
    sub.mkdir()
    for path, kind in [(fifo, "a FIFO"), (link, "a symlink"), (sub, "a directory"), ("/dev/null", "a character device")]:
        with pytest.raises(io_safe.UnsafeOutputError, match=f"refusing to write over {kind}"):
            io_safe.write_text(path, "x")
    assert link.is_symlink() and target.read_text() == "keep me"
    assert _listing(tmp_path) == ["fifo", "link", "sub", "target"]
    # a regular file is replaced whole
    io_safe.write_json({"a": float("nan"), "b": np.float32(1.5), "c": np.arange(2)}, target)
    assert json.loads(target.read_text()) == {"a": None, "b": 1.5, "c": [0, 1]}


def test_cli_refuses_device_and_symlink_outputs(small, tmp_path, capsys):
    t, c = small
    link = tmp_path / "link.eldr"
    link.symlink_to(c)
    before = c.read_bytes()
    for out in ("/dev/null", str(link)):
        assert eldr(["fit", str(t), "--workers", "2", "--out", out, "-q"]) == 1
        err = capsys.readouterr().err
        assert "refusing to write over a" in err and "Traceback" not in err, err
    assert link.is_symlink() and c.read_bytes() == before
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["fit", "{t}", "--workers", "2", "--out", "{t}"], "--out {t} is the same file as the trace"),
        (["fit", "{t}", "--workers", "2", "--out", "{x}", "--json", "{x}"], "is the same file as --"),
        (["fit", "{t}", "--workers", "2", "--out", "{o}", "--json", "{t}"], "--json {t} is the same file as the trace"),
        (["simulate", "--trace", "{t}", "--centroids", "{c}", "--json", "{c}"], "--json {c} is the same file as --centroids"),
        (["simulate", "--trace", "{t}", "--centroids", "{c}", "--plot", "{t}"], "--plot {t} is the same file as --trace"),
        (["simulate", "--trace", "{t}", "--centroids", "{c}", "--json", "{x}", "--plot", "{x}"], "is the same file as --"),
        (["refit", "{c}", "--trace", "{t}", "--out", "{t}"], "--out {t} is the same file as --trace"),
        (["collect", "--from-file", "{t}", "--model", "gpt-oss-20b", "--out", "{t}"], "is the same file as --from-file"),
    ],
)
def test_outputs_equal_to_inputs_are_refused_before_any_work(small, tmp_path, capsys, argv, message):
    t, c = small
    # the same file under another name: a hard link
    alias = tmp_path / "alias.npz"
    os.link(t, alias)
    subs = {"t": str(t), "c": str(c), "x": str(tmp_path / "x.out"), "o": str(tmp_path / "o.eldr")}
    before = (t.read_bytes(), c.read_bytes())
    assert eldr([a.format(**subs) for a in argv]) == 1
    err = capsys.readouterr().err
    assert message.format(**subs) in err and "Traceback" not in err, err
    assert (t.read_bytes(), c.read_bytes()) == before
    assert not (tmp_path / "x.out").exists() and not (tmp_path / "o.eldr").exists()
    # a hard link to the trace is the same file too
    assert eldr(["fit", str(alias), "--workers", "2", "--out", str(t), "-q"]) == 1
    assert "is the same file as the trace" in capsys.readouterr().err
    assert t.read_bytes() == before[0]


def test_a_failing_write_leaves_no_temporary_file_and_the_old_file_intact(tmp_path, monkeypatch):
    dest = tmp_path / "r.json"
    dest.write_text('{"old": true}\n')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io_safe.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        io_safe.write_json({"new": 1}, dest)
    assert dest.read_text() == '{"old": true}\n' and _listing(tmp_path) == ["r.json"]


def test_fit_json_is_not_left_behind_when_the_centroid_write_fails(small, tmp_path, monkeypatch, capsys):
    from eldr_sglang.offline import fit as offline_fit

    t, _ = small

    def boom(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offline_fit.FitResult, "write", boom)
    assert eldr(["fit", str(t), "--workers", "2", "--out", str(tmp_path / "c.eldr"), "--json", str(tmp_path / "f.json"),
                 "--restarts", "1", "--max-iter", "3", "-q"]) == 1
    assert "No space left" in capsys.readouterr().err
    assert _listing(tmp_path) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs: a real full disk. Needs mount rights (root in a container that allows
    it); skipped where mounting is not permitted."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_simulate_json_on_a_full_disk_leaves_nothing_truncated(small, tiny_tmpfs, capsys):
    t, c = small
    (tiny_tmpfs / "fill").write_bytes(b"\0" * (60 << 10))
    old = tiny_tmpfs / "sim.json"
    old.write_text('{"old": true}\n')
    big = {"policies": {"x": list(range(20000))}}
    with pytest.raises(OSError) as exc:
        io_safe.write_json(big, old)
    assert exc.value.errno == errno.ENOSPC
    assert old.read_text() == '{"old": true}\n' and _listing(tiny_tmpfs) == ["fill", "sim.json"]
    (tiny_tmpfs / "fill").unlink()
    (tiny_tmpfs / "fill").write_bytes(b"\0" * (56 << 10))
    rc = eldr(["simulate", "--trace", str(t), "--centroids", str(c), "--concurrency", "4", "--no-progress",
               "--json", str(old)])
    err = capsys.readouterr().err
    assert rc == 1 and "No space left" in err and "Traceback" not in err, err
    assert old.read_text() == '{"old": true}\n' and _listing(tiny_tmpfs) == ["fill", "sim.json"]


def _demo(out, **kw):
    return eldr(["demo", "--out", str(out), "--model", "gpt-oss-20b", "--hardware", "h100", "--workers", "2",
                 "--requests", "60", "--output-len", "6", "--concurrency", "4", "--taus", "", "--no-progress",
                 "--seed", str(kw.get("seed", 0))])


def test_interrupted_demo_rerun_keeps_the_previous_run_whole(tmp_path, monkeypatch, capsys):
    from eldr_sglang.cli import demo

    out = tmp_path / "demo-out"
    assert _demo(out) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) == {"results.json", "results.md", "centroids.eldr", "manifest.json"} | (
        {"tpot_vs_load.png", "policies.png"} & set(first))
    real_run = demo._run

    def interrupted(args, stage, *a):
        real_run(args, stage, *a)  # the new run's files are all written ...
        raise KeyboardInterrupt  # ... and Ctrl-C arrives before the swap

    monkeypatch.setattr(demo, "_run", interrupted)
    assert _demo(out, seed=1) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert _listing(tmp_path) == ["demo-out"]  # no staging directory left
    monkeypatch.setattr(demo, "_run", real_run)
    assert _demo(out, seed=1) == 0
    second = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(second) == set(first) and second["centroids.eldr"] != first["centroids.eldr"]
    assert json.loads(second["manifest.json"])["seed"] == 1
    assert _listing(tmp_path) == ["demo-out"]
    # a directory holding someone else's files is not swept away
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert _demo(mine) == 1
    assert "holds files this command does not write (notes.txt)" in capsys.readouterr().err
    assert _listing(mine) == ["notes.txt"]


def test_refit_keeps_the_previous_file(small, tmp_path):
    t, c = small
    live = tmp_path / "live.eldr"
    live.write_bytes(c.read_bytes())
    original = live.read_bytes()
    assert eldr(["refit", str(live), "--trace", str(t)]) == 0
    prev = tmp_path / "live.eldr.prev"
    assert prev.read_bytes() == original and live.read_bytes() != original
    second = live.read_bytes()
    assert eldr(["refit", str(live), "--trace", str(t), "--seed", "1"]) == 0
    assert prev.read_bytes() == second
    assert _listing(tmp_path) == ["live.eldr", "live.eldr.prev"]


def test_same_file_compares_inodes_and_resolved_paths(tmp_path):
    a = tmp_path / "a"
    a.write_text("x")
    assert io_safe.same_file(a, tmp_path / "." / "a")
    assert io_safe.same_file(tmp_path / f"n{uuid.uuid4().hex}", tmp_path / "sub" / ".." / a.name) is False
    new = tmp_path / "new"
    assert io_safe.same_file(new, tmp_path / "." / "new")  # neither exists: the same path
