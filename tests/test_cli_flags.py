"""Every numeric flag of every `eldr` command is checked by argparse before anything runs: a
negative, huge, NaN or infinite value is one clear error line naming the flag, exit status 2,
never a traceback or a NaN table with exit 0."""

from __future__ import annotations

import pytest

from eldr_sglang.cli import main as eldr

# (command and its required arguments, flag, bad values); a flag's own required value is
# put last so that it is the one argparse trips on.
BASE = {
    "synth": ["synth", "--model", "gpt-oss-20b", "--requests", "10", "--out", "x.npz"],
    "collect": ["collect", "--from-file", "r.json", "--model", "gpt-oss-20b", "--out", "x.npz"],
    "convert": ["convert", "t.npz", "--out", "x.npz"],
    "fit": ["fit", "t.npz", "--workers", "2", "--out", "c.eldr"],
    "inspect": ["inspect", "c.eldr"],
    "route-demo": ["route-demo"],
    "simulate": ["simulate", "--trace", "t.npz"],
    "demo": ["demo"],
    "refit": ["refit", "c.eldr", "--trace", "t.npz"],
    "drift-check": ["drift-check", "c.eldr", "--trace", "t.npz"],
}
HUGE_INT = str(10**30)
INTS = ["-1", HUGE_INT, "1.5", "nan"]
POS_REALS = ["-1", "nan", "inf", "-inf", "1e400"]
CASES = [
    ("synth", "--requests", ["0", "-5", HUGE_INT]),
    ("synth", "--domains", ["0", HUGE_INT]),
    ("synth", "--seed", ["-1", HUGE_INT]),
    ("synth", "--prompt-len", ["0", "-3", "512,128", HUGE_INT, "1,2,3"]),
    ("synth", "--output-len", ["0", HUGE_INT]),
    ("synth", "--burstiness", ["-0.1", "1.5", "nan"]),
    ("synth", "--rate", ["0", *POS_REALS]),
    ("collect", "--num-hidden-layers", ["0", HUGE_INT]),
    ("collect", "--top-k", ["0", HUGE_INT]),
    ("collect", "--num-experts", ["0", HUGE_INT]),
    ("collect", "--first-k-dense-replace", ["-1", HUGE_INT]),
    ("collect", "--moe-layers", ["3-1000000000", "-5", "x"]),
    ("collect", "--max-new-tokens", ["0", HUGE_INT]),
    ("collect", "--temperature", ["-1", "nan", "inf"]),
    ("collect", "--concurrency", ["0", HUGE_INT]),
    ("collect", "--timeout", ["0", *POS_REALS]),
    ("collect", "--retries", ["-1", HUGE_INT]),
    ("collect", "--limit", ["0", HUGE_INT]),
    ("fit", "--workers", ["0", *INTS]),
    ("fit", "--tau", ["-0.1", "nan", "inf", "3"]),
    ("fit", "--seed", ["-1", HUGE_INT]),
    ("fit", "--restarts", ["0", HUGE_INT]),
    ("fit", "--max-iter", ["0", HUGE_INT]),
    ("fit", "--tol", ["-1", "nan", "inf"]),
    ("fit", "--change-tol", ["-1", "1.5", "nan", "inf"]),
    ("fit", "--sample-growth", ["-1", "1.5", "nan", "inf", "1e400"]),
    ("inspect", "--top", ["-1", HUGE_INT]),
    ("route-demo", "--workers", ["0", HUGE_INT]),
    ("route-demo", "--requests", ["0", HUGE_INT]),
    ("route-demo", "--tau", ["nan", "-1"]),
    ("route-demo", "--seed", ["-1", HUGE_INT]),
    ("simulate", "--tau", ["nan", "-1", "inf"]),
    ("simulate", "--eldr-load-factor", ["nan", "-1", "inf"]),
    ("simulate", "--policies", ["eldr@nan", "eldr@-1", "eldr@inf", "eldr/nan", "eldr/-1"]),
    ("simulate", "--tp", ["-1", HUGE_INT]),
    ("simulate", "--workers", ["-1", HUGE_INT]),
    ("simulate", "--prefill-workers", ["-1", HUGE_INT]),
    ("simulate", "--max-running", ["0", HUGE_INT]),
    ("simulate", "--concurrency", ["0", "-4", "8,nan", HUGE_INT, ""]),
    ("simulate", "--rate", ["0", "nan", "1,inf", "-2"]),
    ("simulate", "--requests", ["-1", HUGE_INT]),
    ("simulate", "--output-len", ["-1", HUGE_INT]),
    ("simulate", "--offload-experts", ["-1", HUGE_INT]),
    ("simulate", "--seed", ["-1", HUGE_INT]),
    ("simulate", "--splits", ["0", "-1", HUGE_INT]),
    ("simulate", "--ep", ["0", "-1", HUGE_INT]),
    ("simulate", "--context-len", ["-1", HUGE_INT]),
    ("demo", "--workers", ["0", HUGE_INT]),
    ("demo", "--requests", ["0", HUGE_INT]),
    ("demo", "--fit-fraction", ["0", "1", "nan", "-0.5"]),
    ("demo", "--output-len", ["0", HUGE_INT]),
    ("demo", "--concurrency", ["0", "64,-1", "nan", ""]),
    ("demo", "--tau", ["nan", "-1"]),
    ("demo", "--eldr-load-factor", ["nan", "inf"]),
    ("demo", "--taus", ["nan", "0,-1", "0,inf"]),
    ("demo", "--seed", ["-1", HUGE_INT]),
    ("refit", "--seed", ["-1", HUGE_INT]),
    ("drift-check", "--window", ["0", HUGE_INT]),
    ("drift-check", "--d-shift", ["0", *POS_REALS]),
    ("drift-check", "--js", ["0", "2", "nan"]),
    ("drift-check", "--patience", ["0", HUGE_INT]),
    ("synth", "--max-memory", ["0", "-1", "x", "1e400"]),
    ("fit", "--max-memory", ["0", "-1G", "nan"]),
    ("simulate", "--max-memory", ["0", "inf"]),
    ("demo", "--max-memory", ["0", "x"]),
    ("synth", "--keep-decode", ["-1", HUGE_INT, "some"]),
    ("synth", "--jobs", ["0", "-1", HUGE_INT, "some"]),
    ("convert", "--keep-decode", ["-1", HUGE_INT]),
    ("convert", "--chunk-requests", ["0", HUGE_INT]),
]


@pytest.mark.parametrize("cmd, flag, bad", [(c, f, v) for c, f, vals in CASES for v in vals])
def test_bad_numeric_flag_is_one_line_and_exit_2(cmd, flag, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        eldr([*BASE[cmd], f"{flag}={bad}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"eldr {cmd}: error: argument {flag}"), err
    assert "Traceback" not in err


def test_every_numeric_flag_is_in_the_table():
    """A new int/float flag must come with bad values above."""
    import argparse

    from eldr_sglang.cli import build_parser

    covered = {(c, f) for c, f, _ in CASES}
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for cmd, p in sub.choices.items():
        for a in p._actions:
            flag = next((o for o in a.option_strings if o.startswith("--")), None)
            if flag and a.type in (int, float):
                missing.append((cmd, flag, "plain int/float type"))
            elif flag and a.type is not None and getattr(a.type, "__name__", "") in ("integer", "number", "list", "policies", "size", "_length", "_layers") and (cmd, flag) not in covered:
                missing.append((cmd, flag))
    assert not missing, missing
