"""The `eldr` command line: one module per subcommand, registered in COMMANDS.

Each subcommand module defines `register(subparsers)`, which adds its parser and sets
`func=run` where `run(args) -> int` returns the exit code. Errors a user can cause
raise `CliError` (or ValueError/OSError) and are printed as one clear line, never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `eldr --help` lists them.
COMMANDS = [
    "eldr_sglang.cli.synth",
    "eldr_sglang.cli.collect",
    "eldr_sglang.cli.convert",
    "eldr_sglang.cli.fit",
    "eldr_sglang.cli.inspect",
    "eldr_sglang.cli.route_demo",
    "eldr_sglang.cli.simulate",
    "eldr_sglang.cli.demo",
    "eldr_sglang.cli.patch",
    "eldr_sglang.cli.refit",
    "eldr_sglang.cli.drift_check",
    "eldr_sglang.cli.experiment",
]


class CliError(Exception):
    """An error caused by the user's input; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    from eldr_sglang import __version__

    parser = argparse.ArgumentParser(
        prog="eldr",
        description="Expert-locality-aware decode routing (ELDR) for SGLang PD-disaggregated MoE serving.",
    )
    parser.add_argument("--version", action="version", version=f"eldr-sglang {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("eldr: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, OSError) as exc:
        print(f"eldr {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError:  # the up-front estimates are lower bounds; this is the last resort
        print(f"eldr {args.command}: error: out of memory; use smaller sizes", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
