"""Prometheus metrics of the PD router (one registry per router, so tests can run several)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily


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
        adm = s.get("admission")
        if adm is not None:
            for key, doc in (("in_flight", "Requests holding an admission slot"), ("waiting", "Requests waiting in the admission queue"),
                             ("limit", "The admission bound (0: none)"),
                             ("buffered_bytes", "Request-body bytes the router holds now (bound: --max-buffered-bytes)")):
                g = GaugeMetricFamily(f"eldr_router_admission_{key}", doc)
                g.add_metric([], adm[key])
                yield g
        gen = GaugeMetricFamily("eldr_router_centroid_generation", "Centroid file generation (grows on each hot reload)")
        gen.add_metric([], s["centroid_generation"])
        off = GaugeMetricFamily("eldr_router_prefill_signature_off",
                                "1 for a prefill worker that streams no signatures, with the reason its /server_info gives",
                                labels=["worker", "reason"])
        for i, reason in enumerate(s.get("prefill_signature_off", [])):
            if reason is not None:
                off.add_metric([str(i), reason], 1.0)
        yield from (q, own, rep, h, ej, gen, off)
        x = s.get("experiment")
        if x is not None:
            # one series per arm (at most 16): 1 for the arm new requests are routed by
            arm = GaugeMetricFamily("eldr_router_experiment_arm", "Switchback experiment: 1 for the arm now routing new "
                                    "requests, 0 for the others", labels=["arm"])
            for label in x["arms"]:
                arm.add_metric([label], 1.0 if label == x["arm"] else 0.0)
            block = GaugeMetricFamily("eldr_router_experiment_block", "Switchback experiment: the current block's number")
            block.add_metric([], x["block"])
            yield from (arm, block)
        m = s.get("membership")
        if m is not None:
            yield from _membership_gauges(m)


def _membership_gauges(m: dict):
    """Membership (router/discovery/): the workers wanted, those serving, each slot's state."""
    pend = GaugeMetricFamily("eldr_router_membership_pending", "1 while the desired workers (discovery sources and "
                             "/eldr/workers) differ from the ones the router serves (until the change is applied)")
    pend.add_metric([], 1.0 if m["pending"] else 0.0)
    n = GaugeMetricFamily("eldr_router_membership_workers", "Workers by role, as discovered (desired) and as served (applied)",
                          labels=["role", "state"])
    for state in ("desired", "applied"):
        for role in ("prefill", "decode"):
            if m[state] is not None:
                n.add_metric([role, state], len(m[state][role]))
    ok = GaugeMetricFamily("eldr_router_discovery_source_ok", "1 while a discovery source's last read or call succeeded",
                           labels=["source"])
    for name, st in m["sources"].items():
        errors = [st.get("last_error")] + [r.get("last_error") for r in st.get("roles", {}).values()]
        ok.add_metric([name], 0.0 if any(errors) else 1.0)
    slots = GaugeMetricFamily("eldr_router_worker_slots", "Worker slots by role and state (serving: a member; draining: "
                              "removed, requests still in flight; free: removed and drained, reusable)",
                              labels=["role", "state"])
    for role, ws in (m.get("workers") or {}).items():
        for state in ("serving", "draining", "free"):
            slots.add_metric([role, state], sum(1 for w in ws if w["state"] == state))
    yield from (pend, n, ok, slots)


