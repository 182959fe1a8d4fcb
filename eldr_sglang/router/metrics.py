"""Prometheus metrics of the PD router (one registry per router, so tests can run several)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_DIST_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0)
_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_FAST_BUCKETS = (0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01)


class _StateCollector:
    """Gauges read at scrape time (nothing on the request path)."""

    def __init__(self, state: Callable[[], dict]):
        self._state = state

    def collect(self):
        s = self._state()
        q = GaugeMetricFamily("eldr_router_queue_depth", "Decode load the policy sees (in-flight, blended with /v1/loads)", labels=["worker"])
        own = GaugeMetricFamily("eldr_router_inflight", "Requests this router has in flight", labels=["role", "worker"])
        rep = GaugeMetricFamily("eldr_router_reported_running", "Running requests a decode worker last reported (/v1/loads)", labels=["worker"])
        h = GaugeMetricFamily("eldr_router_worker_healthy", "1 if the worker is routable (health check passing, not ejected)",
                              labels=["role", "worker"])
        for i, v in enumerate(s["decode_loads"]):
            q.add_metric([str(i)], v)
        for i, v in enumerate(s["decode_inflight"]):
            own.add_metric(["decode", str(i)], v)
        for i, v in enumerate(s["prefill_inflight"]):
            own.add_metric(["prefill", str(i)], v)
        for i, v in enumerate(s["decode_reported"]):
            if v is not None:
                rep.add_metric([str(i)], v)
        for i, v in enumerate(s["decode_healthy"]):
            h.add_metric(["decode", str(i)], 1.0 if v else 0.0)
        for i, v in enumerate(s["prefill_healthy"]):
            h.add_metric(["prefill", str(i)], 1.0 if v else 0.0)
        ej = GaugeMetricFamily("eldr_router_worker_ejected", "1 while outlier detection keeps the worker out (ejected or on probation)",
                               labels=["role", "worker"])
        for role in ("prefill", "decode"):
            for i, w in enumerate(s.get(f"{role}_workers", [])):
                ej.add_metric([role, str(i)], 0.0 if w["circuit"] == "closed" else 1.0)
        gen = GaugeMetricFamily("eldr_router_centroid_generation", "Centroid file generation (grows on each hot reload)")
        gen.add_metric([], s["centroid_generation"])
        yield from (q, own, rep, h, ej, gen)


class RouterMetrics:
    def __init__(self, state: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("eldr_router_requests", "Client requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.routes = Counter("eldr_router_decode_routes", "Decode routing decisions by worker and reason", ["worker", "reason"], registry=r)
        self.decode_failovers = Counter(
            "eldr_router_decode_failovers", "Requests re-sent to another decode worker before any byte reached the client", registry=r
        )
        self.retries = Counter(
            "eldr_router_retries", "Requests re-sent to another worker before any byte reached the client, by role and cause",
            ["role", "cause"], registry=r,
        )
        self.retries_refused = Counter(
            "eldr_router_retries_refused", "Re-sends not made because the retry budget was spent (20% of active requests, at least 10)",
            ["role"], registry=r,
        )
        self.timeouts = Counter(
            "eldr_router_upstream_timeouts", "Worker calls cut by a timeout, by role, worker and phase (connect, first_byte, stall, total)",
            ["role", "worker", "phase"], registry=r,
        )
        self.ejections = Counter("eldr_router_ejections", "Outlier ejections of a worker", ["role", "worker"], registry=r)
        self.probation_trials = Counter(
            "eldr_router_probation_trials", "Trial requests sent to an ejected worker whose ejection ended", ["role", "worker"], registry=r
        )
        self.loads_dropped = Counter(
            "eldr_router_load_reports_dropped", "/v1/loads answers ignored, by worker and cause", ["worker", "cause"], registry=r
        )
        self.centroid_rejections = Counter(
            "eldr_router_centroid_files_rejected", "Centroid files refused on hot reload (each version once)", registry=r
        )
        self.prefill_routes = Counter("eldr_router_prefill_routes", "Prefill choices by worker", ["worker"], registry=r)
        self.fallbacks = Counter(
            "eldr_router_fallbacks", "Requests routed without a usable signature, by cause", ["reason"], registry=r
        )
        self.malformed = Counter("eldr_router_malformed_signatures", "Signature payloads that failed validation", registry=r)
        self.worker_errors = Counter("eldr_router_worker_errors", "Failed worker calls", ["role", "worker", "kind"], registry=r)
        self.disconnects = Counter("eldr_router_client_disconnects", "Clients that went away before the answer ended", registry=r)
        self.band_size = Histogram(
            "eldr_router_band_size", "Workers in the locality band", buckets=tuple(range(1, 17)), registry=r
        )
        self.d_star = Histogram("eldr_router_distance_best", "Smallest signature-centroid distance d*", buckets=_DIST_BUCKETS, registry=r)
        self.d_chosen = Histogram("eldr_router_distance_chosen", "Distance to the chosen worker's centroid", buckets=_DIST_BUCKETS, registry=r)
        self.sig_wait = Histogram(
            "eldr_router_signature_wait_seconds", "From the prefill call to a usable signature (or the fallback)", buckets=_WAIT_BUCKETS, registry=r
        )
        self.sig_bytes = Histogram(
            "eldr_router_signature_bytes", "Signature payload data size", buckets=(256, 1024, 2048, 4096, 8192, 12288, 16384, 65536), registry=r
        )
        self.route_seconds = Histogram("eldr_router_route_seconds", "Time in the routing call (decode and route)", buckets=_FAST_BUCKETS, registry=r)
        r.register(_StateCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)
