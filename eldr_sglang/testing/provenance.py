"""Which code produced a benchmark's numbers: the git HEAD and the files that differ from it.

Studies record this before they run, so later edits to the tree are never credited to them (on
a shared checkout other engineers edit the generator and the simulator while a study runs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GIT_TIMEOUT_S = 10.0


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def code_state(paths: tuple[str, ...] = ("eldr_sglang", "rust")) -> dict:
    """{"head": short commit or None, "dirty": tracked files under `paths` changed from it}."""
    head = _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain", "--", *paths) or ""
    dirty = [ln[3:] for ln in status.splitlines() if ln.strip() and not ln.startswith("??")]
    return {"head": head.strip() if head else None, "dirty": dirty}


def describe(state: dict) -> str:
    """One line for a report: 'commit abc1234, clean' or '..., with uncommitted changes to ...'."""
    if state["head"] is None:
        return "unknown (not a git checkout)"
    changed = state["dirty"]
    return f"commit {state['head']}" + (f", with uncommitted changes to {', '.join(changed)}" if changed else ", clean")
