"""`eldr patch apply|check|revert`: the ELDR patch series on the installed sglang==0.5.23."""

from __future__ import annotations

import argparse

from eldr_sglang.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "patch",
        help="apply, check or revert the ELDR patch series on the installed sglang",
        description=(
            "Apply, check or revert patches/sglang-0.5.23 on the installed sglang (or on --target). "
            "Other sglang versions are refused. apply and revert are idempotent; check exits 0 when "
            "every patch is applied, 1 when some are not, 2 on a conflict."
        ),
    )
    p.add_argument("action", choices=["apply", "check", "revert"])
    p.add_argument("--target", metavar="DIR", help="directory holding the sglang package (default: the installed one)")
    p.add_argument("--series", metavar="DIR", help="patch series directory (default: patches/sglang-0.5.23)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from eldr_sglang import patching

    try:
        if args.action == "check":
            root, states = patching.check(args.target, args.series)
            for s in states:
                print(f"{s.state:<10} {s.name}" + (f"  ({s.detail})" if s.detail else ""))
            if any(s.state == "conflict" for s in states):
                print(f"sglang at {root}: conflict (not the pristine 0.5.23 sources?)")
                return 2
            applied = all(s.state == "applied" for s in states)
            print(f"sglang at {root}: {'patched' if applied else 'not patched'}")
            return 0 if applied else 1
        if args.action == "apply":
            root, done = patching.apply(args.target, args.series)
            print(f"sglang at {root}: " + (f"applied {', '.join(done)}" if done else "already patched"))
            return 0
        root, done = patching.revert(args.target, args.series)
        print(f"sglang at {root}: " + (f"reverted {', '.join(done)}" if done else "not patched, nothing to revert"))
        return 0
    except patching.PatchError as exc:
        raise CliError(str(exc)) from None
