"""Command line and configuration of the PD router service.

Flag names follow sglang_router's `launch_router` where they overlap (--pd-disaggregation,
--prefill URL [BOOTSTRAP_PORT], --decode URL, --host, --port, --prefill-policy,
--decode-policy, --request-timeout-secs, --worker-startup-timeout-secs,
--health-check-interval-secs, --health-failure-threshold, --load-monitor-interval,
--prometheus-host/--prometheus-port, --max-payload-size, --log-level).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from urllib.parse import urlparse

# The default decode policy and bounded-load factor are the ones the protocol study supports
# (the Rust core's, read through eldr_sglang.defaults: locality/0.05;
# benchmarks/results/tpot_study_protocol.md). The load
# cost of locality at DeepSeek-V3 shape is in benchmarks/results/bench_router_locality.md.
from eldr_sglang import _core
from eldr_sglang.defaults import DEFAULT_LOAD_FACTOR, DEFAULT_POLICY
from eldr_sglang.router.discovery.flags import DiscoverySettings, add_flags as _discovery_flags, settings_from_args

# seconds between polls of the decode workers' /v1/loads (--load-monitor-interval); the
# simulator's cluster polls its replicas as often (sim/cluster.py)
DEFAULT_LOAD_MONITOR_INTERVAL_S = 1.0
# ... and with --router-replicas N > 1: the others' requests are known only from the polls
# (loads and expert occupancy), and a 1 s old picture lets replicas herd; simulated at R = 4
# the default's loss against one router is 2.1 points at 1 s, 0.9 at 0.25 s
# (benchmarks/results/replicas_study.md)
REPLICAS_LOAD_MONITOR_INTERVAL_S = 0.25


def default_load_monitor_interval(router_replicas: int) -> float:
    """The poll interval the router uses when --load-monitor-interval is not given."""
    return REPLICAS_LOAD_MONITOR_INTERVAL_S if router_replicas > 1 else DEFAULT_LOAD_MONITOR_INTERVAL_S



def _load_factor(text: str) -> float | None:
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'none', got {text!r}") from None


# A client body of a few MiB holds a 128k-token prompt as JSON ids or text; aiohttp keeps
# several copies while parsing, so the old 512 MiB default let one client claim GBs.
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
ADMIN_TOKEN_ENV = "ELDR_ADMIN_TOKEN"
DAY_S = 86400.0

# The one policy list, from the Rust core (rust/core/src/policies/config.rs POLICIES). The counts
# policies route on the prefill's expert counts: they bind late, need the centroid file (eldr:
# its centroids; locality: its layer selection) and count fallbacks. Prefill placement takes
# the policies that read loads and health only.
DECODE_POLICIES = _core.POLICIES
COUNTS_POLICIES = _core.COUNTS_POLICIES
PREFILL_POLICIES = _core.PREFILL_POLICIES
# The request path runs in the Rust extension's tokio/hyper server (rust/dataplane); Python is
# the control plane (admin endpoints, health, loads, reload, drift).


class ConfigError(ValueError):
    """A bad command line; the message says which flag and why."""


@dataclass
class PrefillWorker:
    url: str
    bootstrap_port: int | None
    host: str  # what decode workers connect to (the URL's host)


@dataclass(frozen=True)
class Arm:
    """One arm of a switchback experiment: `label` as given (`locality/0.05`), its policy and
    load factor (None: none, or not a bounded-load policy)."""
    label: str
    policy: str
    load_factor: float | None


@dataclass
class Experiment:
    """A switchback experiment (--experiment): the data plane runs one arm per block of
    `switch_every_s` seconds, in an order drawn from `seed` (rust/dataplane/src/experiment.rs)."""
    arms: list[Arm]
    switch_every_s: float = 600.0
    seed: int = 0
    # --eldr-load-factor: a plain eldr or locality arm's (the data plane parses the labels too)
    default_load_factor: float | None = None


# Blocks shorter than this cannot drain a decode batch; longer than a week is a typo.
MIN_SWITCH_S, MAX_SWITCH_S = 0.1, 7 * 86400.0
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'10m', '30s', '1.5h', '500ms' or plain seconds ('90') -> seconds, between
    MIN_SWITCH_S and MAX_SWITCH_S. Raises ValueError saying what was expected."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|min|m|h)?\s*", text or "")
    if m is None:
        raise ValueError(f"expected a duration like 10m, 30s, 1h or 500ms, got {text!r}")
    v = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if not MIN_SWITCH_S <= v <= MAX_SWITCH_S:
        raise ValueError(f"a block must last between {MIN_SWITCH_S:g} s and 7 days, got {text!r}")
    return v


def parse_arms(text: str, default_load_factor: float | None = None) -> list[Arm]:
    """'locality/0.05,round_robin' -> arms: each a --disagg-router policy, optionally /F (the
    bounded-load factor of eldr and locality; /none: the paper's rule); a plain eldr or
    locality takes `default_load_factor` (--eldr-load-factor). Parsed by the core
    (rust/core/src/policies/label.rs). Raises ValueError."""
    return [Arm(label, policy, lf) for label, policy, lf in _core.parse_arms(text or "", default_load_factor)]


@dataclass
class RouterConfig:
    prefill: list[PrefillWorker]
    decode: list[str]
    policy: str = DEFAULT_POLICY
    prefill_policy: str = _core.DEFAULT_PREFILL_POLICY
    centroids: str | None = None
    tau: float | None = None
    load_factor: float | None = None
    # decode workers run SGLang's paged experts with C resident per MoE layer: locality routes
    # by expected page-ins (rust/core/src/policies/paged.rs); None = HBM-resident experts
    paged_experts: int | None = None
    # the locality cost's per-request term r (distinct experts per layer; 0: without it;
    # None: the core's DEFAULT_REQUEST_COST)
    request_cost: float | None = None
    bind: str = "auto"  # 'late' | 'early' | 'auto' (late for eldr, early for the baselines)
    signature_timeout_s: float = 30.0
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 30000
    request_timeout_s: float = 1800.0
    worker_startup_timeout_s: float = 0.0
    health_check_interval_s: float = 10.0
    health_failure_threshold: int = 3
    load_monitor_interval_s: float = DEFAULT_LOAD_MONITOR_INTERVAL_S
    router_replicas: int = 1  # --router-replicas: this router and the replicas beside it
    occupancy_reports: bool = True  # --eldr-occupancy-reports: ask decode workers for their expert occupancy
    poll_timeout_s: float = 10.0  # one /health or /v1/loads call; not tied to the intervals
    load_report_ttl_ms: int = 2000
    reload_interval_ms: int = 250
    max_payload_size: int = DEFAULT_MAX_PAYLOAD
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 60.0
    decode_progress_timeout_s: float = 5.0
    stall_timeout_s: float = 60.0
    retries: int = 2
    eject_after_failures: int = 5
    eject_base_s: float = 5.0
    eject_max_s: float = 300.0
    client_header_timeout_s: float = 30.0
    client_body_timeout_s: float = 30.0
    admin_token: str | None = None
    prometheus_host: str | None = None
    prometheus_port: int | None = None
    log_level: str = "info"
    explain_headers: bool = True
    drift: dict | None = None  # options of eldr_sglang.router.drift_hook.install ({"enabled": False}: off)
    # Admission control (rust/dataplane/src/admission.rs): None = its defaults
    # (256 per decode worker, a queue as long; config.rs says why); 0 = no bound.
    max_concurrent_requests: int | None = None
    queue_size: int | None = None
    queue_timeout_s: float = 60.0
    max_buffered_bytes: int | None = None  # None: the data plane's default (1 GiB)
    # A switchback experiment over decode policies; `policy` and `load_factor` are then its
    # first arm's.
    experiment: Experiment | None = None
    # Worker discovery (--workers-file, --service-discovery; router/discovery/): the router is
    # built with its first membership; None = the workers above only
    discovery: DiscoverySettings | None = None
    # the router's spec (policy, costs, tau, load factor, binding), built and checked once by
    # the core (rust/core/src/policies/spec.rs); the control plane's router is made from it
    spec: _core.RouterSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        _check_numbers(self)  # the command line and programmatic configs alike (the data plane's: _check_plane)
        if self.experiment is not None and self.request_cost:
            raise ConfigError("--eldr-request-cost is the router's locality cost; an experiment's arms take none")
        if self.experiment is not None:
            # the router the control plane holds is the first arm's; the centroid file stays
            # fixed through the run (no drift refits), so every block routes on the same one
            first = self.experiment.arms[0]
            self.policy, self.load_factor = first.policy, first.load_factor
            self.drift = {"enabled": False}
        for url in [w.url for w in self.prefill] + list(self.decode):
            if not url.startswith("http://"):  # the data plane speaks plain HTTP/1.1 to workers
                raise ConfigError(f"worker URL {url!r}: the router speaks plain http:// to workers only "
                                  "(https is not supported; put a TLS proxy beside the worker instead)")
        for flag, urls in (("--prefill", [w.url for w in self.prefill]), ("--decode", list(self.decode))):
            seen: dict[tuple, str] = {}
            for url in urls:
                key = _worker_key(url)
                if key in seen:
                    same = f"{url!r} twice" if seen[key] == url else f"{seen[key]!r} and {url!r}, the same worker,"
                    raise ConfigError(f"{flag}: {same} given: each worker once (a duplicate would be counted as two "
                                      "workers, doubling its share of the traffic and breaking the worker count the "
                                      "centroid file is fitted for)")
                seen[key] = url
        _check_plane(self)
        self.spec = _spec(lambda: _core.RouterSpec(self.policy, tau=self.tau, load_factor=self.load_factor,
                                                   paged_experts=self.paged_experts, request_cost=self.request_cost,
                                                   bind=self.bind, seed=self.seed))

    @property
    def late_binding(self) -> bool:
        """Whether any request binds late (under an experiment: any arm), as the core's spec
        of each policy under --eldr-bind says (the data plane reads it from the router)."""
        return any(_core.RouterSpec(p, bind=self.bind).binds_late for p in self.policies)

    @property
    def policies(self) -> list[str]:
        """The decode policies requests are routed by: the policy, or every arm's."""
        return [a.policy for a in self.experiment.arms] if self.experiment else [self.policy]


def _worker_key(url: str) -> tuple:
    """What makes two worker URLs the same worker: host (case-insensitive), port (80 when
    none is given) and path, whatever the trailing slash."""
    p = urlparse(url)
    try:
        port = p.port or 80
    except ValueError:  # an out-of-range port: compare the text
        port = p.netloc
    return (p.scheme.lower(), (p.hostname or "").lower(), port, p.path.rstrip("/"))


def _url(u: str, flag: str) -> str:
    p = urlparse(u)
    if p.scheme == "https":
        raise ConfigError(f"{flag} {u!r}: the router speaks plain http:// to workers only (https is not supported)")
    if p.scheme != "http" or not p.hostname:
        raise ConfigError(f"{flag} {u!r}: expected a URL like http://host:port")
    return u.rstrip("/")


def build_parser(prog: str = "python -m eldr_sglang.launch_router") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="ELDR PD router: late-bound, expert-locality-aware decode routing for SGLang PD disaggregation.",
    )
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    _worker_flags(ap.add_argument_group("PD disaggregation"))
    _discovery_flags(ap)
    pol = ap.add_argument_group("Routing")
    _routing_flags(pol)
    _experiment_flags(ap.add_argument_group("Switchback experiment (docs/experiments.md, 'Proving it on your cluster')"))
    # added after the experiment's group, as before the split, so the usage line keeps its order
    pol.add_argument("--no-explain-headers", action="store_true", help="omit the X-ELDR-* response headers")
    req = ap.add_argument_group("Requests and workers")
    _request_flags(req)
    _upstream_flags(ap.add_argument_group("Upstream timeouts, retries and outlier ejection"))
    _client_flags(ap.add_argument_group("Clients and control endpoints"))
    _admission_flags(ap.add_argument_group("Admission control (the Rust data plane)"))
    req.add_argument("--prometheus-host", default=None, help="also serve /metrics on this host (with --prometheus-port)")
    req.add_argument("--prometheus-port", type=int, default=None)
    req.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def _worker_flags(pd: argparse._ArgumentGroup) -> None:
    """The workers: which URLs serve prefill and which decode."""
    pd.add_argument("--pd-disaggregation", action="store_true", help="PD mode (required: the only mode)")
    pd.add_argument(
        "--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
        help="prefill worker URL and optional bootstrap port ('none' or omitted: none); repeat per worker "
        "(or find them: --workers-file, --service-discovery)",
    )
    pd.add_argument("--decode", nargs=1, action="append", default=[], metavar="URL",
                    help="decode worker URL; repeat per worker (or find them: --workers-file, --service-discovery)")


