"""The discovery flags of the router's command line, their checks and the settings they make.

Kubernetes flags are smg's (bindings/python/src/smg/router_args.py), with its defaults:
--service-discovery, --selector, --prefill-selector, --decode-selector (each `key=value ...`),
--service-discovery-namespace (unset: every namespace), --service-discovery-port (80). The
router is PD-only, so it needs both role selectors; --selector, which smg reads only outside
PD mode, narrows both here (a pod must match it too). Two more are this router's own:
--service-discovery-resync-secs (the periodic re-LIST, 60 s as smg's reconcile) and --kube-api
(an API server URL, e.g. `kubectl proxy`'s; default: the in-cluster one).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from urllib.parse import urlparse

from eldr_sglang.router.discovery.pods import parse_selector, selector_text

DEFAULT_SD_PORT = 80  # smg's --service-discovery-port default
DEFAULT_RESYNC_S = 60.0  # smg's reconcile period
DEFAULT_FILE_INTERVAL_S = 1.0
IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"


@dataclass(frozen=True)
class KubeSettings:
    prefill_selector: dict
    decode_selector: dict
    selector: dict  # ANDed with each role's
    namespace: str | None = None  # None: every namespace (needs a ClusterRole)
    port: int = DEFAULT_SD_PORT
    api_url: str | None = None  # None: in-cluster (KUBERNETES_SERVICE_HOST, the service account)
    resync_s: float = DEFAULT_RESYNC_S

    def role_selector(self, role: str) -> dict:
        return {**self.selector, **(self.prefill_selector if role == "prefill" else self.decode_selector)}

    def describe(self) -> str:
        where = f"namespace {self.namespace}" if self.namespace else "every namespace"
        return (f"prefill '{selector_text(self.role_selector('prefill'))}', decode "
                f"'{selector_text(self.role_selector('decode'))}', {where}, port {self.port}")


@dataclass(frozen=True)
class DiscoverySettings:
    """The discovery sources the router runs (either, both, or neither: the command line's
    workers and the admin's /eldr/workers alone)."""
    workers_file: str | None = None
    file_interval_s: float = DEFAULT_FILE_INTERVAL_S
    kube: KubeSettings | None = None


def add_flags(ap: argparse.ArgumentParser) -> None:
    """The 'Worker discovery' group of the router's --help."""
    g = ap.add_argument_group("Worker discovery (docs/discovery.md)")
    g.add_argument("--workers-file", metavar="PATH", default=None,
                   help='a JSON file of workers, re-read every --workers-file-interval: {"prefill": [{"url": '
                   '"http://p0:30000", "bootstrap_port": 8998}], "decode": [{"url": "http://d0:30001"}]}. Alone, or beside '
                   "--prefill/--decode (their union; a worker in both keeps the command line's entry). A half-written "
                   "or invalid version is refused in one log line and the last good one stays. Changes after start are "
                   "applied live: a new worker is routed to, a removed one drains (docs/discovery.md)")
    g.add_argument("--workers-file-interval", type=float, default=DEFAULT_FILE_INTERVAL_S, metavar="SECS",
                   help=f"seconds between reads of --workers-file (default {DEFAULT_FILE_INTERVAL_S:g})")
    g.add_argument("--service-discovery", action="store_true",
                   help="find the workers as Kubernetes pods (LIST + WATCH, re-listed every "
                   "--service-discovery-resync-secs); only Ready, Running pods count")
    for flag, what in (("--selector", "labels every worker pod carries (narrows both role selectors)"),
                       ("--prefill-selector", "labels of the prefill pods (required with --service-discovery)"),
                       ("--decode-selector", "labels of the decode pods (required with --service-discovery)")):
        g.add_argument(flag, nargs="+", default=None, metavar="KEY=VALUE", help=f"{what}: key1=value1 key2=value2")
    g.add_argument("--service-discovery-namespace", default=None, metavar="NS",
                   help="namespace to watch (default: every namespace, which needs a ClusterRole)")
    g.add_argument("--service-discovery-port", type=int, default=DEFAULT_SD_PORT, metavar="PORT",
                   help=f"the workers' HTTP port on each pod IP (default {DEFAULT_SD_PORT}); a prefill's bootstrap port "
                   "is its sglang.ai/bootstrap-port annotation (none without it, as smg)")
    g.add_argument("--service-discovery-resync-secs", type=float, default=DEFAULT_RESYNC_S, metavar="SECS",
                   help=f"re-LIST the pods this often beside the watch, so a missed event heals (default {DEFAULT_RESYNC_S:g})")
    g.add_argument("--kube-api", metavar="URL", default=None,
                   help="the API server, e.g. http://127.0.0.1:8001 from `kubectl proxy` (no token is sent); default: the "
                   "in-cluster one, with the pod's service-account token and CA")


def _seconds(v: float, flag: str, lo: float, hi: float) -> float:
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{flag} must be between {lo:g} and {hi:g} seconds, got {v:g}")
    return v


def settings_from_args(a: argparse.Namespace) -> DiscoverySettings | None:
    """The discovery settings the flags ask for (None: none); ValueError in one line."""
    kube = _kube_from_args(a)
    if a.workers_file is None:
        if a.workers_file_interval != DEFAULT_FILE_INTERVAL_S:
            raise ValueError("--workers-file-interval needs --workers-file")
        return DiscoverySettings(kube=kube) if kube else None
    interval = _seconds(a.workers_file_interval, "--workers-file-interval", 0.01, 3600.0)
    path = a.workers_file
    if not os.path.isfile(path):
        raise ValueError(f"--workers-file {path}: not found or not a regular file (it must exist at start; "
                         "it may change later)")
    return DiscoverySettings(workers_file=path, file_interval_s=interval, kube=kube)


def _kube_from_args(a: argparse.Namespace) -> KubeSettings | None:
    given = [f for f, v in (("--selector", a.selector), ("--prefill-selector", a.prefill_selector),
                            ("--decode-selector", a.decode_selector),
                            ("--service-discovery-namespace", a.service_discovery_namespace),
                            ("--kube-api", a.kube_api)) if v is not None]
    if not a.service_discovery:
        if given:
            raise ValueError(f"{given[0]} needs --service-discovery")
        return None
    pre = parse_selector(a.prefill_selector, "--prefill-selector")
    dec = parse_selector(a.decode_selector, "--decode-selector")
    common = parse_selector(a.selector, "--selector")
    if not pre or not dec:
        raise ValueError("--service-discovery needs --prefill-selector and --decode-selector (this router serves PD "
                         "clusters only; --selector alone cannot tell prefill from decode pods)")
    if {**common, **pre} == {**common, **dec}:
        raise ValueError("--prefill-selector and --decode-selector select the same pods")
    if not 0 < a.service_discovery_port < 65536:
        raise ValueError(f"--service-discovery-port must be between 1 and 65535, got {a.service_discovery_port}")
    resync = _seconds(a.service_discovery_resync_secs, "--service-discovery-resync-secs", 0.1, 86400.0)
    if a.kube_api is not None:
        p = urlparse(a.kube_api)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError(f"--kube-api {a.kube_api!r}: expected a URL like http://127.0.0.1:8001")
    elif not os.environ.get(IN_CLUSTER_ENV):
        raise ValueError(f"--service-discovery: not running in a Kubernetes pod (${IN_CLUSTER_ENV} is unset); give "
                         "--kube-api URL (e.g. from `kubectl proxy`)")
    ns = a.service_discovery_namespace
    if ns is not None and not ns:
        raise ValueError("--service-discovery-namespace is empty (leave it out to watch every namespace)")
    return KubeSettings(prefill_selector=pre, decode_selector=dec, selector=common, namespace=ns,
                        port=a.service_discovery_port, api_url=(a.kube_api or "").rstrip("/") or None, resync_s=resync)
