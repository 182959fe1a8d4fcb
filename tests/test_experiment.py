"""`eldr experiment report` on constructed switchback runs whose answer is known."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from eldr_sglang import experiment as X
from eldr_sglang.cli import main as eldr


def _blocks(rng, ratio: float, per_arm: int = 10, block_sd: float = 0.04) -> list[X.Block]:
    """Alternating arms in a random order; arm 'a' has `ratio` times arm 'b''s TPOT level,
    each block's level drawn log-normally around its arm's."""
    arms = rng.permutation(["a"] * per_arm + ["b"] * per_arm)
    out = []
    for i, arm in enumerate(arms):
        level = 0.010 * (ratio if arm == "a" else 1.0) * math.exp(rng.normal(0, block_sd))
        out.append(X.Block(i, str(arm), 50, level, level * 1.05))
    return out


def test_a_known_effect_is_found_and_its_interval_covers_it():
    blocks = _blocks(np.random.default_rng(1), 0.90)
    res = X.report(blocks, ("a", "b"), confidence=0.95)
    assert res["ci_low"] < -0.10 < res["ci_high"] < 0  # a's TPOT is 10 % lower, and the interval says so
    assert res["diff_p50"] == res["p50"]["diff"] and res["blocks"] == 20 and res["p50"]["blocks"] == [10, 10]
    flipped = X.report(blocks, ("b", "a"))
    assert math.isclose((1 + flipped["diff_p50"]) * (1 + res["diff_p50"]), 1.0)
    # without --arms, a run of exactly two arms compares them in order of appearance
    assert X.report(blocks)["arms"] == list(dict.fromkeys(k.arm for k in blocks))


def test_no_effect_interval_covers_zero_at_about_its_confidence():
    """500 runs with equal arms: the 90 % interval holds zero in about 90 % of them (a wrong
    variance, degrees of freedom or scale would move that far off)."""
    rng = np.random.default_rng(7)
    held = 0
    for _ in range(500):
        r = X.compare(_blocks(rng, 1.0, per_arm=6), ("a", "b"), "p50", confidence=0.90)
        held += r["ci_low"] <= 0 <= r["ci_high"]
    assert 0.86 <= held / 500 <= 0.94, held


def test_blocks_needed_matches_the_normal_approximation():
    # s = 0.05, 5 %: 2 (1.95996 + 0.84162)^2 0.05^2 / log(1.05)^2 = 16.6 -> 17 blocks per arm
    assert X.blocks_needed(0.05, 0.05) == 17
    assert X.blocks_needed(0.05, 0.10) < X.blocks_needed(0.05, 0.05) < X.blocks_needed(0.05, 0.02)
    with pytest.raises(ValueError):
        X.blocks_needed(0.05, 0.0)


def _requests(rng, blocks, warm_s=5.0, warm_factor=3.0):
    recs = []
    for k in blocks:
        for i in range(40):
            t = i * 0.5
            tp = k.p50 * math.exp(rng.normal(0, 0.05)) * (warm_factor if t < warm_s else 1.0)
            recs.append({"block": k.block, "arm": k.arm, "t_s": t, "tpot_s": tp})
        recs.append({"block": k.block, "arm": k.arm, "t_s": 30.0, "tpot_s": None})  # one output token: no TPOT
    return recs


def test_warmup_requests_are_dropped_from_each_block(tmp_path, capsys):
    """Every block's first 5 s run at 3x TPOT only after arm 'a''s blocks (the previous arm's
    requests still decoding): kept, they bias the answer; dropped, it is back to the truth."""
    rng = np.random.default_rng(3)
    blocks = _blocks(rng, 0.90)
    recs = []
    for r in _requests(rng, blocks, warm_factor=1.0):
        if r["arm"] == "a" and r["tpot_s"] is not None and r["t_s"] < 5.0:
            r["tpot_s"] *= 3.0
        recs.append(r)
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    out = tmp_path / "r.json"
    assert eldr(["experiment", "report", str(path), "--arms", "a,b", "--warmup", "5", "--json", str(out),
                 "--plot", str(tmp_path / "r.png")]) == 0
    res = json.loads(out.read_text())
    assert res["ci_low"] < -0.10 < res["ci_high"] and res["ci_high"] < 0
    assert res["mean"]["ci_low"] < -0.10 < res["mean"]["ci_high"]
    assert all(b["dropped"] == 10 for b in res["per_block"]) and all(b["n"] == 30 for b in res["per_block"])
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TPOT  p50: a vs b" in capsys.readouterr().out
    # the same run without the warm-up dropped: arm a looks much worse than it is
    assert eldr(["experiment", "report", str(path), "--arms", "a,b", "--json", str(out)]) == 0
    kept = json.loads(out.read_text())
    assert kept["mean"]["diff"] > 0.2 and kept["diff_p50"] > -0.09  # the mean most: 1/4 of a's requests at 3x
    # flagged warm-up requests are dropped whatever --warmup says
    for r in recs:
        r["warmup"] = r["t_s"] < 5.0
    path.write_text("\n".join(json.dumps(r) for r in recs))
    assert eldr(["experiment", "report", str(path), "--arms", "a,b", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ci_low"] < -0.10 < json.loads(out.read_text())["ci_high"]


def test_block_records_and_a_json_object_are_read_too(tmp_path):
    blocks = _blocks(np.random.default_rng(5), 1.2)
    recs = [{"block": k.block, "arm": k.arm, "tpot_p50_s": k.p50, "tpot_mean_s": k.mean, "n": k.n} for k in blocks]
    p = tmp_path / "blocks.json"
    p.write_text(json.dumps({"blocks": recs}))
    kind, got = X.load_records(p)
    assert kind == "blocks" and len(got) == 20
    blocks, left_out = X.blocks_from_records(got)
    assert left_out == []
    res = X.report(blocks, ("a", "b"))
    assert res["ci_low"] < 0.2 < res["ci_high"] and res["ci_low"] > 0


def _router_json(blocks):
    """GET /eldr/experiment's body for these blocks (rust/dataplane/src/experiment.rs), with a
    block that has no TPOT yet and the current block, still running."""
    recs = [{"block": k.block, "arm": k.arm, "start_unix_s": 1e9 + k.block, "end_unix_s": 1e9 + k.block + 1,
             "complete": True, "requests": k.n + 3, "warmup_n": 3, "inflight": 0, "n": k.n,
             "tpot_p50_s": k.p50, "tpot_mean_s": k.mean} for k in blocks]
    nb = len(blocks)
    recs.append({"block": nb, "arm": "a", "complete": True, "requests": 0, "warmup_n": 0, "n": 0,
                 "tpot_p50_s": None, "tpot_mean_s": None})
    recs.append({"block": nb + 1, "arm": "b", "complete": False, "requests": 9, "warmup_n": 0, "n": 9,
                 "tpot_p50_s": 0.5, "tpot_mean_s": 0.5})
    return {"experiment": {"arms": ["a", "b"], "block": nb + 1, "arm": "b"}, "blocks": recs}


def test_the_routers_experiment_json_is_read_from_a_file_and_a_url(tmp_path, capsys):
    """The router's own per-block JSON: saved to a file or read live with --url. Blocks without
    a TPOT or still running are left out, and each block's warm-up count is carried."""
    import http.server
    import threading

    blocks = _blocks(np.random.default_rng(5), 1.2)
    body = json.dumps(_router_json(blocks)).encode()
    p = tmp_path / "experiment.json"
    p.write_bytes(body)
    kind, got = X.load_records(p)
    kept, left_out = X.blocks_from_records(got, min_requests=5)
    assert kind == "blocks" and len(kept) == 20 and left_out == [20, 21]
    assert all(k.dropped == 3 for k in kept)
    expect = X.report(kept, ("a", "b"))

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/eldr/experiment"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if ok else b"{}")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        out = tmp_path / "r.json"
        assert eldr(["experiment", "report", "--url", url, "--arms", "a,b", "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["diff_p50"] == pytest.approx(expect["diff_p50"]) and res["blocks_left_out"] == [20, 21]
        assert "2 blocks left out" in capsys.readouterr().out
        assert eldr(["experiment", "report", str(p), "--arms", "a,b"]) == 0  # the saved copy, the same answer
        assert f"{expect['diff_p50']:+.2%}" in capsys.readouterr().out
    finally:
        srv.shutdown()
    # a router that is not there, a bad URL, and both or neither input: one-line errors
    for argv, msg in ((["--url", url], "eldr/experiment: "), (["--url", "127.0.0.1:1"], "expected the router's base URL"),
                      ([str(p), "--url", url], "not both"), ([], "not both")):
        assert eldr(["experiment", "report", *argv]) == 1
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("text, msg", [
    ('{"block": 0, "arm": "a", "tpot_s": 0.01}\n{"block": 0, "arm": "b", "tpot_s": 0.01}\n', "two arms"),
    ('{"block": 0, "arm": "a", "tpot_s": -1}\n', "'tpot_s' must be a positive finite number"),
    ('{"block": -1, "arm": "a", "tpot_s": 0.01}\n', "'block' must be an integer >= 0"),
    ('{"block": 0, "arm": "a", "tpot_s": 0.01}\nnot json\n', "line 2 is not JSON"),
    ('{"block": 0, "arm": "a", "tpot_s": 0.01}\n{"block": 1, "arm": "b", "tpot_s": 0.01}\n', "needs at least 2 per arm"),
    ("", "no records"),
    ('{"block": 0, "arm": "a", "tpot_s": 0.01}\n{"block": 1, "arm": "b", "tpot_s": 0.01}\n'
     '{"block": 2, "arm": "c", "tpot_s": 0.01}\n', "3 arms"),
])
def test_bad_runs_are_one_line_errors(tmp_path, capsys, text, msg):
    p = tmp_path / "run.jsonl"
    p.write_text(text)
    assert eldr(["experiment", "report", str(p), "--min-requests", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("eldr experiment: error: ") and msg in err and len(err.strip().splitlines()) == 1, err


def test_unknown_arm_and_bad_flags(tmp_path, capsys):
    p = tmp_path / "run.jsonl"
    p.write_text('{"block": 0, "arm": "a", "tpot_s": 0.01}\n')
    assert eldr(["experiment", "report", str(p), "--arms", "a,x", "--min-requests", "1"]) == 1
    assert "arm 'x' is not in the run" in capsys.readouterr().err
    assert eldr(["experiment", "report", str(p), "--arms", "a,a"]) == 1
    assert "two different arms" in capsys.readouterr().err
    for flag in (["--warmup", "-1"], ["--confidence", "1"], ["--min-requests", "0"]):
        with pytest.raises(SystemExit) as e:
            eldr(["experiment", "report", str(p), *flag])
        assert e.value.code == 2


_BLOCK = '{"block": %d, "arm": "%s", "tpot_p50_s": 0.01, "tpot_mean_s": 0.01, "n": %s}'
_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text, msg", [
    ("\n".join(_BLOCK % (i, "ab"[i % 2], "1e999" if i == 2 else "9") for i in range(6)), "record 3: 'n' must be an integer"),
    ("\n".join(_BLOCK % (i, "ab"[i % 2], "[1]" if i == 0 else "9") for i in range(6)), "record 1: 'n' must be an integer"),
    ('{"blocks": [%s]}' % (_BLOCK % (0, "a", "[1]")), "blocks[0]: 'n' must be an integer"),
    ('{"blocks": [%s]}' % (_BLOCK % (0, "a", "9")).replace('"n"', '"warmup_n": 1e999, "n"'), "'warmup_n' must be an integer"),
    ('{"blocks": %s}' % _DEEP, "nested too deeply"),
    (_DEEP + "\n", "line 1 is nested too deeply"),
    ('{"block": 0, "arm": "a", "tpot_s": 0.01, "x": %s}\n' % _DEEP, "line 1 is nested too deeply"),
])
def test_odd_json_is_one_line_naming_the_field_from_a_file_and_a_url(tmp_path, capsys, text, msg):
    """`"n": 1e999` (inf), `"n": [1]` and JSON nested past Python's recursion limit: one line
    naming the record and field, never a traceback, read from a file or from --url."""
    p = tmp_path / "run.jsonl"
    p.write_text(text)
    assert eldr(["experiment", "report", str(p)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("eldr experiment: error: ") and msg in err and len(err.strip().splitlines()) == 1, err
    with _serve(lambda h: _answer(h, text.encode())) as url:
        assert eldr(["experiment", "report", "--url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("eldr experiment: error: ") and msg in err and len(err.strip().splitlines()) == 1, err


def _answer(h, body: bytes, length: int | None = None) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body) if length is None else length))
    h.end_headers()
    h.wfile.write(body)


class _serve:
    """A loopback HTTP server answering every GET with `handle(handler)`."""

    def __init__(self, handle):
        import http.server

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                try:
                    handle(self)
                except OSError:
                    pass  # the client left

            def log_message(self, *a):
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True

    def __enter__(self) -> str:
        import threading

        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.srv.server_address[1]}"

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()


def _drip(h, stop, head: bool) -> None:
    """One byte every 0.5 s (each read well inside the per-read timeout), in the head or in
    the body, until the client leaves."""
    import time

    if not head:
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    data = (b"HTTP/1.1 200 OK\r\nX-Slow: " if head else b"") + b"x" * 100000
    for i in range(len(data)):
        if stop.is_set():
            return
        h.wfile.write(data[i:i + 1])
        h.wfile.flush()
        time.sleep(0.5)


@pytest.mark.parametrize("head", [False, True])
def test_url_has_an_overall_deadline(head):
    """A server that drips one byte at a time, each within the per-read timeout, in its
    answer's head or body: the fetch gives up at its overall deadline, not never."""
    import threading
    import time

    stop = threading.Event()
    with _serve(lambda h: _drip(h, stop, head)) as url:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=r"no complete answer within 2 s"):
            X.fetch_records(url, deadline_s=2.0)
        took = time.monotonic() - t0
        stop.set()
    assert 1.5 < took < 4.0, took


def test_url_answer_size_is_capped(capsys):
    """An answer over the cap is refused, whether it says its length up front or not, without
    being read whole; the CLI's cap is finite and one line names it."""
    big = b"[" + b"0," * 400_000 + b"0]"  # ~800 kB
    with _serve(lambda h: _answer(h, big)) as url:
        with pytest.raises(ValueError, match=r"larger than 0\.1 MB"):
            X.fetch_records(url, max_bytes=100_000)

    def unsized(h):  # no Content-Length: read until the cap
        h.protocol_version = "HTTP/1.0"
        h.send_response(200)
        h.end_headers()
        for _ in range(1000):
            h.wfile.write(big)

    with _serve(unsized) as url:
        with pytest.raises(ValueError, match=r"larger than 0\.1 MB"):
            X.fetch_records(url, max_bytes=100_000)
    assert 1 << 20 <= X.FETCH_MAX_BYTES <= 1 << 30 and 5 <= X.FETCH_DEADLINE_S <= 600
    with _serve(lambda h: _answer(h, b"", length=X.FETCH_MAX_BYTES + 1)) as url:
        assert eldr(["experiment", "report", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "larger than" in err and len(err.strip().splitlines()) == 1, err


def test_blocks_without_tpot_name_the_cause(tmp_path, capsys):
    """Non-streamed traffic: the router's blocks served requests but hold no TPOT (n = 0). The
    report says in one line that TPOT is measured on streamed requests only, not that the run
    has 0 arms."""
    recs = [{"block": b, "arm": "ab"[b % 2], "complete": True, "requests": 90 + b, "warmup_n": 3, "n": 0,
             "tpot_p50_s": None, "tpot_mean_s": None} for b in range(6)]
    p = tmp_path / "experiment.json"
    p.write_text(json.dumps({"experiment": {"arms": ["a", "b"]}, "blocks": recs}))
    for extra in ([], ["--arms", "a,b"]):
        assert eldr(["experiment", "report", str(p), *extra]) == 1
        err = capsys.readouterr().err
        assert "streamed requests only" in err and "0 arms" not in err and len(err.strip().splitlines()) == 1, err