def _routing_flags(pol: argparse._ArgumentGroup) -> None:
    """The decode and prefill policies and the centroid file they read."""
    pol.add_argument(
        "--disagg-router", "--decode-policy", dest="policy", choices=DECODE_POLICIES, default=None,
        help=f"decode routing policy (default {DEFAULT_POLICY}: the locality-aware balancer, least marginal expected "
        "expert cost under the load cap; eldr: the paper's band rule; both need --eldr-centroids)",
    )
    pol.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default=_core.DEFAULT_PREFILL_POLICY)
    pol.add_argument("--eldr-centroids", metavar="PATH",
                     help="centroid file from `eldr fit` (required for eldr and locality; locality uses its layer selection)")
    pol.add_argument("--eldr-tau", type=float, default=None, help="band width tau (default: the file's)")
    pol.add_argument(
        "--eldr-load-factor", type=_load_factor, default=DEFAULT_LOAD_FACTOR, metavar="F|none",
        help="bounded loads for eldr and locality: a worker is a candidate only while its load is below "
        f"ceil((1+F)*(total+1)/workers) (default {DEFAULT_LOAD_FACTOR}; 'none' = the paper's rule, "
        "which piles single-domain bursts onto one worker: see benchmarks/results/tpot_study*.md)",
    )
    pol.add_argument(
        "--eldr-paged-experts", type=int, default=None, metavar="C",
        help="the decode workers run SGLang's paged experts (--enable-paged-experts --paged-experts-num-resident C): "
        "the locality policy then routes each request where it is expected to cause the fewest expert page-ins, "
        "under the same load cap (docs/operations.md, 'Paged experts'). An experiment: in the simulated study "
        "(benchmarks/results/paged_experts_study.md) it was slower than the plain locality cost on p50 in 19 of 23 runs",
    )
    pol.add_argument(
        "--eldr-request-cost", type=float, default=None, metavar="R",
        help="the locality cost's per-request term: R is the per-request part of a decode step in distinct experts "
        "per layer (for a step time fixed + b*batch + c*sum over L layers of distinct experts, R = b/(c*L)); "
        "the policy then minimises D_w + (B_w+1)*Delta_w + R*(2*B_w+1) (rust/core/src/policies/locality.rs). "
        f"Default {_core.DEFAULT_REQUEST_COST:g} (benchmarks/results/per_request_cost_study.md); 0: the cost without it. "
        "Locality only",
    )
    pol.add_argument(
        "--eldr-bind", choices=["auto", "late", "early"], default="auto",
        help="pick the decode worker after prefill (late) or with the prefill (early); auto: late for eldr and locality",
    )
    pol.add_argument(
        "--eldr-signature-timeout-secs", type=float, default=30.0,
        help="wait this long for the prefill's signature, then route by shortest queue (default 30)",
    )
    pol.add_argument("--eldr-reload-interval-ms", type=int, default=250, help="centroid file hot-reload check period")
    pol.add_argument("--eldr-load-report-ttl-ms", type=int, default=2000, help="how long a /v1/loads report counts")
    pol.add_argument(
        "--no-eldr-drift", action="store_true",
        help="turn off drift monitoring and online refits of the centroid file (on by default for eldr and locality)",
    )
    pol.add_argument("--seed", type=int, default=0, help="seed of the random policies")


