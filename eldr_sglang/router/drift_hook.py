"""Drift detection and online refits inside the PD router service.

The hook is deliberately small and keeps everything expensive off the request path:

- `on_route(decision, counts=None)` (called after each counts-policy decision; the router
  service drains them from the Rust data plane in batches, `ControlPlane.sync_drift`): the
  DriftMonitor update is O(K). The data plane draws the reservoir's keep/slot decision
  before it routes (rust/dataplane/src/reservoir.rs) and hands it over with the decision
  (`DriftView.offer`), with the unit signature only when the reservoir stores it, so the
  route copies a signature for the few stored requests only. A decision from elsewhere (a
  Python-side Router) is offered with its `unit_signature()` (O(D)), or, made without one,
  the signature of dense `counts` by the current centroid file's spec (O(L*E)), computed
  only when stored. Nothing else happens on the event loop.
- A background task (`run`) checks the trigger once a second in a worker thread
  (`asyncio.to_thread`: drawing the reservoir sample copies up to capacity x D floats) and
  collects finished refits. The refit itself runs in a spawned, niced process.
- The refitted file replaces the configured centroid file atomically; the router's own
  reload loop (`reload_centroids`) picks it up, and the monitor rebases on the new
  baseline when it sees the new generation in the decisions.
- `/metrics` gets `eldr_drift_*` / `eldr_refit_*` gauges (read at scrape time);
  `GET /eldr/drift` returns the status JSON; `POST /eldr/refit` (optional JSON body
  `{"force": true, "reason": "..."}`) starts a refit: 202 when accepted, 409 while one runs
  or in the cooldown, 422 when the reservoir holds too few signatures, 404 when drift
  handling is off (no centroid file or a baseline policy). It is a control endpoint: 403
  unless the router has an admin token, 401 without `Authorization: Bearer TOKEN`
  (eldr_sglang.router.admin). The refit keeps the replaced file as FILE.prev.

Options (keyword arguments of `install`, or a `drift` dict attribute on the router config;
all optional):
`enabled` (default True for policy eldr with a centroid file), `refit_on_drift` (True),
`interval_s` (None: no scheduled refits), `cooldown_s` (300), `window` (512),
`reservoir_capacity` (4096), `reservoir_horizon` (16384), `executor` ("process").
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import numpy as np

from eldr_sglang.drift.monitor import DriftMonitor
from eldr_sglang.drift.refit import RefitController
from eldr_sglang.drift.reservoir import DEFAULT_CAPACITY, DEFAULT_HORIZON

logger = logging.getLogger("eldr.drift")
_NOT_DRAWN = object()  # a decision that did not come from the data plane with its reservoir draw


class DriftHook:
    def __init__(self, pd, *, refit_on_drift: bool = True, interval_s: float | None = None, cooldown_s: float = 300.0,
                 window: int = 512, reservoir_capacity: int = DEFAULT_CAPACITY, reservoir_horizon: int = DEFAULT_HORIZON,
                 executor="process", check_interval_s: float = 1.0, admin_token: str | None = None):
        self.pd = pd
        self.admin_token = admin_token
        router = pd.router
        path = pd.cfg.centroids
        self.check_interval_s = float(check_interval_s)
        # num_workers: a baseline whose shares are for another K is refused, at start and on a rebase
        monitor = DriftMonitor(router.centroid_set().provenance_json, window=window, num_workers=int(router.centroid_set().num_workers),
                               baseline_loader=self._baseline, on_window=self._on_window)
        # router=None: the router's own reload loop picks the new file up (and refreshes its layout).
        # A refit fits K = the decode members now (live membership: the router reloads a file
        # whose K is that number).
        members = getattr(pd, "members", None)
        self.ctl = RefitController(path, router=None, monitor=monitor, on_drift=refit_on_drift, interval_s=interval_s,
                                   cooldown_s=cooldown_s, executor=executor,
                                   reservoir_kw=dict(capacity=reservoir_capacity, horizon=reservoir_horizon),
                                   workers=(lambda: [u for _, u in members("decode")]) if members is not None else None)
        dp = getattr(pd, "dataplane", None)
        if dp is not None and dp.reservoir_shape != self.ctl.reservoir.shape:
            self.ctl.close()
            raise ValueError(f"the data plane draws for a reservoir of shape {dp.reservoir_shape} (per_bucket, span), "
                             f"the drift hook's is {self.ctl.reservoir.shape}")
        self._spec = None
        self._spec_gen = -1
        self.signature_errors = 0
        self._last_logged_refit = 0

    def _baseline(self) -> str:
        """The serving centroid file's provenance, to rebase on; its K is the monitor's from
        now on (a refit after a membership change fits another K)."""
        cs = self.pd.router.centroid_set()
        self.ctl.monitor.num_workers = int(cs.num_workers)
        return cs.provenance_json

    # ---------------------------------------------------------------- decisions
    def on_route(self, decision, counts=None) -> None:
        """One routed request. Never raises into its caller."""
        try:
            self.ctl.monitor.observe_decision(decision)
            if decision.reason != "band":
                return
            offer = getattr(decision, "offer", _NOT_DRAWN)
            if offer is not _NOT_DRAWN:  # the data plane drew for it (None: not an offer)
                if offer is not None:
                    self.ctl.reservoir.offer(offer[0], offer[1], decision.unit_signature)
                return
            kept = decision.unit_signature() if hasattr(decision, "unit_signature") else None
            if kept is not None:
                self.ctl.reservoir.add_lazy(lambda: kept)
                return
            if counts is None:
                return
            gen = int(decision.generation)
            if gen != self._spec_gen:
                cs = self.pd.router.centroid_set()
                self._spec, self._spec_gen = (cs.spec() if cs is not None else None), gen
            spec = self._spec
            if spec is None:
                return
            if hasattr(counts, "to_layout"):  # decoded wire counts (the route did not keep the signature)
                def make():
                    return spec.from_dense(counts.to_layout(spec.num_layers, spec.num_experts))
            else:
                def make():
                    return spec.from_dense(counts)
            self.ctl.reservoir.add_lazy(make)  # computed only when the reservoir keeps it
        except Exception as exc:  # a signature the router accepted but the spec rejects: count it, move on
            self.signature_errors += 1
            if self.signature_errors <= 3:
                logger.warning("drift hook skipped a request: %s", exc)

    def _on_window(self, w: dict) -> None:
        """One log line per closed window (every `window` routed requests)."""
        msg = "drift monitor: %d requests, mean d* %.4f (%+.2f baseline s.d.), share JS %.4f, TV %.3f"
        args = (w["n"], w["mean_d_star"], w["d_shift"], w["js"], w["tv"])
        if w["out_of_profile"]:
            logger.warning(msg + " -- out of profile: %s", *args, "; ".join(w["reasons"]))
        else:
            logger.info(msg, *args)

    # ---------------------------------------------------------------- background
    def check(self) -> str | None:
        """Trigger check + collection of a finished refit (runs in a worker thread)."""
        fired = self.ctl.maybe_trigger()
        st = self.ctl.poll()
        if fired:
            logger.warning("refit started: %s", fired)
        done = st["refits"] + st["failures"]
        if done != self._last_logged_refit:
            self._last_logged_refit = done
            if st["last_ok"]:
                logger.info("refit finished (%s): %s signatures in %s s, new checksum %#x, mean centroid cosine %.3f",
                            st["last_reason"], st["last_signatures"], st["last_seconds"], st["last_checksum"] or 0,
                            st["last_mean_centroid_similarity"] or float("nan"))
            else:
                logger.error("refit failed (%s): %s", st["last_reason"], st["last_error"])
        return fired

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            try:
                await asyncio.to_thread(self.check)
            except Exception as exc:  # keep the loop alive; the status says what failed
                logger.error("drift check failed: %s", exc)

    def close(self) -> None:
        self.ctl.close()

    # ---------------------------------------------------------------- HTTP
    async def handle_refit(self, request):
        from aiohttp import web

        from eldr_sglang.router.admin import denied
        from eldr_sglang.router.logsafe import safe

        refusal = denied(request, self.admin_token)
        if refusal is not None:
            return refusal
        body = {}
        if request.can_read_body:
            try:
                body = await request.json()
            except (json.JSONDecodeError, ValueError):
                return web.json_response({"error": {"message": "the body must be JSON, e.g. {\"force\": true}"}}, status=400)
            except RecursionError:
                return web.json_response({"error": {"message": "the body is nested too deeply"}}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"error": {"message": "the body must be a JSON object"}}, status=400)
        force = body.get("force", False)
        reason = body.get("reason", "POST /eldr/refit")
        if not isinstance(force, bool) or not isinstance(reason, str):
            return web.json_response({"error": {"message": "force must be a boolean and reason a string"}}, status=400)
        reason = safe(reason, 200)  # it reaches log lines and the file's provenance: one escaped line
        self._sync()  # the reservoir holds every signature served so far
        r = await asyncio.to_thread(self.ctl.request, reason, force)
        status = 202 if r["accepted"] else {"running": 409, "cooldown": 409, "too_few": 422}.get(r.get("why"), 409)
        return web.json_response(r, status=status)

    def _sync(self) -> None:
        """Take in the decisions a data plane has queued but not handed over yet (the Rust
        data plane's feed is batched), so a report counts every request served so far."""
        sync = getattr(self.pd, "sync_drift", None)
        if sync is not None:
            sync()

    async def handle_status(self, _request):
        from aiohttp import web

        self._sync()
        st = await asyncio.to_thread(self.ctl.poll)
        st["signature_errors"] = self.signature_errors
        return web.json_response(json.loads(json.dumps(st, default=_json_safe)))

    # ---------------------------------------------------------------- metrics
    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self._sync()
        st = self.ctl.status()
        m = st["monitor"]

        def g(name, doc, value):
            f = GaugeMetricFamily(name, doc)
            f.add_metric([], float(value) if value is not None else math.nan)
            return f

        yield g("eldr_drift_mean_d_star", "Mean assignment distance d* of the last closed window", m["mean_d_star"])
        yield g("eldr_drift_baseline_mean_d_star", "Mean d* of the fit's baseline (centroid file provenance)", m["baseline_mean_d_star"])
        yield g("eldr_drift_d_shift_sd", "Last window's mean-d* shift from the baseline, in baseline standard deviations", m["d_shift"])
        yield g("eldr_drift_share_js", "Jensen-Shannon divergence of the last window's nearest-centroid shares from the baseline", m["share_js"])
        yield g("eldr_drift_share_tv", "Total variation distance of the last window's nearest-centroid shares from the baseline", m["share_tv"])
        yield g("eldr_drift_detected", "1 while drift is reported (patience consecutive windows out of profile)", 1.0 if m["drifted"] else 0.0)
        yield g("eldr_drift_out_of_profile_windows", "Consecutive out-of-profile windows so far", m["out_of_profile_windows"])
        c = CounterMetricFamily("eldr_drift_windows", "Closed monitor windows", labels=["profile"])
        c.add_metric(["in"], m["windows"] - m["windows_out_of_profile_total"])
        c.add_metric(["out"], m["windows_out_of_profile_total"])
        yield c
        c = CounterMetricFamily("eldr_drift_observations", "Routed requests with a signature seen by the drift monitor")
        c.add_metric([], m["observations"])
        yield c
        c = CounterMetricFamily("eldr_refits", "Finished refits by result", labels=["result"])
        c.add_metric(["ok"], st["refits"])
        c.add_metric(["error"], st["failures"])
        yield c
        yield g("eldr_refit_running", "1 while a refit runs in the background", 1.0 if st["running"] else 0.0)
        yield g("eldr_refit_last_seconds", "Duration of the last successful refit", st["last_seconds"])
        yield g("eldr_reservoir_signatures", "Signatures stored in the refit reservoir", st["reservoir"]["stored"])
        yield g("eldr_drift_hook_signature_errors", "Requests the drift hook skipped", self.signature_errors)


def _json_safe(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    return str(o)


def check_baseline(provenance_json: str, num_workers: int, path) -> None:
    """A centroid file that carries a drift baseline must carry a usable one: shares for its K
    workers, finite statistics. Raises ValueError naming the file (the router refuses to start);
    a file with no baseline at all is fine (drift handling is then off, with a warning)."""
    from eldr_sglang.drift.monitor import baseline_from_provenance

    try:
        prov = json.loads(provenance_json or "{}")
    except json.JSONDecodeError:
        prov = None
    if not isinstance(prov, dict) or prov.get("baseline") is None:
        return
    try:
        baseline_from_provenance(prov, num_workers)
    except ValueError as exc:
        raise ValueError(f"centroid file {path}: its drift baseline is unusable: {exc}. Rewrite the file with "
                         "`eldr fit` or `eldr refit`, or start with --no-eldr-drift to route on it without drift "
                         "handling") from None


def install(app, pd, admin_token: str | None = None, **options) -> DriftHook | None:
    """Attach drift handling to the router app: sets `pd.drift`, adds `POST /eldr/refit`,
    `GET /eldr/drift`, the gauges, and the background task. Returns None (and adds 404
    answers for the two endpoints) when drift handling is off. Options: a `drift` dict on
    the router config if it has one, overridden by keyword arguments (see the module doc)."""
    from aiohttp import web

    conf = dict(getattr(pd.cfg, "drift", None) or {})
    conf.update(options)
    from eldr_sglang.router.config import COUNTS_POLICIES

    enabled = conf.pop("enabled", True) and pd.cfg.policy in COUNTS_POLICIES and bool(pd.cfg.centroids)
    hook = None
    if enabled:
        check_baseline(pd.router.centroid_set().provenance_json, len(pd.members("decode")), pd.cfg.centroids)
        try:
            hook = DriftHook(pd, admin_token=admin_token, **conf)
        except (ValueError, OSError) as exc:  # e.g. a centroid file without a baseline: route on, without drift handling
            logger.warning("drift handling off: %s", exc)
    pd.drift = hook
    if hook is None:
        async def off(_request):
            return web.json_response({"error": {"message": "drift handling is off: it needs the eldr or locality policy and a centroid "
                                                           "file with a drift baseline, and --no-eldr-drift turns it off"}},
                                     status=404)
        app.router.add_post("/eldr/refit", off)
        app.router.add_get("/eldr/drift", off)
        return None
    app.router.add_post("/eldr/refit", hook.handle_refit)
    app.router.add_get("/eldr/drift", hook.handle_status)
    pd.metrics.registry.register(hook)

    async def lifecycle(_app):
        task = asyncio.ensure_future(hook.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(hook.close)

    app.cleanup_ctx.append(lifecycle)
    return hook
