//! eldr-core: the hot path of expert-locality-aware decode routing (ELDR).
//!
//! * [`signature`]: counts of expert use during prefill -> unit signature (IDF and layer weights).
//! * [`centroid_file`]: the versioned, checksummed `.eldr` centroid file (writer + a reader that
//!   copies the file into a private, page-aligned buffer).
//! * [`store`]: hot-reloadable centroids behind an atomic pointer swap.
//! * [`queue`]: lock-free per-worker in-flight tracking with exactly-once release.
//! * [`workers`]: per-worker health, circuit (outlier ejection) and in-flight, for both roles.
//! * [`policies`]: one small trait, one file per routing policy, and a factory.
//! * [`distance`]: the fused counts -> centroid-distance kernel (the hot loop).
//! * [`router`]: ties them together: signature -> distances -> policy -> decision.
//! * [`payload`]: the prefill's wire payload (packed counts) decoded straight into a signature.
//! * [`limits`]: bounds on caller-given sizes, checked before allocating.
//! * [`experts`]: top-k id counting helpers shared by the offline pipeline and the simulator.

#[cfg(not(target_endian = "little"))]
compile_error!("the .eldr centroid file is little-endian and its f32 matrix is read in place from the loaded bytes");

pub mod centroid_file;
pub mod distance;
pub mod experts;
pub mod limits;
pub mod order;
pub mod payload;
pub mod policies;
pub mod queue;
pub mod rng;
pub mod router;
pub mod signature;
pub mod store;
pub mod workers;

pub use centroid_file::{write_atomic, CentroidFileError, CentroidSet, CentroidWriter, FORMAT_VERSION};
pub use policies::{
    band_size, counts_policies, fallback_reasons, is_counts_policy, is_prefill_policy, make_policy, prefill_policies, Decision, ExpertGuard, ExpertProfile, Policy, PolicyConfig, RouterSpec, RouterSpecError, Bind, fmt_g,
    PolicyInfo, Reason, RouteContext, DEFAULT_LOAD_FACTOR, DEFAULT_POLICY, DEFAULT_PREFILL_POLICY, DEFAULT_REQUEST_COST, DEFAULT_TAU, POLICIES, POLICY_NAMES,
};
pub use queue::{LoadGuard, QueueTracker, SLOT_CAPACITY};
pub use distance::Counts;
pub use limits::SizeError;
pub use payload::{DecodeLimits, DecodedCounts, Payload, PayloadError};
pub use router::{BuildError, RouteError, Router};
pub use signature::{BatchError, CountValue, NoSignature, SignatureSpec, SparseIndex, SparseSignature};
pub use store::{CentroidStore, Snapshot};
pub use workers::{Circuit, Event as WorkerEvent, MembershipError, SlotState, WorkerSet, WorkerView};