def _experiment_flags(exp: argparse._ArgumentGroup) -> None:
    """A switchback experiment over decode policies."""
    exp.add_argument(
        "--experiment", metavar="ARM1,ARM2[,...]", default=None,
        help="alternate the decode policy over time blocks: arms are --disagg-router policies, eldr and locality "
        "optionally with /F, their load factor (e.g. locality/0.05,round_robin). Blocks run in a seeded random order, "
        "each arm once per round; a block's requests that start while another arm's are still in flight are flagged "
        "warm-up. GET /eldr/experiment gives each block's TPOT p50 and mean (read by `eldr experiment report --url`); "
        "replaces --disagg-router",
    )
    exp.add_argument("--switch-every", metavar="DURATION", default=None,
                     help="block length with --experiment: 10m, 30s, 1h, 500ms or seconds (default 10m)")
    exp.add_argument("--experiment-seed", type=int, default=0, metavar="N", help="seed of the blocks' order (default 0)")


def _request_flags(req: argparse._ArgumentGroup) -> None:
    """Request limits and the control plane's polls of the workers."""
    req.add_argument("--request-timeout-secs", type=float, default=1800.0)
    req.add_argument("--worker-startup-timeout-secs", type=float, default=0.0,
                     help="wait for workers' /health at start (0: no); with discovery and no --prefill/--decode, also the "
                     "longest wait for the first workers found (0: no limit)")
    req.add_argument("--health-check-interval-secs", type=float, default=10.0)
    req.add_argument("--health-failure-threshold", type=int, default=3)
    req.add_argument(
        "--load-monitor-interval", type=float, default=None,
        help=f"seconds between polls of the decode workers' /v1/loads (0: off; default "
        f"{DEFAULT_LOAD_MONITOR_INTERVAL_S:g}, {REPLICAS_LOAD_MONITOR_INTERVAL_S:g} with --router-replicas above 1)",
    )
    req.add_argument(
        "--router-replicas", type=int, default=1,
        help="router replicas in front of these workers, this one among them (default 1). With N > 1 each request "
        "this router sends also counts N-1 projected requests of the others on its worker (its load, and its experts "
        "on the locality state) until that worker's next report, so replicas do not all pile onto the worker that "
        "looked best at the last poll; it also makes the default --load-monitor-interval "
        f"{REPLICAS_LOAD_MONITOR_INTERVAL_S:g} s (docs/operations.md, 'Several router replicas')",
    )
    req.add_argument(
        "--eldr-occupancy-reports", choices=("on", "off"), default="on",
        help="with the locality balancer, ask each decode worker's /v1/loads for the experts its whole batch uses "
        "(every replica's requests; workers patched with --enable-eldr-occupancy) and route on that plus this "
        "router's requests since; each request's expert profile goes to a decode worker only while it reports "
        "(default on; an unpatched worker ignores the question)",
    )
    req.add_argument(
        "--worker-poll-timeout-secs", type=float, default=10.0,
        help="how long one /health or /v1/loads call may take (default 10; a busy CPU SGLang can take seconds). "
        "Each worker is polled on its own, so a slow one never delays the others' polls",
    )
    req.add_argument("--max-payload-size", type=int, default=DEFAULT_MAX_PAYLOAD,
                     help=f"largest client request body in bytes (default {DEFAULT_MAX_PAYLOAD}); larger gets 413")


