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
# These modules drive a router subprocess over HTTP in front of an emulated PD cluster; each
# runs once per data plane (ELDR_TEST_DATA_PLANE set: that plane only). A module declares its
# TRACE (make_trace_files keywords), CLUSTER (start_cluster keywords) and TIME_SCALE, and
# gets `workdir`, `trace_files` and `cluster` from here.
HTTP_SUITES = {"test_e2e_pd", "test_e2e_failures", "test_router_faults", "test_router_reliability", "test_router_locality"}


def pytest_generate_tests(metafunc):
    if "data_plane" in metafunc.fixturenames and metafunc.module.__name__ in HTTP_SUITES:
        from eldr_sglang.router.config import DATA_PLANES
        from eldr_sglang.testing.pd_cluster import TEST_DATA_PLANE_ENV

        chosen = os.environ.get(TEST_DATA_PLANE_ENV)
        metafunc.parametrize("data_plane", [chosen] if chosen else list(DATA_PLANES), indirect=True, scope="module")


@pytest.fixture(scope="module")
def data_plane(request):
    """The data plane the module's routers run on: start_router reads it from the environment."""
    from eldr_sglang.router.config import DEFAULT_DATA_PLANE
    from eldr_sglang.testing.pd_cluster import TEST_DATA_PLANE_ENV

    plane = getattr(request, "param", None) or os.environ.get(TEST_DATA_PLANE_ENV) or DEFAULT_DATA_PLANE
    old = os.environ.get(TEST_DATA_PLANE_ENV)
    os.environ[TEST_DATA_PLANE_ENV] = plane
    yield plane
    if old is None:
        os.environ.pop(TEST_DATA_PLANE_ENV, None)
    else:
        os.environ[TEST_DATA_PLANE_ENV] = old


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, request, data_plane):
    return tmp_path_factory.mktemp(f"{request.module.__name__.removeprefix('test_')}-{data_plane}")


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
