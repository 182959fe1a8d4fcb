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


# ---------------------------------------------------------------- the HTTP-surface suites
# These modules drive a router subprocess over HTTP in front of an emulated PD cluster. A
# module declares its TRACE (make_trace_files keywords), CLUSTER (start_cluster keywords) and
# TIME_SCALE, and gets `workdir`, `trace_files` and `cluster` from here.


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, request):
    return tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))


@pytest.fixture(scope="module")
def trace_files(workdir, request):
    from eldr_sglang.testing.pd_cluster import make_trace_files

    return make_trace_files(workdir, **request.module.TRACE)


@pytest.fixture(scope="module")
def cluster(trace_files, workdir, request):
    from eldr_sglang.testing.pd_cluster import start_cluster

    _, tpath, _ = trace_files
    proc, urls = start_cluster(tpath, workdir, time_scale=request.module.TIME_SCALE, **request.module.CLUSTER)
    yield urls
    proc.stop()