def _upstream_flags(up: argparse._ArgumentGroup) -> None:
    """Timeouts on the workers, re-sends and outlier ejection."""
    up.add_argument("--upstream-connect-timeout-secs", type=float, default=5.0, help="TCP connect to a worker (default 5)")
    up.add_argument(
        "--first-byte-timeout-secs", type=float, default=60.0,
        help="a worker's first byte: prefill response headers, a decode stream's first chunk, and for a "
        "non-streamed decode answer the decode taking the prefill's KV (default 60); a decode that misses it is "
        "charged and the request moves to another one",
    )
    up.add_argument(
        "--decode-progress-timeout-secs", type=float, default=5.0,
        help="a streamed decode's response head, which a worker at work sends before it runs anything (default 5; "
        "at most --first-byte-timeout-secs); a decode that misses it is hung: charged, and the request moves to "
        "another one long before its client gives up",
    )
    up.add_argument("--stall-timeout-secs", type=float, default=60.0,
                    help="longest silence between two chunks of a worker's stream (default 60)")
    up.add_argument("--retries", type=int, default=2,
                    help="re-sends of a request to another worker while nothing reached the client (default 2)")
    up.add_argument("--eject-after-failures", type=int, default=5,
                    help="consecutive failures (5xx, timeouts, connect errors) that eject a worker (default 5)")
    up.add_argument("--eject-base-secs", type=float, default=5.0,
                    help="first ejection's length; doubles on each re-ejection (default 5)")
    up.add_argument("--eject-max-secs", type=float, default=300.0, help="longest ejection (default 300)")


