"""Type stubs for the Rust hot path (`eldr_sglang._core`, built from rust/python).

Shapes: L = layers in the count input (MoE layers of the trace, or hidden layers of
SGLang output where dense layers carry weight 0), E = experts per layer, K = decode
workers, D = (number of selected layers) * E = signature dimension.

Sizes are bounded before anything is allocated: K, L and E at most 2^20 each, one buffer
(an [L, E] count table, a batch of signatures) at most 2^28 elements; beyond that a
ValueError names the argument. Routing, acquire and release release the GIL.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

# The classes are frozen PyO3 classes, which cannot be subclassed (final).

__all__ = [
    "__version__", "FORMAT_VERSION", "POLICIES", "COUNTS_POLICIES", "PREFILL_POLICIES", "DEFAULT_POLICY",
    "DEFAULT_PREFILL_POLICY", "DEFAULT_TAU", "DEFAULT_LOAD_FACTOR", "DEFAULT_REQUEST_COST", "MAX_TAU", "MAX_LOAD_FACTOR", "MAX_REQUEST_COST",
    "MAX_EXPERTS", "RouterSpec", "parse_arms", "parse_policy_label", "FALLBACK_REASONS", "CentroidFileError", "NoSignature", "NoHealthyWorker", "PayloadError",
    "ProfileError", "PAYLOAD_KEY", "PAYLOAD_MAX_ENTRIES", "PAYLOAD_MAX_LAYERS", "PAYLOAD_MAX_COUNT", "SignatureSpec",
    "CentroidSet", "Decision", "Lease", "OccupancySnapshot", "ExpertProfile", "Router", "DecodedCounts", "decode_payload", "decode_event",
    "count_topk", "distinct_per_layer", "write_centroids", "band_sizes", "DataPlane", "ReservoirSampler",
]
__version__: str
FORMAT_VERSION: int
POLICIES: tuple[str, ...]  # every decode policy the Router builds
COUNTS_POLICIES: tuple[str, ...]  # those routing on the prefill's counts: late binding, a centroid file, fallbacks
PREFILL_POLICIES: tuple[str, ...]  # those that can also place requests on prefill workers
DEFAULT_POLICY: str  # the decode policy when none is given ("locality")
DEFAULT_PREFILL_POLICY: str  # the prefill placement when none is given ("round_robin")
DEFAULT_TAU: float  # ELDR's band width when neither the caller nor the centroid file gives one
DEFAULT_LOAD_FACTOR: float  # the bounded-load cap of eldr/F and locality/F
DEFAULT_REQUEST_COST: float  # the locality cost's per-request term r when none is given
MAX_TAU: float  # tau lies in [0, MAX_TAU] (2: cosine distances lie in [0, 2])
MAX_LOAD_FACTOR: float  # a load factor lies in [0, MAX_LOAD_FACTOR]
MAX_REQUEST_COST: float  # the locality cost's request term lies in [0, MAX_REQUEST_COST]
MAX_EXPERTS: int  # experts per MoE layer (2^20: the centroid file's bound; --eldr-paged-experts' too)
FALLBACK_REASONS: tuple[str, ...]  # why a counts policy routed without a signature (NoSignature reasons + 'no_centroids')
PAYLOAD_KEY: str  # "eldr_signature": the stream-event field that carries the counts payload
PAYLOAD_MAX_ENTRIES: int  # largest L*E a payload may claim
PAYLOAD_MAX_LAYERS: int
PAYLOAD_MAX_COUNT: int

class PayloadError(ValueError):
    """A counts payload (the `eldr_signature` field) is malformed; the message says what is wrong."""

@final
class DecodedCounts:
    """Validated counts from a prefill's payload, still packed (routing reads them in place)."""

    @property
    def layers(self) -> tuple[int, ...]: ...  # hidden-layer ids of the rows
    @property
    def num_experts(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def exact(self) -> bool: ...  # False for the lossy log encoding
    @property
    def encoding(self) -> Literal["dense", "sparse", "log"]: ...
    @property
    def bits(self) -> int: ...
    @property
    def data_bytes(self) -> int: ...  # length of the base64 data field
    @property
    def counts(self) -> npt.NDArray[np.float32]: ...  # dense [len(layers), E], rows in payload order
    def to_layout(self, num_layers: int, num_experts: int) -> npt.NDArray[np.float32]:
        """Dense [num_layers, E] in a centroid file's layout. Raises PayloadError."""

def decode_payload(data: bytes | str, max_bytes: int = ..., layout: tuple[int, int] | None = None) -> DecodedCounts:
    """A payload's JSON text (object, [object] or a JSON string of one) -> counts. GIL released.
    Raises PayloadError (also when the payload says the prefill sent no counts)."""

def decode_event(data: bytes | str, max_bytes: int = ..., layout: tuple[int, int] | None = None) -> DecodedCounts | str | None:
    """One stream event's JSON -> its payload's counts; the prefill's reason (str) when it sent
    none; None when the event is no JSON object or holds no payload. Raises PayloadError."""

class CentroidFileError(ValueError):
    """A centroid file is truncated, corrupt, of another version or mismatched."""

class NoHealthyWorker(RuntimeError):
    """Every decode worker is marked unhealthy."""

class NoSignature(ValueError):
    """No usable signature: `reason` is one of FALLBACK_REASONS other than 'no_centroids'
    (raised with 'empty', 'non_finite', 'negative', 'out_of_range' or 'shape')."""

    reason: str

class ProfileError(ValueError):
    """An expert profile cannot be built from these cells, or counted on this worker (e.g. it
    predates a change of layer selection)."""

@final
class SignatureSpec:
    """Layer weights and IDF: everything needed to turn counts into a signature."""

    def __new__(
        cls,
        layer_weights: npt.NDArray[np.float32],  # [L]; 0 masks a layer (dense or unselected)
        idf: npt.NDArray[np.float32],  # [L, E]
    ) -> Self:
        """Raises ValueError on bad shapes or values (negative, NaN, every layer weight 0)."""
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def selected_layers(self) -> list[int]: ...
    def from_dense(self, counts: npt.NDArray[np.uint16 | np.uint32 | np.float32 | np.int64]) -> npt.NDArray[np.float32]:
        """[L, E] counts -> unit signature [D]. Raises NoSignature."""
    def from_sparse(self, index: npt.NDArray[np.int64 | np.int32 | np.uint32], counts: npt.NDArray[np.float32 | np.uint32 | np.uint16]) -> npt.NDArray[np.float32]:
        """Flat indices l*E+e with their counts -> unit signature [D]. Raises NoSignature."""
    def from_topk(self, ids: npt.NDArray[np.int32 | np.int64 | np.uint8 | np.uint16]) -> npt.NDArray[np.float32]:
        """Top-k ids [T, L, k] -> unit signature [D]. Raises NoSignature."""
    def batch_from_topk(
        self, ids: npt.NDArray[np.integer], offsets: npt.NDArray[np.int64], prefix_len: npt.NDArray[np.int64] | None = None
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]:
        """Signatures of many requests at once (GIL released).

        ids [T, L, k]; request r is rows offsets[r]:offsets[r]+prefix_len[r] (whole
        request when prefix_len is None). Returns ([R, D] signatures, [R] valid mask);
        rows without a usable signature are zero and valid=False."""
    def from_sparse_batch(
        self,
        indptr: npt.NDArray[np.int64],
        index: npt.NDArray[np.uint16 | np.uint32 | np.int32 | np.int64],
        counts: npt.NDArray[np.uint16 | np.uint32 | np.float32 | np.int64 | np.int32 | np.float64],
        out: npt.NDArray[np.float32] | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]:
        """Signatures of a CSR batch of count rows at once (GIL released): row r is the flat
        indices index[indptr[r]:indptr[r+1]] with their counts, each row exactly as
        from_sparse makes it. Returns ([n, D] signatures, written into `out` when given, a
        C-contiguous [n, D] float32 array; [n] valid mask). Rows with no usable signature
        (no counts, or only masked layers) are zero and valid=False; a bad row (index out of
        range, negative or NaN count) raises NoSignature naming it; a bad indptr, ValueError."""

def distinct_per_layer(ids: npt.NDArray[np.integer], num_experts: int) -> npt.NDArray[np.uint32]:
    """Top-k ids [N, L, k] of the tokens of one decode step -> distinct experts per layer [L]."""

def count_topk(ids: npt.NDArray[np.integer], num_experts: int) -> npt.NDArray[np.uint32]:
    """Top-k ids [T, L, k] -> counts [L, E]. Raises ValueError on out-of-range ids."""

def band_sizes(distances: npt.NDArray[np.float64], tau: float) -> npt.NDArray[np.uint32]:
    """Band size of each row of distances [n, K] at tau, every worker eligible (d_k <= d* + tau)."""

@final
class CentroidSet:
    """A validated centroid file, held as a private read-only copy of its bytes.

    The file is read once into an anonymous, page-aligned mapping, not mapped itself: a shared
    mapping of the file would turn an in-place overwrite (``cp new.eldr c.eldr``) into SIGBUS on
    the next route. Later changes to the file never affect a loaded set; reload to see them.
    """

    @staticmethod
    def open(path: str) -> CentroidSet: ...
    @property
    def path(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def num_workers(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def tau(self) -> float: ...
    @property
    def worker_names(self) -> list[str]: ...
    @property
    def provenance_json(self) -> str: ...
    @property
    def checksum(self) -> int: ...
    def layer_weights(self) -> npt.NDArray[np.float32]: ...
    def idf(self) -> npt.NDArray[np.float32]: ...  # [L, E]
    def centroids(self) -> npt.NDArray[np.float32]: ...  # [K, D], unit rows
    def spec(self) -> SignatureSpec: ...

def write_centroids(
    path: str,
    centroids: npt.NDArray[np.float32],  # [K, D]; rows are L2-normalized on write
    layer_weights: npt.NDArray[np.float32],  # [L]
    idf: npt.NDArray[np.float32],  # [L, E]
    tau: float = 0.1,
    worker_names: Sequence[str] | None = None,
    provenance_json: str = "{}",
) -> None:
    """Validate and write a centroid file atomically (temp file + rename)."""

@final
class Decision:
    worker: int
    reason: str  # 'band', 'no_signature:<why>' (why: a FALLBACK_REASONS name), 'no_centroids', 'policy', 'profile'
    distances: list[float] | None
    band: list[int] | None
    d_star: float | None
    tau: float | None
    loads: list[int]
    generation: int  # centroid snapshot generation used (0 without centroids)
    def unit_signature(self) -> npt.NDArray[np.float32] | None:
        """The unit signature [D] the route computed, when kept (route_counts(signature=True))."""

@final
class ExpertProfile:
    """A request's expected expert use per decode token from its prompt counts:
    p[l][e] = counts / (tokens + 1); the locality balancer's input."""

    def __new__(cls, num_layers: int, num_experts: int, index: npt.NDArray[np.int64], counts: npt.NDArray[np.float64], tokens: int) -> Self:
        """Raises ProfileError on cells out of range, bad counts or no tokens."""
    @property
    def layer_ids(self) -> list[int]:
        """MoE layers (rows of the prefill counts) the profile spans."""
    @property
    def nnz(self) -> int:
        """Nonzero (layer, expert) cells: the work of one acquire, release or route per worker."""
    @property
    def generation(self) -> int:
        """Centroid generation its layer selection came from (0: built by hand)."""
    def to_wire_json(self) -> str:
        """The profile as the data plane sends it with a decode request (`eldr_profile`)."""

@final
class OccupancySnapshot:
    """This router's own expert sums on one decode worker when a load poll was sent."""

@final
class Lease:
    """One in-flight request on one worker; released exactly once."""

    @property
    def worker(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> bool:
        """Release the slot; True the first time, False after."""
    def __enter__(self) -> Lease: ...
    def __exit__(self, *exc: object) -> Literal[False]: ...

@final
class RouterSpec:
    """A decode router's policy (with the locality costs), tau, load factor and binding, built and
    checked once by the core (rust/core/src/policies/spec.rs). ValueError with the router command
    line's message for a value out of range (tau in [0, 2], load factor and request cost in
    [0, 1e6], paged experts 1..=2^20) or a cost the policy does not take (paged experts and a
    request cost r > 0 are the locality policy's)."""

    def __new__(
        cls,
        policy: str | None = None,  # None: DEFAULT_POLICY
        tau: float | None = None,
        load_factor: float | None = None,
        paged_experts: int | None = None,
        request_cost: float | None = None,
        bind: Literal["auto", "late", "early"] = "auto",
        seed: int = 0,
    ) -> Self: ...
    @property
    def policy(self) -> str: ...
    @property
    def tau(self) -> float | None: ...
    @property
    def load_factor(self) -> float | None: ...
    @property
    def paged_experts(self) -> int | None: ...
    @property
    def request_cost(self) -> float | None: ...
    @property
    def bind(self) -> str: ...
    @property
    def needs_centroids(self) -> bool:
        """The policy routes on the prefill's counts (eldr, locality): it needs a centroid file."""
    @property
    def binds_late(self) -> bool:
        """A request waits for the prefill's signature before its decode is chosen (bind 'late',
        or 'auto' and a counts policy)."""
    def check_centroids(self, has_centroids: bool, arm: str | None = None) -> None:
        """ValueError (the command line's message; `arm`: the experiment arm's label) when the
        policy needs a centroid file and has none."""

def parse_policy_label(label: str) -> tuple[str, float | None, bool, float | None, float | None]:
    """One policy label `name[@tau][/F][:rc=R]` -> (policy, tau, load factor given, load factor,
    request cost), parsed with the router's bounds; ValueError with the message."""
def parse_arms(text: str, default_load_factor: float | None = None) -> list[tuple[str, str, float | None]]:
    """'locality/0.05,round_robin' -> the arms of a switchback experiment, each (label, policy, load factor):
    a policy, optionally /F for eldr and locality (F in [0, 1e6], or none/off: the paper's rule); a plain eldr or
    locality takes default_load_factor. 2 to 16 arms, each once. ValueError with the command line's message."""

@final
class Router:
    """Band router + baseline policies + queue tracker + hot-reloadable centroids."""

    def __new__(
        cls,
        policy: str | None = None,  # None: DEFAULT_POLICY
        num_workers: int | None = None,
        centroids: str | None = None,
        tau: float | None = None,
        seed: int = 0,
        reload_interval_ms: int = 250,
        load_report_ttl_ms: int = 2000,
        load_factor: float | None = None,
        paged_experts: int | None = None,
        request_cost: float | None = None,
        bind: Literal["auto", "late", "early"] = "auto",
    ) -> Self:
        """The routing arguments make a RouterSpec (checked as it is). num_workers: 1..=2^20. load_factor: ELDR with bounded loads (a worker is a candidate only while its load
        is below ceil((1 + f) * (total + 1) / healthy workers)); None = the paper's rule. paged_experts: C, the
        decode workers run SGLang's paged experts with C resident per MoE layer, and the locality policy routes by
        expected page-ins (ValueError for another policy or C = 0). request_cost: r >= 0, the per-request part of
        a decode step in distinct experts per layer; the locality policy's cost becomes
        D_w + (B_w + 1) * Delta_w + r * (2 * B_w + 1) (None or 0: without it; ValueError for r > 0 on another
        policy, a negative or a non-finite r)."""
    @staticmethod
    def from_spec(
        spec: RouterSpec, num_workers: int | None = None, centroids: str | None = None,
        reload_interval_ms: int = 250, load_report_ttl_ms: int = 2000,
    ) -> Router:
        """A router made from a checked spec (the control plane's, from RouterConfig.spec)."""
    @property
    def spec(self) -> RouterSpec: ...  # what it was built from (tau and load factor as at start)
    @property
    def policy(self) -> str: ...
    @property
    def paged_experts(self) -> int | None: ...
    @property
    def request_cost(self) -> float | None: ...  # the locality cost's r; None for other policies
    @property
    def num_workers(self) -> int: ...
    @property
    def tau(self) -> float: ...
    @tau.setter
    def tau(self, value: float) -> None: ...
    @property
    def load_factor(self) -> float | None: ...
    @load_factor.setter
    def load_factor(self, value: float | None) -> None: ...
    def route_dense(self, counts: npt.NDArray, explain: bool = False) -> int | Decision: ...
    def route_sparse(self, index: npt.NDArray, counts: npt.NDArray, explain: bool = False) -> int | Decision: ...
    def route_counts(self, counts: DecodedCounts, explain: bool = False, signature: bool = False) -> int | Decision:
        """Route from decoded payload counts (signature read from the packed data, GIL released);
        with explain and signature, the Decision keeps the unit signature."""
    def route_signature(self, signature: npt.NDArray[np.float32] | None, explain: bool = False) -> int | Decision: ...
    def route_fallback(self, reason: str, explain: bool = False) -> int | Decision:
        """Route a request known to have no usable signature; reason: a FALLBACK_REASONS name other
        than 'no_centroids' (the decision's reason is then 'no_signature:<reason>', or 'no_centroids'
        without a centroid file). ValueError for any other name."""
    def profile_dense(self, counts: npt.NDArray[Any], tokens: int) -> ExpertProfile:
        """Profile from raw dense [L, E] prefill counts over the centroid file's selected layers;
        NoSignature on bad counts, ValueError without a centroid file."""
    def expert_distinct(self) -> list[float] | None:
        """Locality balancer: expected distinct experts per layer per step in flight per worker; None otherwise."""
    def route_profile(self, profile: ExpertProfile, explain: bool = False) -> int | Decision:
        """Route by the request's expert profile (policy "locality"; others route as with no signature)."""
    def acquire(self, worker: int, tokens: int = 0, profile: ExpertProfile | None = None) -> Lease:
        """Count a request on `worker`; with `profile` the locality balancer also counts its experts
        (ProfileError when the profile predates a change of layer selection)."""
    @property
    def replicas(self) -> int: ...
    @replicas.setter
    def replicas(self, value: int) -> None: ...
    def centroid_of_slots(self) -> list[int | None]: ...
    def inflight(self) -> list[int]:
        """This router's own in-flight requests per worker (without external reports)."""
    def loads(self) -> list[int]: ...
    def tokens(self) -> list[int]: ...
    def reported(self) -> list[int | None]:
        """Each decode worker's last /v1/loads count, however old (None: never reported)."""
    def occupancy_layout(self) -> tuple[list[int], int] | None:
        """(MoE layer ids, experts per layer) the locality balancer tracks; None for other
        policies and before its first profile."""
    def occupancy_snapshot(self, worker: int) -> OccupancySnapshot | None:
        """This router's own expert sums on `worker` now (take it when a load poll is sent)."""
    def report_occupancy(self, snapshot: OccupancySnapshot, idle: npt.NDArray[np.float64]) -> None:
        """Blend a worker's occupancy report (per cell, layer-major, the share of its recent
        decode steps in which no request selected the expert) against this router's own sums at
        the poll. ValueError when it does not fit (the state is then unchanged)."""
    def clear_occupancy(self, worker: int) -> None:
        """Forget `worker`'s occupancy report: its cells read this router's requests again."""
    def occupancy_reported(self) -> list[bool]:
        """Per worker, whether the locality state holds an occupancy report for it now."""
    def report_load(self, worker: int, running: int, inflight_at_poll: int | None = None) -> None:
        """A decode worker's own count of the requests it holds (its /v1/loads). For
        load_report_ttl_ms the load the policies see is this router's in-flight count now plus
        the report's share that is not this router's: running minus the larger of
        `inflight_at_poll` (this router's in-flight count on the worker when the poll was sent;
        None: now) and the count now, at least 0."""
    def set_healthy(self, worker: int, healthy: bool) -> None:
        """Mark a worker of a router no data plane holds (tests, the simulator); ValueError when a
        DataPlane routes on it (its worker set owns health: DataPlane.set_healthy)."""
    def healthy(self) -> list[bool]: ...
    def reload(self) -> bool:
        """Reload the centroid file now. Raises CentroidFileError, keeping the old set."""
    def maybe_reload(self) -> bool:
        """Reload if the file changed (checked at most every reload_interval_ms)."""
    @property
    def centroid_generation(self) -> int:
        """1 for the first file, +1 per successful reload. A Decision's `generation` is the
        generation of the very centroids it was computed from (read with them as one)."""
    @property
    def reload_failures(self) -> int:
        """Centroid files rejected so far (each bad replacement counts once)."""
    @property
    def last_reload_error(self) -> str | None: ...
    def centroid_set(self) -> CentroidSet | None: ...

@final
class DataPlane:
    """The Rust request path (crate rust/dataplane): a tokio/hyper server on its own threads,
    routing on the given Router (shared, not copied). See eldr_sglang.router.dataplane."""

    def __new__(cls, config_json: str, router: Router) -> Self: ...
    @staticmethod
    def check_numbers(config_json: str) -> None:
        """Check the numeric settings as DataPlane() does (ValueError naming the flag), building nothing."""
    def start(self) -> int: ...
    def stop(self) -> None: ...
    @property
    def running(self) -> bool: ...
    def set_healthy(self, role: Literal["prefill", "decode"], worker: int, healthy: bool) -> None: ...
    def health_check(self, role: Literal["prefill", "decode"], worker: int, ok: bool, threshold: int) -> None:
        """One /health check's result: a pass marks the worker healthy, `threshold` failures in
        a row unhealthy (the data plane's worker set counts them)."""
    def set_prefill_signature(self, worker: int, signs: bool | None) -> None: ...
    def add_worker(self, role: Literal["prefill", "decode"], url: str, bootstrap_port: int | None = None) -> int: ...
    def remove_worker(self, role: Literal["prefill", "decode"], url: str) -> int: ...
    def members(self, role: Literal["prefill", "decode"]) -> list[tuple[int, str]]: ...
    def workers(self, role: Literal["prefill", "decode"]) -> list[dict[str, object]]: ...
    def routable(self, role: Literal["prefill", "decode"]) -> list[bool]: ...
    def counters(self) -> dict[str, object]:
        """{"counters": {name: [(labels, value)]}, "histograms": {name: (bounds, counts, sum)},
        "labelled_histograms": [(name, label names, bounds, [(label values, counts, sum)])]}."""
    def admission(self) -> dict[str, float]:
        """Admission control now: limit (0: no bound), queue_size, queue_timeout_s, in_flight, waiting."""
    def take_drift(self, n: int) -> list[tuple[int, str, list[float] | None, tuple[npt.NDArray[np.uint32], npt.NDArray[np.float32], float] | None, tuple[int, int | None] | None]]:
        """Up to n queued counts-policy decisions for the drift monitor, oldest first:
        (generation, reason, distances, signature (index, value, norm) or None, the refit
        reservoir's draw (offer index, slot or None) or None). The signature comes only
        with a draw that stores it."""
    @property
    def reservoir_shape(self) -> tuple[int, int] | None:
        """(per_bucket, span) the data plane draws the reservoir's decisions for; None: drift feed off."""
    @property
    def drift_dropped(self) -> int: ...  # decisions dropped because the queue was not drained in time
    def experiment(self, blocks: bool) -> str | None:
        """The switchback experiment as JSON (None: none): with blocks, every block's statistics
        (GET /eldr/experiment); without, the current arm and block (/eldr/status)."""
    def experiment_switch(self, arm: str | None) -> tuple[int, str]:
        """End the block now and start the next, on arm (a label) or the schedule's: (block, arm)."""

@final
class ReservoirSampler:
    """The refit reservoir's keep/slot draw (bucketed Algorithm R): offer `index` is the
    (index % span)-th of its bucket and is stored at `slot` (None: not stored). The data
    plane draws with the same code before it routes each request."""

    def __new__(cls, per_bucket: int, span: int, seed: int = 0) -> Self: ...
    def draw(self) -> tuple[int, int | None]: ...
    def undo(self, index: int, slot: int | None) -> None:
        """Give back a draw that made no offer: the next draw() returns it."""
    @property
    def per_bucket(self) -> int: ...
    @property
    def span(self) -> int: ...
