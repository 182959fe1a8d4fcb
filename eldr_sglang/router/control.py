"""The router's control plane: what the background loops, the admin endpoints and /metrics
act on. The request path is the Rust data plane's (`eldr_sglang._core.DataPlane`, crate
rust/dataplane), and so is the routing state: worker health, ejections and in-flight counts
live in the core's worker sets (rust/core/src/workers.rs), reported loads in the core Router's
queue tracker, which the data plane routes on. The control plane reports into them through
small typed calls (`health_check`, `set_healthy`, `report_load`, `set_prefill_signature`, the
centroid reload) and reads them back for /eldr/status; it never routes.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from eldr_sglang.router.config import DRIFT_QUEUE, UNSTARTED_CONTROL_URL, RouterConfig, check_centroids, plane_config
from eldr_sglang.router.dataplane import DriftView
from eldr_sglang.router.logsafe import RateLimitedLog, safe
from eldr_sglang.router.metrics import RouterMetrics

logger = logging.getLogger("eldr.router")

# A decode worker running at least FOREIGN_MIN requests this router did not send, FOREIGN_POLLS
# polls in a row, is shared (a request of ours sent while the poll is in flight counts one).
FOREIGN_MIN = 2
FOREIGN_POLLS = 3
# policies that read no loads, so cannot herd on them
LOAD_BLIND = ("random", "round_robin")


class ControlPlane:
    def __init__(self, cfg: RouterConfig, control_url: str = UNSTARTED_CONTROL_URL):
        from eldr_sglang import _core

        self.cfg = cfg
        check_centroids(cfg.policy, cfg.experiment, cfg.centroids)  # a config built in code, as the command line's
        # reload_interval_ms=0: the route path never touches the file (its own rate-limited
        # check would stat and read it on a data-plane thread); the control plane checks the
        # file in a worker thread instead (reload_centroids).
        # The router is made from the config's spec, checked once by the core (its policy,
        # costs, tau, load factor and binding: the data plane reads the binding from it).
        # The Rust set holds a private copy of the centroid file's bytes, so an in-place
        # overwrite of the user's file cannot fault a route; a bad file is rejected on reload.
        # Its reader opens regular files only, without blocking, and checks the header against
        # the size before reading the body (a FIFO or a huge file fails fast, at start too).
        try:
            self.router = _core.Router.from_spec(cfg.spec, num_workers=len(cfg.decode), centroids=cfg.centroids or None,
                                                 reload_interval_ms=0, load_report_ttl_ms=cfg.load_report_ttl_ms)
        except _core.CentroidFileError as exc:
            raise ValueError(str(exc)) from None
        self.router.replicas = cfg.router_replicas  # projected requests of the other replicas (queue.rs)
        self._generation = self.router.centroid_generation
        self._reload_failures = 0
        self.on_centroids_reloaded()
        # The data plane routes on this very Router (shared, not copied).
        self.dataplane = _core.DataPlane(plane_config(cfg, control_url), self.router)
        # The control plane's own note, for /eldr/status and the gauges only (routes read the
        # data plane's state): what the /server_info probe found about each prefill (None: not
        # known yet). The decode workers' /v1/loads reports live in the queue tracker alone.
        # Each is keyed by the worker's slot (the data plane's index, stable while it is a
        # member; a slot reused by a later worker is cleared by `forget`).
        self.prefill_signs: dict[int, bool | None] = {}
        # why a prefill streams none, as its /server_info says (None: it does, or not known yet)
        self.prefill_signature_off: dict[int, str | None] = {}
        # per decode worker: requests its last /v1/loads counted that this router did not send
        # (another router replica, or clients that reach the worker directly), and for how
        # many polls in a row there were at least FOREIGN_MIN of them
        self.foreign_requests: dict[int, int] = {}
        self._foreign_polls: dict[int, int] = {}
        self.pollers = None  # eldr_sglang.router.loads.WorkerPollers, set by the app's lifecycle
        self._foreign_warned = False
        self.session: aiohttp.ClientSession | None = None
        self._reload_pool = None  # one thread: a stuck file read never takes another thread
        self._reload_busy_since: float | None = None
        self.drift = None  # eldr_sglang.router.drift_hook.DriftHook, set by the app when enabled
        self.membership = None  # eldr_sglang.router.discovery.hook.MembershipHook, set by the app with discovery
        self._drift_dims: dict[int, int] = {}  # centroid generation -> signature dim
        self.metrics = RouterMetrics(self.state, self.dataplane.counters)
        self._log = RateLimitedLog(logger)

    # ------------------------------------------------------------------ reports into the data plane
    def set_healthy(self, role: str, i: int, ok: bool) -> None:
        """A health check's verdict (the data plane combines it with its outlier ejection)."""
        self.dataplane.set_healthy(role, i, ok)

    def inflight(self, i: int) -> int:
        """This router's in-flight requests on decode worker i (every arm's)."""
        return self.router.inflight()[i]

    def report_load(self, i: int, running: int, inflight_at_poll: int | None = None) -> None:
        """Decode worker i's /v1/loads count, blended into the queue tracker's load: the part
        of it that is not this router's (`inflight_at_poll`: ours when the poll was sent)."""
        self.router.report_load(i, running, inflight_at_poll)
        if inflight_at_poll is not None:
            self._note_foreign(i, max(0, running - inflight_at_poll))

    def occupancy_poll(self, i: int):
        """For a load poll of decode worker i: (layers, experts, this router's expert sums on
        it now) when the locality balancer tracks experts and occupancy reports are on; None
        otherwise (the poll then asks for no report)."""
        if not self.cfg.occupancy_reports:
            return None
        layout = self.router.occupancy_layout()
        snap = self.router.occupancy_snapshot(i) if layout else None
        return (layout[0], layout[1], snap) if snap is not None else None

    def report_occupancy(self, i: int, snapshot, idle) -> None:
        """Decode worker i's occupancy report, blended into the locality state (ValueError
        when it does not fit; the state is then unchanged)."""
        self.router.report_occupancy(snapshot, idle)

    def clear_occupancy(self, i: int) -> None:
        """Route on this router's own view of decode worker i's experts again."""
        if i < len(self.router.inflight()):
            self.router.clear_occupancy(i)

    def _note_foreign(self, i: int, foreign: int) -> None:
        """Say once when a decode worker keeps running requests this router did not send: with
        several router replicas, a policy that reads loads herds between polls (simulated:
        benchmarks/results/replicas_study.md)."""
        self.foreign_requests[i] = foreign
        self._foreign_polls[i] = self._foreign_polls.get(i, 0) + 1 if foreign >= FOREIGN_MIN else 0
        told = self.router.replicas > 1  # --router-replicas: the user has said so already
        if self._foreign_polls[i] >= FOREIGN_POLLS and not (self._foreign_warned or told) and self.router.policy not in LOAD_BLIND:
            self._foreign_warned = True
            logger.warning("decode %d has run %d or more requests this router did not send for %d polls in a row "
                           "(another router replica, or clients reaching it directly?). With several replicas, "
                           "--disagg-router %s herds between load polls: give every replica --router-replicas N "
                           "(the number of replicas) or --load-monitor-interval 0, or run one (docs/operations.md, "
                           "'Several router replicas'). Said once.",
                           i, FOREIGN_MIN, FOREIGN_POLLS, self.router.policy)

    def health_check(self, role: str, i: int, ok: bool, threshold: int) -> None:
        """One /health check's result; the data plane's worker set counts failures in a row."""
        self.dataplane.health_check(role, i, ok, threshold)

    def set_prefill_signs(self, i: int, signs: bool | None, reason: str | None = None) -> None:
        """Whether prefill i streams signatures (and why not): one that does not is bound early."""
        self.prefill_signs[i] = signs
        self.prefill_signature_off[i] = None if signs else reason
        self.dataplane.set_prefill_signature(i, signs)

    # ------------------------------------------------------------------ membership
    def members(self, role: str) -> list[tuple[int, str]]:
        """The role's current workers, (slot, url) in slot order (the data plane's)."""
        return [(int(slot), url) for slot, url in self.dataplane.members(role)]

    def forget(self, role: str, slot: int) -> None:
        """Drop the control plane's notes on a slot whose worker left (a later worker that
        reuses the slot starts fresh, as the data plane's state for it does)."""
        if role == "prefill":
            self.prefill_signs.pop(slot, None)
            self.prefill_signature_off.pop(slot, None)
        else:
            self.foreign_requests.pop(slot, None)
            self._foreign_polls.pop(slot, None)

    # ------------------------------------------------------------------ state
    def on_centroids_reloaded(self) -> None:
        cs = self.router.centroid_set()
        n = len(self.members("decode")) if hasattr(self, "dataplane") else len(self.cfg.decode)
        if cs is not None and cs.num_workers != n:
            raise ValueError(f"the centroid file has {cs.num_workers} workers, the router {n} decode workers")

    def experiment(self, blocks: bool = False) -> dict | None:
        """The switchback experiment (None: none): the current arm and block; with `blocks`,
        every block's statistics too (GET /eldr/experiment)."""
        import json

        text = self.dataplane.experiment(blocks)
        return None if text is None else json.loads(text)

    def state(self) -> dict:
        dp = self.dataplane
        pre, dec = dp.workers("prefill"), dp.workers("decode")
        reload_error = self.router.last_reload_error
        experiment = self.experiment()
        return {
            "data_plane": "rust",
            # under an experiment, the arm new requests are routed by
            "policy": experiment["arm"] if experiment else self.cfg.policy,
            "experiment": experiment,
            "late_binding": self.cfg.late_binding,
            "decode_loads": list(self.router.loads()),
            "decode_inflight": list(self.router.inflight()),
            "prefill_inflight": [w["inflight"] for w in pre],
            "decode_reported": self.router.reported(),
            # whether the locality state routes on each decode worker's own occupancy report now
            "decode_occupancy_reported": self.router.occupancy_reported(),
            "decode_foreign_requests": [self.foreign_requests.get(i, 0) for i in range(len(dec))],
            "router_replicas": self.router.replicas,
            "decode_healthy": dp.routable("decode"),
            "prefill_healthy": dp.routable("prefill"),
            "admission": dp.admission(),
            "decode_workers": dec,
            "prefill_workers": pre,
            "prefill_signatures": [self.prefill_signs.get(i) for i in range(len(pre))],
            "prefill_signature_off": [self.prefill_signature_off.get(i) for i in range(len(pre))],
            "centroid_generation": int(self.router.centroid_generation),
            "centroid_reload_failures": int(self.router.reload_failures),
            "last_reload_error": reload_error,
            "centroid_file": {"path": self.cfg.centroids, "ok": reload_error is None} if self.cfg.centroids else None,
            "tau": float(self.router.tau),
            "load_factor": self.router.load_factor,
            "paged_experts": self.router.paged_experts,
            "decode_expert_distinct": self.router.expert_distinct(),  # locality only, else None
            # {"desired", "applied", "pending", "workers": {role: [{slot, url, state}]}, ...}
            "membership": self._membership(pre, dec),
        }

    def _membership(self, pre: list[dict], dec: list[dict]) -> dict | None:
        if self.membership is None:
            return None
        st = self.membership.status()
        st["workers"] = {role: [{"slot": w.get("slot", i), "url": w["url"], "state": w.get("state", "serving")}
                                for i, w in enumerate(ws)] for role, ws in (("prefill", pre), ("decode", dec))}
        return st

    # ------------------------------------------------------------------ drift
    def sync_drift(self) -> None:
        """Hand the drift monitor every decision the data plane made so far (the feed calls
        it periodically, the drift hook before it reports)."""
        hook = self.drift
        if hook is None:
            return
        for gen, reason, distances, sig, offer in self.dataplane.take_drift(DRIFT_QUEUE):
            dim = self._drift_dims.get(gen)
            if dim is None:
                cs = self.router.centroid_set()
                dim = self._drift_dims[gen] = cs.dim if cs is not None else 0
            hook.on_route(DriftView(gen, reason, distances, sig, dim, offer), None)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """The session the background loops and the worker passthrough call workers with."""
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=conn,
            timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s, sock_connect=self.cfg.connect_timeout_s),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self._reload_pool is not None:
            self._reload_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ hot reload
    def check_centroids(self) -> bool:
        """Hot reload, blocking (call it off the event loop): True when a new centroid file is
        serving. A bad file (a FIFO, a device, a huge or corrupt file: the Rust reader refuses
        each without blocking or reading it whole) raises CentroidFileError once per version
        and the previous centroids keep serving."""
        from eldr_sglang import _core

        if not self.cfg.centroids:
            return False
        self.router.maybe_reload()
        failures = self.router.reload_failures
        if failures != self._reload_failures:
            self.metrics.centroid_rejections.inc(failures - self._reload_failures)
            self._reload_failures = failures
            raise _core.CentroidFileError(self.router.last_reload_error or "centroid file rejected")
        gen = self.router.centroid_generation
        if gen == self._generation:
            return False
        self._generation = gen
        self.on_centroids_reloaded()
        return True

    async def reload_centroids(self) -> None:
        """One hot-reload check in the reload thread; the event loop only awaits it. A check
        still running (a slow disk, a file system that blocks) is never stacked on."""
        import concurrent.futures as cf

        from eldr_sglang import _core

        if self._reload_busy_since is not None:
            stuck = time.monotonic() - self._reload_busy_since
            self._log.warning("reload-stuck", "centroid reload check still running after %.0f s", stuck)
            return
        if self._reload_pool is None:
            self._reload_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eldr-reload")
        self._reload_busy_since = time.monotonic()
        fut = asyncio.get_running_loop().run_in_executor(self._reload_pool, self.check_centroids)
        fut.add_done_callback(lambda _f: setattr(self, "_reload_busy_since", None))
        try:
            if await asyncio.shield(fut):
                logger.info("centroids reloaded from %s (generation %d)", self.cfg.centroids, self.router.centroid_generation)
        except _core.CentroidFileError as exc:
            logger.warning("centroid reload rejected, keeping the previous file: %s", safe(str(exc), 500))