def _client_flags(cl: argparse._ArgumentGroup) -> None:
    """Timeouts on clients, and the admin token of the control endpoints."""
    cl.add_argument("--client-header-timeout-secs", type=float, default=30.0,
                    help="a connection that sends no complete request head in this long is closed (default 30)")
    cl.add_argument("--client-body-timeout-secs", type=float, default=30.0,
                    help="reading a request body may take this long, else 408 (default 30)")
    cl.add_argument(
        "--admin-token", default=None,
        help=f"token for POST /eldr/refit, /flush_cache, /eldr/experiment/switch and POST/DELETE /eldr/workers (header 'Authorization: Bearer TOKEN'); "
        f"at least 16 characters of printable ASCII; default: ${ADMIN_TOKEN_ENV}; unset: those endpoints are off",
    )


def _admission_flags(adm: argparse._ArgumentGroup) -> None:
    """Admission control: requests in flight and the queue before it."""
    adm.add_argument(
        "--max-buffered-bytes", type=int, default=None, metavar="N",
        help="request-body bytes the router holds at once, over all connections (default 1 GiB, at least "
        "--max-payload-size); a body that would pass it gets 503 at once, unread (a request is admitted before its "
        "body is read)",
    )
    adm.add_argument(
        "--max-concurrent-requests", type=int, default=None, metavar="N",
        help="requests in flight through the router at once; past it they wait in the queue (default: 256 per decode "
        "worker, what a SGLang decode batch holds; 0: no bound)",
    )
    adm.add_argument("--queue-size", type=int, default=None, metavar="N",
                     help="requests that may wait for a slot; past it the router answers 429 with Retry-After at once "
                     "(default: as many as --max-concurrent-requests)")
    adm.add_argument("--queue-timeout-secs", type=float, default=60.0,
                     help="longest wait in the queue, then 503 with Retry-After (default 60, the SGLang gateway's)")


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    ap = build_parser()
    a = ap.parse_args(argv)
    return config_from_args(a)


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    if not a.pd_disaggregation:
        raise ConfigError("--pd-disaggregation is required: this router serves PD-disaggregated clusters only")
    prefill, decode, discovery = _workers_from_args(a)
    experiment = _experiment(a)
    a.policy = a.policy or DEFAULT_POLICY
    if experiment is not None:
        a.policy, a.eldr_load_factor = experiment.arms[0].policy, experiment.arms[0].load_factor
    check_centroids(a.policy, experiment, a.eldr_centroids)
    if a.prometheus_host is not None and a.prometheus_port is None:
        raise ConfigError("--prometheus-host needs --prometheus-port")
    return RouterConfig(
        prefill=prefill,
        decode=decode,
        policy=a.policy,
        prefill_policy=a.prefill_policy,
        centroids=a.eldr_centroids,
        tau=a.eldr_tau,
        load_factor=a.eldr_load_factor,
        paged_experts=a.eldr_paged_experts,
        request_cost=a.eldr_request_cost,
        bind=a.eldr_bind,
        signature_timeout_s=a.eldr_signature_timeout_secs,
        seed=a.seed,
        host=a.host,
        port=a.port,
        request_timeout_s=a.request_timeout_secs,
        worker_startup_timeout_s=a.worker_startup_timeout_secs,
        health_check_interval_s=a.health_check_interval_secs,
        health_failure_threshold=a.health_failure_threshold,
        load_monitor_interval_s=(a.load_monitor_interval if a.load_monitor_interval is not None
                                 else default_load_monitor_interval(a.router_replicas)),
        router_replicas=a.router_replicas,
        occupancy_reports=a.eldr_occupancy_reports == "on",
        poll_timeout_s=a.worker_poll_timeout_secs,
        load_report_ttl_ms=a.eldr_load_report_ttl_ms,
        reload_interval_ms=a.eldr_reload_interval_ms,
        max_payload_size=a.max_payload_size,
        connect_timeout_s=a.upstream_connect_timeout_secs,
        first_byte_timeout_s=a.first_byte_timeout_secs, decode_progress_timeout_s=a.decode_progress_timeout_secs,
        stall_timeout_s=a.stall_timeout_secs,
        retries=a.retries,
        eject_after_failures=a.eject_after_failures,
        eject_base_s=a.eject_base_secs,
        eject_max_s=a.eject_max_secs,
        client_header_timeout_s=a.client_header_timeout_secs,
        client_body_timeout_s=a.client_body_timeout_secs,
        admin_token=_admin_token(a.admin_token),
        prometheus_host=a.prometheus_host,
        prometheus_port=a.prometheus_port,
        log_level=a.log_level,
        explain_headers=not a.no_explain_headers,
        drift={"enabled": False} if a.no_eldr_drift else None,
        max_concurrent_requests=a.max_concurrent_requests,
        queue_size=a.queue_size,
        queue_timeout_s=a.queue_timeout_secs, max_buffered_bytes=a.max_buffered_bytes,
        experiment=experiment,
        discovery=discovery,
    )


