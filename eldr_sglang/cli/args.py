"""Argument types for the `eldr` commands: every numeric flag is parsed and range-checked by
argparse before anything runs, so a bad value is one clear line and exit status 2, never a
traceback, an OverflowError deep in numpy, or a NaN table with exit 0.

Each factory returns a callable for argparse's `type=`; its error names the accepted range.
"""

from __future__ import annotations

import argparse
import math

from eldr_sglang import _core

# Shared bounds, generous for real deployments and small enough that no size overflows.
MAX_WORKERS = 65536  # decode (or prefill) workers in one cluster
MAX_LAYERS = 4096  # hidden layers of a model
MAX_EXPERTS = _core.MAX_EXPERTS  # experts per layer (the core's bound: the centroid file's, 2^20)
MAX_REQUESTS = 100_000_000
MAX_TOKENS = 10_000_000  # tokens of one request
MAX_SEED = 2**63 - 1


def _fmt(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return "finite"


def integer(lo: int | None = None, hi: int | None = None):
    """An integer in lo..=hi (either bound may be None)."""
    rng = f"{lo}..{hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")

    def parse(text: str) -> int:
        try:
            v = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {rng}, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {rng}, got {text}")
        return v

    parse.__name__ = "integer"
    return parse


def real(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """A finite float within the bounds (open or closed)."""
    rng = _fmt(lo, hi, lo_open, hi_open)

    def parse(text: str) -> float:
        try:
            v = float(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {rng}, got {text!r}") from None
        bad = not math.isfinite(v)
        if lo is not None:
            bad |= v <= lo if lo_open else v < lo
        if hi is not None:
            bad |= v >= hi if hi_open else v > hi
        if bad:
            raise argparse.ArgumentTypeError(f"must be a finite number {rng}, got {text}")
        return v

    parse.__name__ = "number"
    return parse


def listed(item, *, allow_empty: bool = False):
    """A comma-separated list of `item` values (an `integer(...)` or `real(...)`)."""

    def parse(text: str) -> list:
        parts = [p for p in str(text).split(",") if p.strip()]
        if not parts and not allow_empty:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        out = []
        for p in parts:
            try:
                out.append(item(p))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"{exc} (in the list {text!r})") from None
        return out

    parse.__name__ = "list"
    return parse


def policies(text: str) -> str:
    """A simulator policy list (eldr@TAU, eldr/F checked); returned as text, parsed again
    with the run's defaults."""
    from eldr_sglang.sim.runner import parse_policies

    try:
        parse_policies(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def model(text: str) -> str:
    """A model of the catalogue (name, Hugging Face id or alias) or a model directory / its
    config.json; returned as given, looked up again where it is used."""
    from eldr_sglang.models import get_model

    try:
        get_model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


MODEL_HELP = "a catalogue name ({}), a Hugging Face id, or a model directory with a config.json"


def size(text: str) -> int:
    """A memory size such as 512M or 8G."""
    from eldr_sglang.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_max_memory(parser) -> None:
    parser.add_argument("--max-memory", type=size, default=None, metavar="SIZE",
                        help="refuse runs estimated to need more than SIZE, e.g. 8G (default: the memory available)")


seed = integer(0, MAX_SEED)
workers = integer(1, MAX_WORKERS)
tau = real(0.0, _core.MAX_TAU)  # a cosine distance band: 1 - cos lies in [0, 2] (the core's bound, the router's)
load_factor = real(0.0, 1000.0)
