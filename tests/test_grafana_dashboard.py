"""docs/grafana/eldr-router.json: every metric a panel's expression (or a template query) names
is one the router exports, under the name and kind it exports it with."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "eldr-router.json"
PROMQL_WORDS = {"histogram_quantile", "sum", "rate", "by", "le", "label_values"}


def _exported(tmp_path) -> dict[str, str]:  # noqa: D401
    """{family name: type} of a router's /metrics (eldr policy, a centroid file with a drift
    baseline: every family it can export)."""
    from eldr_sglang import _core
    from eldr_sglang.router.app import build_app
    from eldr_sglang.router.config import build_parser, config_from_args

    p = str(tmp_path / "c.eldr")
    prov = {"baseline": {"mean_d_star": 0.1, "std_d_star": 0.05, "nearest_share": [0.25] * 4}}
    _core.write_centroids(p, np.eye(4, 8, dtype=np.float32), np.ones(1, np.float32), np.ones((1, 8), np.float32), 0.1, None,
                          json.dumps(prov))
    args = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:9", "--disagg-router", "eldr", "--eldr-centroids", p]
    for k in range(4):
        args += ["--decode", f"http://127.0.0.1:{10 + k}"]
    app = build_app(config_from_args(build_parser().parse_args(args)))
    pd = next(v for v in app.values() if hasattr(v, "metrics"))
    text = pd.metrics.render().decode()
    if pd.drift is not None:
        pd.drift.ctl.close()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    # some prometheus_client versions name a counter's family with its _total suffix
    return {(n[: -len("_total")] if t == "counter" and n.endswith("_total") else n): t for n, t in types.items()}


def _series_names(expr: str) -> set[str]:
    return {w for w in re.findall(r"\b([a-z_:][a-z0-9_:]*)\s*(?=[{\[)]|$)", expr) if w.startswith("eldr_")} | {
        w for w in re.findall(r"\beldr_[a-z0-9_]+", expr)}


def _problems(exprs: list[str], exported: dict[str, str]) -> tuple[list, set]:
    """(names that are not exported, or used as another kind; the families used)."""
    used, bad = set(), []
    for e in exprs:
        for name in _series_names(e):
            base, kind = name, None
            for suffix, k in (("_bucket", "histogram"), ("_sum", None), ("_count", None), ("_total", "counter")):
                if name.endswith(suffix) and name[: -len(suffix)] in exported:
                    base, kind = name[: -len(suffix)], k
                    break
            if base not in exported:
                bad.append((name, e))
            elif kind is not None and exported[base] != kind:
                bad.append((name, f"{base} is a {exported[base]}, not a {kind}"))
            elif kind is None and name == base and exported[base] in ("histogram", "counter"):
                bad.append((name, f"{base} is a {exported[base]}: use its _bucket/_sum/_count or _total series"))
            used.add(base)
    return bad, used


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _exported(tmp_path_factory.mktemp("grafana"))


def test_every_dashboard_expression_names_an_exported_metric(exported):
    assert exported.get("eldr_router_tpot_seconds") == "histogram"
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    assert len(exprs) >= 15
    bad, used = _problems(exprs, exported)
    assert not bad, bad
    # the latency families the issue asks for are on the dashboard
    assert {"eldr_router_ttft_seconds", "eldr_router_tpot_seconds", "eldr_router_itl_seconds",
            "eldr_router_e2e_seconds", "eldr_router_prefill_seconds"} <= used


@pytest.mark.parametrize("expr", [
    "rate(eldr_router_tpot_secs_bucket[5m])",  # a misspelt family
    "rate(eldr_router_requests_bucket[5m])",  # a counter used as a histogram
    "eldr_router_tpot_seconds",  # a histogram's bare name is no series
    "rate(eldr_router_queue_depth_total[5m])",  # a gauge has no _total
])
def test_the_check_catches_what_it_is_for(exported, expr):
    assert _problems([expr], exported)[0]