def _workers_from_args(a: argparse.Namespace) -> tuple[list[PrefillWorker], list[str], DiscoverySettings | None]:
    """--prefill and --decode, and the discovery sources that may add to them or stand in for them."""
    prefill = []
    for item in a.prefill:
        if len(item) > 2:
            raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(item)}")
        url = _url(item[0], "--prefill")
        port: int | None = None
        if len(item) == 2 and item[1].lower() != "none":
            try:
                port = int(item[1])
            except ValueError:
                raise ConfigError(f"--prefill {item[0]}: bootstrap port {item[1]!r} is not a number or 'none'") from None
            if not 0 < port < 65536:
                raise ConfigError(f"--prefill {item[0]}: bootstrap port {port} out of range")
        prefill.append(PrefillWorker(url=url, bootstrap_port=port, host=urlparse(url).hostname))
    decode = [_url(d[0], "--decode") for d in a.decode]
    try:
        discovery = settings_from_args(a)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if discovery is None and (not prefill or not decode):
        raise ConfigError("at least one --prefill and one --decode worker are needed (or a discovery source: "
                          "--workers-file, --service-discovery)")
    return prefill, decode, discovery


def check_centroids(policy: str, experiment: Experiment | None, centroids: str | None) -> None:
    """A centroid file for the decode policy (or every arm) that routes on counts: the core's
    spec says which do and in what words (ConfigError). The other routing rules (ranges, which
    policy takes paged experts or a request cost) are the spec's too, checked when
    RouterConfig builds it."""
    for arm in experiment.arms if experiment else []:
        _spec(lambda: _core.RouterSpec(arm.policy).check_centroids(bool(centroids), arm.label))
    _spec(lambda: _core.RouterSpec(policy).check_centroids(bool(centroids)))


