"""Trace format v2 (prompt counts first): v1 -> v2 conversion, streaming synth against the
in-memory generator, the fit from disk against the fit in memory, safe writes, bad files and
the up-front memory refusal."""

from __future__ import annotations

import struct
import zipfile

import numpy as np
import pytest

core = pytest.importorskip("eldr_sglang._core", reason="the Rust extension is not built")

from eldr_sglang import memory  # noqa: E402
from eldr_sglang.cli import main as eldr  # noqa: E402
from eldr_sglang.offline.fit import fit_trace  # noqa: E402
from eldr_sglang.traces import TraceError, load_trace, open_trace, save_trace, synth  # noqa: E402
from eldr_sglang.traces.counts_file import (  # noqa: E402
    CountsTrace,
    CountsTraceWriter,
    open_counts_trace,
    write_v1_as_counts,
)

KW = dict(requests=2300, domains=5, seed=7, prompt_len=(6, 30), output_len=(2, 6))


@pytest.fixture(scope="module")
def v1():
    return synth.generate("gpt-oss-20b", **KW)


def _counts_by_hand(t, r):
    """Request r's prompt counts as a flat [L*E] vector, by numpy (not the code under test)."""
    ids = t.prefill_ids(r).astype(np.int64)
    L, E = t.num_layers, t.num_experts
    return np.bincount((np.arange(L)[None, :, None] * E + ids).ravel(), minlength=L * E)


def test_v1_to_v2_round_trip(v1, tmp_path):
    out = tmp_path / "t2.npz"
    write_v1_as_counts(v1, out, keep_decode=900, chunk_requests=500)
    with open_counts_trace(out) as t:
        assert [c["requests"] for c in t.chunks] == [500] * 4 + [300]
        assert (t.num_requests, t.num_layers, t.num_experts, t.top_k) == (v1.num_requests, 24, 32, 4)
        np.testing.assert_array_equal(t.prefill_len, v1.prefill_len)
        np.testing.assert_array_equal(t.decode_len(), v1.decode_len())
        np.testing.assert_array_equal(t.domain, v1.domain)
        np.testing.assert_array_equal(t.arrival_s, v1.arrival_s)
        C = t.counts()
        for r in (0, 499, 500, 1234, v1.num_requests - 1):
            np.testing.assert_array_equal(C[r].toarray().ravel(), _counts_by_hand(v1, r))
        assert C.sum() == int(v1.prefill_len.sum()) * v1.num_layers * v1.top_k
        picked = t.counts([1800, 3, 501])  # any order, across chunks
        np.testing.assert_array_equal(picked.toarray(), C[[1800, 3, 501]].toarray())
        np.testing.assert_array_equal(t.decode_requests(), np.arange(900))
        d = t.decode_trace()
        np.testing.assert_array_equal(d.expert_ids, np.concatenate([v1.decode_ids(r) for r in range(900)]))
    with np.load(out) as z:  # stored as uint16 columns and counts (24 x 32 columns, short prompts)
        assert z["c0_index"].dtype == np.uint16 and z["c0_count"].dtype == np.uint16


def test_cli_convert_and_version_errors(tmp_path, capsys):
    src, out = tmp_path / "t1.npz", tmp_path / "t2.npz"
    save_trace(synth.generate("gpt-oss-20b", requests=40, prompt_len=(4, 8), output_len=3), src)
    assert eldr(["convert", str(src), "--out", str(out), "--keep-decode", "7"]) == 0
    assert "decode routing of 7" in capsys.readouterr().out
    assert isinstance(open_trace(out), CountsTrace)
    with pytest.raises(TraceError, match="a trace v2"):
        load_trace(out)  # v1 readers say what the file is, not "missing arrays"
    assert eldr(["convert", str(out), "--out", str(tmp_path / "t3.npz")]) == 1
    assert "a trace v2" in capsys.readouterr().err and not (tmp_path / "t3.npz").exists()
    assert eldr(["convert", str(src), "--out", str(src)]) == 1  # never over its own input
    assert "same file" in capsys.readouterr().err and load_trace(src).num_requests == 40


