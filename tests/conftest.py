"""Shared fixtures. The real trace lives in ../shared/traces (never copied into the repo).

Under CI=true a test that needs it fails instead of skipping when it is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_TRACES = Path(os.environ.get("ELDR_SHARED_TRACES", REPO.parent / "shared" / "traces"))


def _need(path: Path) -> Path:
    if path.exists():
        return path
    msg = f"real trace missing: {path} (set ELDR_SHARED_TRACES)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def gptoss_trace_path() -> Path:
    return _need(SHARED_TRACES / "gptoss20b.npz")


@pytest.fixture(scope="session")
def gptoss_trace(gptoss_trace_path):
    from eldr_sglang.traces import load_trace

    return load_trace(gptoss_trace_path)