def _spec(make):
    """`make()`, its ValueError (the core spec's check, in the flag's words) a ConfigError."""
    try:
        return make()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _experiment(a: argparse.Namespace) -> Experiment | None:
    if a.experiment is None:
        if a.switch_every is not None:
            raise ConfigError("--switch-every needs --experiment (the arms to switch between)")
        return None
    if a.policy is not None:
        raise ConfigError("--experiment replaces --disagg-router: give the policies as the experiment's arms")
    try:
        arms = parse_arms(a.experiment, a.eldr_load_factor)
    except ValueError as exc:
        raise ConfigError(f"--experiment: {exc}") from None
    try:
        every = parse_duration(a.switch_every) if a.switch_every is not None else 600.0
    except ValueError as exc:
        raise ConfigError(f"--switch-every: {exc}") from None
    if not 0 <= a.experiment_seed < 2**64:
        raise ConfigError(f"--experiment-seed must be between 0 and 2^64 - 1, got {a.experiment_seed}")
    return Experiment(arms, every, a.experiment_seed, a.eldr_load_factor)


# flag -> (RouterConfig field, lowest, highest, integer, zero allowed (0 = off) though lowest > 0):
# the control plane's own settings. The data plane's (ports, timeouts, retries, ejection,
# admission, the seed) are checked by rust/dataplane/src/config.rs alone, through
# `_core.DataPlane.check_numbers` (see _check_plane), and the routing flags (--eldr-tau,
# --eldr-load-factor, --eldr-paged-experts, --eldr-request-cost) by the core's RouterSpec
# (rust/core/src/policies/spec.rs), with messages in the same words.
_NUMERIC_FLAGS = {
    "--eldr-reload-interval-ms": ("reload_interval_ms", 1, 86_400_000, True, True),
    "--eldr-load-report-ttl-ms": ("load_report_ttl_ms", 0, 86_400_000, True, True),
    "--worker-startup-timeout-secs": ("worker_startup_timeout_s", 0.0, DAY_S, False, True),
    "--health-check-interval-secs": ("health_check_interval_s", 1e-3, DAY_S, False, True),
    "--health-failure-threshold": ("health_failure_threshold", 1, 1_000_000, True, False),
    "--load-monitor-interval": ("load_monitor_interval_s", 1e-3, DAY_S, False, True),
    "--router-replicas": ("router_replicas", 1, 1024, True, False),
    "--worker-poll-timeout-secs": ("poll_timeout_s", 1e-3, DAY_S, False, False),
    "--prometheus-port": ("prometheus_port", 1, 65535, True, False),
}


def _check_numbers(a: "RouterConfig") -> None:
    """Every numeric setting in range before anything runs: NaN, infinities, negative or absurd
    values are refused with the flag's name (argparse's float() accepts 'nan' and 'inf')."""
    for flag, (attr, lo, hi, integer, zero_ok) in _NUMERIC_FLAGS.items():
        v = getattr(a, attr, None)
        if v is None:
            continue
        if integer and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(f"{flag} must be an integer, got {v!r}")
        if not math.isfinite(v):
            raise ConfigError(f"{flag} must be a finite number, got {v}")
        if zero_ok and v == 0:
            continue
        if not lo <= v <= hi:
            what = f"between {lo:g} and {hi:g}" + (" (or 0: off)" if zero_ok and lo > 0 else "")
            raise ConfigError(f"{flag} must be {what}, got {v:g}" if not integer else f"{flag} must be {what}, got {v}")


def _check_plane(cfg: "RouterConfig") -> None:
    """The data plane's numeric settings, as the data plane will read them, checked by its own
    code (the workers, URLs and experiment it checks again when it is built)."""
    try:
        _core.DataPlane.check_numbers(plane_config(cfg, UNSTARTED_CONTROL_URL))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _admin_token(flag: str | None) -> str | None:
    import os

    token = flag if flag is not None else os.environ.get(ADMIN_TOKEN_ENV)
    if token is None or token == "":
        return None
    if len(token) < 16:
        raise ConfigError(f"the admin token (--admin-token or ${ADMIN_TOKEN_ENV}) must be at least 16 characters")
    # a client sends it as `Authorization: Bearer TOKEN`: visible ASCII, inner spaces only (the
    # value is compared with its ends stripped)
    if token != token.strip(" \t") or any(not (" " <= c <= "~") for c in token):
        raise ConfigError(f"the admin token (--admin-token or ${ADMIN_TOKEN_ENV}) holds a character a header cannot carry "
                          "(a line break, another control character, a leading or trailing space, or non-ASCII): use "
                          "printable ASCII, e.g. from `openssl rand -hex 24`")
    return token


