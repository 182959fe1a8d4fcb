"""Shared by the real-SGLang CPU tests (test_sglang_cpu_*.py): when to fail instead of skip."""

from __future__ import annotations

import os

import pytest

# Under CI (or when asked) a missing prerequisite is a failure: the tests must run there.
REQUIRE = os.environ.get("ELDR_REQUIRE_SGLANG") == "1" or os.environ.get("CI", "").lower() == "true"
STARTUP_TIMEOUT = 900  # servers on two shared cores: 41-225 s measured, with headroom


def harness_or_skip(workdir):
    """A Harness in workdir, or a skip (a failure under REQUIRE) naming what is missing."""
    from eldr_sglang.testing.sglang_cpu.harness import Harness
    from eldr_sglang.testing.sglang_cpu.stub import HarnessError

    try:
        return Harness(workdir)
    except HarnessError as exc:
        msg = str(exc)
        if REQUIRE:
            pytest.fail(msg + " (CI=true or ELDR_REQUIRE_SGLANG=1: the real-SGLang CPU tests must run)")
        pytest.skip(msg)