# The request path's metrics: the Rust data plane keeps the counters (rust/dataplane/src/
# counters.rs) and RequestPathMetrics exposes them under these names at scrape time.
# (name, help, label names)
REQUEST_COUNTERS = (
    ("eldr_router_requests", "Client requests by endpoint and HTTP status", ("endpoint", "status")),
    ("eldr_router_decode_routes", "Decode routing decisions by worker and reason", ("worker", "reason")),
    ("eldr_router_decode_failovers", "Requests re-sent to another decode worker before any byte reached the client", ()),
    ("eldr_router_retries",
     "Requests re-sent to another worker before any byte reached the client, by role and cause", ("role", "cause")),
    ("eldr_router_retries_refused",
     "Re-sends not made because the retry budget was spent (20% of active requests, at least 10)", ("role",)),
    ("eldr_router_upstream_timeouts",
     "Worker calls cut by a timeout, by role, worker and phase (connect, first_byte, progress: a decode stream's "
     "head, stall, total; client_gone: a decode "
     "silent for 10 s, or its first-byte timeout if shorter, when the client left)", ("role", "worker", "phase")),
    ("eldr_router_ejections", "Outlier ejections of a worker", ("role", "worker")),
    ("eldr_router_probation_trials", "Trial requests sent to an ejected worker whose ejection ended", ("role", "worker")),
    ("eldr_router_prefill_routes", "Prefill choices by worker", ("worker",)),
    ("eldr_router_fallbacks", "Requests routed without a usable signature, by cause", ("reason",)),
    ("eldr_router_malformed_signatures", "Signature payloads that failed validation", ()),
    ("eldr_router_worker_errors", "Failed worker calls", ("role", "worker", "kind")),
    ("eldr_router_client_disconnects", "Clients that went away before the answer ended", ()),
    # admission control and overload
    ("eldr_router_admission_admitted", "Requests admitted, at once or after waiting in the queue", ("how",)),
    ("eldr_router_admission_queued", "Requests that had to wait in the admission queue", ()),
    ("eldr_router_admission_rejected",
     "Requests refused by admission control: queue full (429), queue timeout (503) or buffer full (503: the "
     "request bodies held would pass --max-buffered-bytes)", ("reason",)),
    ("eldr_router_panic_routes", "Requests routed with no routable worker of the role (panic mode)", ("role",)),
    ("eldr_router_overload_timeouts",
     "Worker timeouts not charged to the worker: the other workers of its role were slow too (none answered meanwhile)",
     ("role", "worker")),
    ("eldr_router_client_connection_errors",
     "Client connections closed by the router or failed, by cause (header_timeout: no request head in time; idle_timeout: "
     "none after an answer; bad_request, incomplete, aborted, io, accept)",
     ("kind",)),
    ("eldr_router_output_tokens",
     "Output tokens of answers that ended whole, by decode policy, decode worker and endpoint (SGLang's "
     "completion_tokens when the answer carries it, else its stream events)", ("policy", "worker", "endpoint")),
)
# (name, help); the bucket bounds come with the data plane's snapshot
REQUEST_HISTOGRAMS = (
    ("eldr_router_band_size", "Workers in the locality band"),
    ("eldr_router_distance_best", "Smallest signature-centroid distance d*"),
    ("eldr_router_distance_chosen", "Distance to the chosen worker's centroid"),
    ("eldr_router_signature_wait_seconds", "From the prefill call to a usable signature (or the fallback)"),
    ("eldr_router_signature_bytes", "Signature payload data size"),
    ("eldr_router_route_seconds", "Time in the routing call (decode and route)"),
)
# Latency on the request path, labelled by decode policy, decode worker and endpoint (the
# prefill leg by policy and endpoint); measured in the data plane from the streamed bytes.
# Under a switchback experiment the policy label is the arm's (`locality/0.05`): at most 16.
LATENCY_HISTOGRAMS = {
    "eldr_router_ttft_seconds": "Time to first token: the client's request arriving to the decode's first chunk going "
                                "back (streamed answers)",
    "eldr_router_tpot_seconds": "Time per output token of a streamed answer: (last token - first token) / (tokens - 1)",
    "eldr_router_itl_seconds": "Inter-token latency: the gap before each streamed chunk that carries tokens",
    "eldr_router_e2e_seconds": "End to end: the client's request arriving to the answer's last byte",
    "eldr_router_prefill_seconds": "The prefill leg: the prefill call to the end of its answer (the KV handed over)",
}


class RequestPathMetrics:
    """The data plane's request-path counters, read at scrape time (`snapshot()` is
    `DataPlane.counters()`)."""

    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        snap = self._snapshot()
        for name, doc, labels in REQUEST_COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=labels)
            series = snap["counters"].get(name, [])
            for values, v in series:
                fam.add_metric(list(values), v)
            if not labels and not series:
                fam.add_metric([], 0)
            yield fam
        for name, doc in REQUEST_HISTOGRAMS:
            got = snap["histograms"].get(name)
            if got is None:
                continue
            bounds, counts, total = got
            cum, buckets = 0, []
            for b, c in zip([*bounds, float("inf")], counts):
                cum += c
                buckets.append((floatToGoString(b), cum))
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)
        for name, label_names, bounds, series in snap.get("labelled_histograms", []):
            fam = HistogramMetricFamily(name, LATENCY_HISTOGRAMS.get(name, name), labels=list(label_names))
            for values, counts, total in series:
                cum, buckets = 0, []
                for b, c in zip([*bounds, float("inf")], counts):
                    cum += c
                    buckets.append((floatToGoString(b), cum))
                fam.add_metric(list(values), buckets, sum_value=total)
            yield fam


class RouterMetrics:
    """`state`: the control plane's /eldr/status dict (gauges); `counters`: the data plane's
    counter snapshot (the request path's metrics)."""

    def __init__(self, state: Callable[[], dict], counters: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        r.register(RequestPathMetrics(counters))
        self.loads_dropped = Counter(
            "eldr_router_load_reports_dropped", "/v1/loads answers ignored, by worker and cause", ["worker", "cause"], registry=r
        )
        self.occupancy_dropped = Counter(
            "eldr_router_occupancy_reports_dropped", "decode occupancy reports ignored, by worker and cause", ["worker", "cause"],
            registry=r,
        )
        self.centroid_rejections = Counter(
            "eldr_router_centroid_files_rejected", "Centroid files refused on hot reload (each version once)", registry=r
        )
        r.register(_StateCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)