# ---------------------------------------------------------------- the data plane's settings
# the control URL of a data plane that is built but never started (an in-process app in tests,
# the config check)
UNSTARTED_CONTROL_URL = "http://127.0.0.1:9"

# Tokio worker threads of the data plane: the machine this was measured on has 2 cores.
DATA_PLANE_THREADS = 2


# Decisions the data plane queues for the drift monitor between two drains (the oldest are
# dropped past it, and counted); drained every router.dataplane.DRIFT_DRAIN_S.
DRIFT_QUEUE = 8192


def drift_on(cfg: RouterConfig) -> bool:
    return bool(cfg.policy in COUNTS_POLICIES and cfg.centroids and (cfg.drift or {}).get("enabled", True))


def reservoir_config(cfg: RouterConfig) -> dict | None:
    """The refit reservoir's shape for the data plane's draw, from the same drift options
    the drift hook builds its reservoir from; None when drift is off or the options are
    not a reservoir (the hook then refuses them and says why)."""
    from eldr_sglang.drift.reservoir import DEFAULT_CAPACITY, DEFAULT_HORIZON, reservoir_shape

    if not drift_on(cfg):
        return None
    conf = cfg.drift or {}
    try:
        per_bucket, span = reservoir_shape(conf.get("reservoir_capacity", DEFAULT_CAPACITY),
                                           conf.get("reservoir_horizon", DEFAULT_HORIZON))
    except (TypeError, ValueError):
        return None
    return {"per_bucket": per_bucket, "span": span}


def plane_config(cfg: RouterConfig, control_url: str) -> str:
    """The data plane's settings (rust/dataplane/src/config.rs, which checks them), as JSON;
    a NaN or infinite float as the string "nan", "inf" or "-inf" (JSON has none)."""
    return json.dumps(_finite_or_named({
        "host": cfg.host, "port": cfg.port,
        "prefill": [{"url": w.url, "host": w.host, "bootstrap_port": w.bootstrap_port} for w in cfg.prefill],
        "decode": list(cfg.decode),
        "control_url": control_url,
        "prefill_policy": cfg.prefill_policy, "seed": cfg.seed,  # the decode policy: the router's
        "signature_timeout_s": cfg.signature_timeout_s, "request_timeout_s": cfg.request_timeout_s,
        "connect_timeout_s": cfg.connect_timeout_s, "first_byte_timeout_s": cfg.first_byte_timeout_s,
        "decode_progress_timeout_s": cfg.decode_progress_timeout_s,
        "stall_timeout_s": cfg.stall_timeout_s, "retries": cfg.retries,
        "eject_after_failures": cfg.eject_after_failures, "eject_base_s": cfg.eject_base_s, "eject_max_s": cfg.eject_max_s,
        "client_header_timeout_s": cfg.client_header_timeout_s, "client_body_timeout_s": cfg.client_body_timeout_s,
        "max_payload_size": cfg.max_payload_size, "explain_headers": cfg.explain_headers,
        "forward_profile": cfg.occupancy_reports,
        "threads": DATA_PLANE_THREADS,
        "signature_reservoir": DRIFT_QUEUE if reservoir_config(cfg) else 0,
        "reservoir": reservoir_config(cfg),
        "max_concurrent_requests": cfg.max_concurrent_requests, "queue_size": cfg.queue_size,
        "queue_timeout_s": cfg.queue_timeout_s, "max_buffered_bytes": cfg.max_buffered_bytes,
        "experiment": experiment_config(cfg),
    }))


def _finite_or_named(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # 'nan', 'inf', '-inf'
    if isinstance(v, dict):
        return {k: _finite_or_named(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite_or_named(x) for x in v]
    return v


def experiment_config(cfg: RouterConfig) -> dict | None:
    """The switchback experiment for the data plane (rust/dataplane/src/experiment.rs): the arms'
    labels, which it parses with the core's parser (parse_arms), and --eldr-load-factor for a
    plain counts policy; each arm's binding is its spec's, under the router's --eldr-bind."""
    x = cfg.experiment
    if x is None:
        return None
    return {"arms": ",".join(a.label for a in x.arms), "default_load_factor": x.default_load_factor,
            "switch_every_s": x.switch_every_s, "seed": x.seed}