def test_streaming_synth_equals_in_memory_synth(v1, tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    synth.write_synth(a, "gpt-oss-20b", keep_decode=1500, **KW)  # two blocks with decode, one without
    synth.write_synth(b, "gpt-oss-20b", keep_decode=0, **KW)
    ref = tmp_path / "ref.npz"
    write_v1_as_counts(v1, ref, keep_decode=1500)
    with open_counts_trace(a) as ta, open_counts_trace(b) as tb, open_counts_trace(ref) as tr:
        assert (ta.counts() != tr.counts()).nnz == 0
        assert (tb.counts() != tr.counts()).nnz == 0  # keeping decode routing changes no prompt
        np.testing.assert_array_equal(ta.decode_trace().expert_ids, tr.decode_trace().expert_ids)
        np.testing.assert_array_equal(ta.domain, v1.domain)
        assert tb.decode_requests().size == 0 and ta.meta["synth"]["keep_decode"] == 1500
        with pytest.raises(TraceError, match="keeps no decode routing"):
            tb.decode_trace()


def _arrays(path):
    with np.load(path) as z:
        return {f: z[f] for f in z.files}


def test_parallel_synth_writes_the_same_trace(tmp_path):
    """Two worker processes over the blocks write the same arrays as one process (block i's
    draws depend only on the seed and i), in block order, with the same progress total."""
    import multiprocessing

    kw = dict(requests=9 * synth.RNG_BLOCK + 17, domains=4, seed=11, prompt_len=(3, 9), output_len=(1, 3),
              keep_decode=synth.RNG_BLOCK + 5)  # decode kept in the first two blocks only
    a, b = tmp_path / "one.npz", tmp_path / "two.npz"
    rows = {1: [], 2: []}
    synth.write_synth(a, "gpt-oss-20b", jobs=1, progress=rows[1].append, **kw)
    synth.write_synth(b, "gpt-oss-20b", jobs=2, progress=rows[2].append, **kw)
    za, zb = _arrays(a), _arrays(b)
    assert sorted(za) == sorted(zb) and len([f for f in za if f.startswith("c") and f.endswith("_count")]) == 10
    for name in za:
        np.testing.assert_array_equal(za[name], zb[name], err_msg=name)
    assert rows[1] == rows[2] and len(rows[2]) == 10
    with open_counts_trace(b) as t:
        assert t.decode_requests().size == synth.RNG_BLOCK + 5
        assert sum(rows[2]) == int(t.prefill_len.sum() + t.decode_len()[: 2 * synth.RNG_BLOCK].sum())  # rows drawn
    assert multiprocessing.active_children() == []


def test_parallel_synth_interrupted_leaves_nothing(tmp_path):
    """Ctrl-C in the parent (here raised from the progress callback after three blocks): no
    file at the output path, no staged file beside it, no worker left running; and what
    stood at the path is untouched."""
    import multiprocessing

    out = tmp_path / "t.npz"
    out.write_bytes(b"keep me")
    seen = []

    def interrupt(n):
        seen.append(n)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synth.write_synth(out, "gpt-oss-20b", requests=10 * synth.RNG_BLOCK, prompt_len=(3, 9), output_len=2,
                          jobs=2, progress=interrupt)
    assert out.read_bytes() == b"keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        synth.write_synth(tmp_path / "u.npz", "gpt-oss-20b", requests=10, jobs=0)


@pytest.mark.parametrize("layers", ["middle", "auto"])
def test_fit_from_disk_equals_fit_in_memory(v1, tmp_path, layers):
    path = tmp_path / "t2.npz"
    write_v1_as_counts(v1, path, chunk_requests=700)
    mem = fit_trace(v1, 4, layers=layers, seed=3, n_init=2, keep_signatures=True)
    with open_counts_trace(path) as t:
        disk = fit_trace(t, 4, layers=layers, seed=3, n_init=2, keep_signatures=True)
    np.testing.assert_array_equal(disk.assignment, mem.assignment)
    np.testing.assert_array_equal(disk.idf, mem.idf)
    np.testing.assert_array_equal(disk.layer_weights, mem.layer_weights)
    np.testing.assert_array_equal(disk.centroids, mem.centroids)
    assert abs(disk.signatures - mem.signatures).max() == 0
    for rep in (disk.report, mem.report):
        assert rep["kmeans"]["optimal_assignment"] and rep["balanced"]
    assert disk.report["cluster_sizes"] == mem.report["cluster_sizes"]
    assert disk.report["decode_locality"] == mem.report["decode_locality"]


def test_fit_from_disk_with_a_decode_subset_and_the_cli(v1, tmp_path, capsys):
    path = tmp_path / "t2.npz"
    write_v1_as_counts(v1, path, keep_decode=300)
    assert eldr(["fit", str(path), "--workers", "3", "--out", str(tmp_path / "c.eldr"), "-q", "--restarts", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    c = core.CentroidSet.open(str(tmp_path / "c.eldr"))
    assert c.num_workers == 3 and c.num_layers == v1.num_layers
    with open_counts_trace(path) as t:
        res = fit_trace(t, 3, seed=0, n_init=1)
    assert res.report["decode_locality"]["requests_with_decode"] <= 300
    none = tmp_path / "none.npz"
    write_v1_as_counts(v1, none, keep_decode=0)
    with open_counts_trace(none) as t:
        with pytest.raises(ValueError, match="--layers auto needs decode routing"):
            fit_trace(t, 3, layers="auto")
        assert fit_trace(t, 3, n_init=1).report["signature_rho"]["n_pairs"] == 0


def test_writer_never_destroys_the_output_on_failure(tmp_path):
    out = tmp_path / "t.npz"
    out.write_bytes(b"keep me")
    import scipy.sparse as sp

    with pytest.raises(TraceError, match="columns"):
        with CountsTraceWriter(out, num_layers=2, num_experts=4, top_k=1, meta={"model": "toy"}) as w:
            w.write_chunk(sp.csr_matrix(np.ones((3, 8))), [1, 1, 1], [0, 0, 0])
            w.write_chunk(sp.csr_matrix(np.ones((3, 7))), [1, 1, 1], [0, 0, 0])
    assert out.read_bytes() == b"keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]
    with pytest.raises(TraceError, match="non-negative integers"):
        with CountsTraceWriter(out, num_layers=2, num_experts=4, top_k=1) as w:
            w.write_chunk(sp.csr_matrix(np.full((1, 8), 0.5)), [1], [0])
    assert out.read_bytes() == b"keep me"


def test_bad_v2_files_are_clear_errors(v1, tmp_path):
    good = tmp_path / "g.npz"
    write_v1_as_counts(v1.subset(np.arange(50)), good, chunk_requests=20)
    bad = tmp_path / "b.npz"
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for item in zin.infolist():
            if item.filename != "c1_count.npy":
                zout.writestr(item, zin.read(item.filename))
    with open_counts_trace(bad) as t:
        t.chunk_counts(0)
        with pytest.raises(TraceError, match="'c1_count' is missing"):
            t.chunk_counts(1)
    flipped = tmp_path / "f.npz"  # one byte of chunk 1's counts changed: the member's CRC says so
    with zipfile.ZipFile(good) as zin:
        info = zin.getinfo("c1_count.npy")
    data = bytearray(good.read_bytes())
    name_len, extra_len = struct.unpack_from("<2H", data, info.header_offset + 26)  # the local header's
    at = info.header_offset + 30 + name_len + extra_len + info.file_size - 1  # last byte of the member
    data[at] ^= 0x01
    flipped.write_bytes(bytes(data))
    with open_counts_trace(flipped) as t:
        t.chunk_counts(0)
        with pytest.raises(TraceError, match="'c1_count' is corrupt"):
            t.chunk_counts(1)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="not a readable trace"):
        open_counts_trace(tmp_path / "junk.npz")
    with pytest.raises(TraceError, match="not found"):
        open_counts_trace(tmp_path / "missing.npz")


def test_streaming_synth_refuses_up_front_with_one_line(tmp_path, capsys):
    out = tmp_path / "t.npz"
    with pytest.raises(memory.InsufficientMemory, match="synth of 100000 requests needs at least"):
        synth.write_synth(out, "deepseek-v3", requests=100000, max_memory=64 << 20)
    assert not out.exists()
    assert eldr(["synth", "--model", "deepseek-v3", "--requests", "100000", "--out", str(out), "--max-memory", "64M"]) == 1
    err = capsys.readouterr().err
    assert "synth of 100000 requests needs at least" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # the streaming estimate does not grow with the tokens of requests it does not hold
    small = memory.streaming_synth_bytes(100000, 400 * 1024, 58, 8, 256, 1024)
    assert small < 1 << 30 < memory.synth_bytes(100000, 600, 58, 8, 256)


def test_counts_above_uint16_are_kept_exactly(tmp_path):
    import scipy.sparse as sp

    out = tmp_path / "big.npz"
    with CountsTraceWriter(out, num_layers=1, num_experts=4, top_k=1, meta={"model": "toy"}) as w:
        w.write_chunk(sp.csr_matrix(np.array([[70000, 0, 3, 0]])), [70003], [0])  # a 70k-token prompt
        w.write_chunk(sp.csr_matrix(np.array([[1, 2, 0, 0]])), [3], [0])
    with np.load(out) as z:
        assert z["c0_count"].dtype == np.uint32 and z["c1_count"].dtype == np.uint16
    with open_counts_trace(out) as t:
        np.testing.assert_array_equal(t.counts().toarray(), [[70000, 0, 3, 0], [1, 2, 0, 0]])


def _flip_member_byte(src, member, dst):
    """Copy `src` to `dst` with one byte in the middle of ZIP member `member`'s data flipped."""
    with zipfile.ZipFile(src) as z:
        info = z.getinfo(member)
    data = bytearray(src.read_bytes())
    name_len, extra_len = struct.unpack_from("<2H", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_len + extra_len + info.compress_size // 2] ^= 0x01
    dst.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def trace_files(v1, tmp_path_factory):
    d = tmp_path_factory.mktemp("corrupt")
    small = v1.subset(np.arange(300))
    save_trace(small, d / "v1.npz")
    write_v1_as_counts(small, d / "v2.npz", chunk_requests=100)
    assert eldr(["fit", str(d / "v2.npz"), "--workers", "2", "--out", str(d / "c.eldr"), "-q", "--restarts", "1"]) == 0
    return d


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_flipped_byte_in_any_trace_member_is_a_clear_error(trace_files, tmp_path, capsys, version):
    """Every member a command reads up front (the per-request arrays, meta_json, v1's ids):
    one flipped byte fails its ZIP CRC, and fit, simulate, refit and drift-check each stop with
    one line naming the file and the member, never a zipfile traceback."""
    good = trace_files / f"{version}.npz"
    cents = str(trace_files / "c.eldr")
    with zipfile.ZipFile(good) as z:
        members = [n for n in z.namelist() if not n[0] in "cd" or not n[1].isdigit()]  # chunks: test above
    assert "meta_json.npy" in members and "prefill_len.npy" in members
    for member in members:
        bad = tmp_path / f"bad_{member}.npz"
        _flip_member_byte(good, member, bad)
        for argv in (["fit", str(bad), "--workers", "2", "--out", str(tmp_path / "o.eldr"), "-q"],
                     ["simulate", "--trace", str(bad), "--centroids", cents, "--requests", "20", "--no-progress"],
                     ["refit", cents, "--trace", str(bad), "--out", str(tmp_path / "r.eldr")],
                     ["drift-check", cents, "--trace", str(bad)]):
            assert eldr(argv) == 1, (member, argv[0])
            err = capsys.readouterr().err
            name = member.removesuffix(".npy")
            assert f"{bad}: member '{name}' is corrupt or truncated" in err, (member, argv[0], err)
            assert err.count(str(bad)) == 1 and len(err.strip().splitlines()) == 1, err


def test_a_failed_discard_still_removes_the_temporary_file(tmp_path, monkeypatch):
    """On a full disk the ZIP's close (which writes the central directory) raises too: the
    staged file must go all the same, and the write's own error is the one that surfaces."""
    import scipy.sparse as sp

    def full(*a, **k):
        raise OSError(28, "No space left on device (central directory)")

    out = tmp_path / "t.npz"
    with pytest.raises(OSError, match=r"No space left on device \(chunk\)"):  # the write's error, not close's
        with CountsTraceWriter(out, num_layers=2, num_experts=4, top_k=1) as w:
            w.write_chunk(sp.csr_matrix(np.ones((3, 8))), [1, 1, 1], [0, 0, 0])
            monkeypatch.setattr(w._zip, "close", full)
            raise OSError(28, "No space left on device (chunk)")
    assert list(tmp_path.iterdir()) == []
    # the disk fills while close() writes the last member: the same
    with pytest.raises(OSError, match="central directory"):
        with CountsTraceWriter(out, num_layers=2, num_experts=4, top_k=1) as w:
            w.write_chunk(sp.csr_matrix(np.ones((3, 8))), [1, 1, 1], [0, 0, 0])
            monkeypatch.setattr(w._zip, "close", full)
    assert list(tmp_path.iterdir()) == []
