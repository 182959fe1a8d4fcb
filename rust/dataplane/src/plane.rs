//! The data plane's shared state: configuration, the core router (shared with Python),
//! the upstream client, worker pools, the prefill policy, counters and the retry budget.
//! The request path itself is in [`crate::flow`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use eldr_core::rng::AtomicRng;
use eldr_core::{make_policy, Policy, Reason, RouteContext, Router, SparseSignature};

use crate::admission::{Admission, BodyBudget};
use crate::config::{secs, Config, ConfigError, PrefillWorker, Role};
use crate::counters::{names, Counters};
use crate::experiment::{Experiment, Tag};
use crate::outlier::WorkerPool;
use crate::reservoir::{Draw, KeepSampler};
use crate::upstream::{self, HttpClient};

/// How long a decode may send nothing to a request whose client then leaves before that
/// counts as its timeout (at most the first-byte timeout): clients that give up first (a
/// 12 s client limit against the 60 s first-byte timeout) must not keep a hung decode in.
pub const DECODE_SILENCE_S: f64 = 10.0;

pub struct Plane {
    pub cfg: Config,
    pub router: Arc<Router>,
    pub client: HttpClient,
    pub counters: Arc<Counters>,
    pub prefill: Arc<WorkerPool>,
    pub decode: Arc<WorkerPool>,
    prefill_policy: Box<dyn Policy>,
    /// Per prefill slot: where decode workers fetch its KV (slots as the prefill pool's).
    prefill_workers: RwLock<Vec<Arc<PrefillWorker>>>,
    /// Per prefill slot (the pool's capacity): whether it streams signatures.
    prefill_signs: Box<[AtomicU8]>,
    pub rng: AtomicRng,
    pub budget: RetryBudget,
    pub admission: Admission,
    /// The bound on request-body bytes held at once.
    pub bodies: BodyBudget,
    epoch: Instant,
    last_warn_ms: AtomicU64,
    /// Decisions for the Python drift monitor (None: drift handling off).
    pub drift: Option<DriftFeed>,
    /// The switchback experiment (None: one policy, the router's).
    pub experiment: Option<Arc<Experiment>>,
}

/// The decode policy a request is routed by, from its start to its end: the plane's router,
/// or under an experiment the arm of the block it started in (with its tag).
pub struct RequestArm {
    pub router: Arc<Router>,
    /// The latency metrics' `policy` label: the policy's name, or the arm's label.
    pub label: &'static str,
    pub late: bool,
    pub tag: Option<Arc<Tag>>,
}

/// One counts-policy decision as the drift monitor reads it.
pub struct DriftSample {
    pub generation: u64,
    pub reason: String,
    /// `1 - cos(signature, centroid_k)` over all K centroids, when a signature was usable.
    pub distances: Option<Vec<f64>>,
    /// The signature, only when the reservoir stores it (`offer`'s slot).
    pub signature: Option<SparseSignature>,
    /// The reservoir's draw for this decision (None: not an offer: no distances, a
    /// fallback or a re-send).
    pub offer: Option<Draw>,
}

/// A bounded queue of decisions the control plane drains (`DataPlane.take_drift`); when it
/// is full the oldest are dropped (and counted). Its sampler decides, before a request is
/// routed, whether the refit reservoir will store that request's signature.
pub struct DriftFeed {
    queue: Mutex<VecDeque<DriftSample>>,
    capacity: usize,
    pub dropped: AtomicU64,
    pub sampler: KeepSampler,
}

impl DriftFeed {
    pub fn new(capacity: usize, sampler: KeepSampler) -> Self {
        DriftFeed { queue: Mutex::new(VecDeque::with_capacity(capacity.min(1 << 16))), capacity, dropped: AtomicU64::new(0), sampler }
    }
    pub fn push(&self, s: DriftSample) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= self.capacity {
            q.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(s);
    }
    pub fn take(&self, n: usize) -> Vec<DriftSample> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let n = n.min(q.len());
        q.drain(..n).collect()
    }
}

impl Plane {
    pub fn new(cfg: Config, router: Arc<Router>) -> Result<Plane, ConfigError> {
        if router.num_workers() != cfg.decode.len() {
            return Err(ConfigError::Invalid(format!("the router has {} decode workers, the config {}", router.num_workers(), cfg.decode.len())));
        }
        let counters = Arc::new(Counters::default());
        let purls: Vec<String> = cfg.prefill.iter().map(|p| p.url.clone()).collect();
        let prefill = WorkerPool::new(Role::Prefill, &purls, cfg.eject_after_failures, cfg.eject_base_s, cfg.eject_max_s, None, Arc::clone(&counters));
        let decode = WorkerPool::new(Role::Decode, &cfg.decode, cfg.eject_after_failures, cfg.eject_base_s, cfg.eject_max_s, Some(Arc::clone(router.tracker())), Arc::clone(&counters));
        // a decode silent for this long when its client gave up is charged a timeout (prefills
        // are not: under early binding a prefill waits for its decode to take the KV)
        decode.set_silence(secs(cfg.first_byte_timeout_s).min(Duration::from_secs_f64(DECODE_SILENCE_S)));
        let prefill_policy = make_policy(&cfg.prefill_policy, cfg.seed).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let cfg_reservoir = if cfg.counts_policy() { cfg.signature_reservoir } else { 0 };
        let sampler = match (cfg_reservoir > 0, cfg.reservoir) {
            (true, Some(r)) => Some(KeepSampler::new(r.per_bucket, r.span, cfg.seed).map_err(|e| ConfigError::Invalid(format!("reservoir: {e}")))?),
            _ => None,
        };
        let experiment = match &cfg.experiment {
            Some(x) => Some(Arc::new(Experiment::new(x, &router, cfg.seed).map_err(ConfigError::Invalid)?)),
            None => None,
        };
        let admission = Admission::new(cfg.max_concurrent(), cfg.queue(), secs(cfg.queue_timeout_s), Arc::clone(&counters));
        Ok(Plane {
            admission,
            bodies: BodyBudget::new(cfg.buffer_limit()),
            client: upstream::client(secs(cfg.connect_timeout_s)),
            prefill_signs: (0..prefill.tracker().capacity()).map(|_| AtomicU8::new(0)).collect(),
            prefill_workers: RwLock::new(cfg.prefill.iter().cloned().map(Arc::new).collect()),
            rng: AtomicRng::new(entropy()),
            cfg,
            router,
            counters,
            prefill,
            decode,
            prefill_policy,
            budget: RetryBudget::default(),
            epoch: Instant::now(),
            last_warn_ms: AtomicU64::new(0),
            drift: sampler.map(|s| DriftFeed::new(cfg_reservoir, s)),
            experiment,
        })
    }

    /// The arm a request starting now is routed by (see [`RequestArm`]).
    pub fn arm(&self) -> RequestArm {
        match &self.experiment {
            None => RequestArm { router: Arc::clone(&self.router), label: self.router.policy_name(), late: self.router.binds_late(), tag: None },
            Some(x) => {
                let tag = x.begin();
                let a = &x.arms[tag.arm];
                RequestArm { router: Arc::clone(&a.router), label: a.label, late: a.late, tag: Some(tag) }
            }
        }
    }

    pub fn pool(&self, role: Role) -> &Arc<WorkerPool> {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// `(num_layers, num_experts)` of the serving centroid file (payloads must fit it).
    pub fn layout(&self) -> Option<(usize, usize)> {
        self.router.store().map(|s| {
            let set = s.set();
            (set.num_layers(), set.num_experts())
        })
    }

    /// Prefill slot i's worker (a removed one's too, while its requests drain).
    pub fn prefill_worker(&self, i: usize) -> Arc<PrefillWorker> {
        Arc::clone(&self.prefill_workers.read().unwrap_or_else(|e| e.into_inner())[i])
    }

    /// A worker joins the role at run time (issue 31): its slot. A prefill needs its
    /// bootstrap port (None: SGLang's default on the decode side). A decode worker gets no
    /// centroid until the next centroid file (the router's map).
    pub fn add_worker(&self, role: Role, url: &str, bootstrap_port: Option<u16>) -> Result<usize, ConfigError> {
        let url = url.trim_end_matches('/'); // as the command line's URLs: the path is appended
        let host = url_host(url).ok_or_else(|| ConfigError::Invalid(format!("{role} worker URL {url:?}: give http://HOST:PORT")))?;
        match role {
            Role::Decode => {
                let i = self.decode.add(url).map_err(|e| ConfigError::Invalid(e.to_string()))?;
                self.router.sync_membership();
                Ok(i)
            }
            Role::Prefill => {
                // the worker's entry goes in before the slot becomes routable
                let mut ws = self.prefill_workers.write().unwrap_or_else(|e| e.into_inner());
                let i = self.prefill.add(url).map_err(|e| ConfigError::Invalid(e.to_string()))?;
                let w = Arc::new(PrefillWorker { url: url.to_owned(), host, bootstrap_port });
                if i < ws.len() {
                    ws[i] = w;
                } else {
                    ws.push(w);
                }
                self.set_prefill_signs(i, None);
                Ok(i)
            }
        }
    }

    /// A worker leaves: no new requests, those in flight finish. Its slot.
    pub fn remove_worker(&self, role: Role, url: &str) -> Result<usize, ConfigError> {
        let url = url.trim_end_matches('/');
        let i = self.pool(role).remove(url).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if role == Role::Decode {
            self.router.sync_membership();
        }
        Ok(i)
    }

    pub fn prefill_signs(&self, i: usize) -> Option<bool> {
        sign_of(&self.prefill_signs[i])
    }

    pub fn set_prefill_signs(&self, i: usize, v: Option<bool>) {
        self.prefill_signs[i].store(sign_state(v), Ordering::Relaxed);
    }

    /// A prefill worker by the prefill policy (the core's policy trait) among the routable
    /// ones not tried yet; with none routable on a first try, any (their errors say why).
    pub fn pick_prefill(&self, tried: &[usize]) -> Option<usize> {
        let n = self.prefill.len();
        let routable = self.prefill.routable_all();
        let mut healthy: Vec<bool> = (0..n).map(|i| routable[i] && !tried.contains(&i)).collect();
        if !healthy.iter().any(|&h| h) {
            if !tried.is_empty() {
                return None;
            }
            // panic mode, as for decode (flow::route's panic_route): route across them anyway
            self.counters.inc(names::PANIC_ROUTES, &["prefill"]);
            healthy = (0..n).map(|i| self.prefill.is_member(i)).collect(); // never a worker that left
        }
        let loads: Vec<i64> = (0..n).map(|i| self.prefill.inflight(i)).collect(); // the same n slots as `healthy`
        let ctx = RouteContext { loads: &loads, healthy: &healthy, distances: None, fallback: Reason::Policy, tau: 0.0, load_factor: None, profile: None, explain: false };
        self.prefill_policy.choose(&ctx).worker
    }

    pub fn may_retry(&self, role: Role) -> bool {
        if self.budget.allows() {
            return true;
        }
        self.counters.inc(names::RETRIES_REFUSED, &[role.as_str()]);
        false
    }

    /// A warning about what a worker sent, at most one per second.
    pub fn warn_malformed(&self, msg: &str) {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        let last = self.last_warn_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1000 && self.last_warn_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            eprintln!("eldr.dataplane WARNING {msg}");
        }
    }
}


/// Prefill signature support: 0 unknown, 1 yes, 2 no.
fn sign_state(v: Option<bool>) -> u8 {
    match v {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    }
}

fn sign_of(a: &AtomicU8) -> Option<bool> {
    match a.load(Ordering::Relaxed) {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    }
}

/// A seed from the OS (std's per-process random hash keys) and the clock: bootstrap rooms
/// must differ across router restarts (a reused room of a transferred KV is refused), so
/// they never come from the policies' --seed.
fn entropy() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

/// Re-sends allowed only while few are under way (Envoy's retry budget: 20% of active
/// requests, here at least 10 concurrent re-sends).
#[derive(Default)]
pub struct RetryBudget {
    active: Arc<AtomicI64>,
    retrying: Arc<AtomicI64>,
}

/// One request counted as active, or one re-send as under way, in the retry budget, until
/// dropped.
pub struct BudgetGuard(Arc<AtomicI64>);

impl Drop for BudgetGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl RetryBudget {
    pub fn allows(&self) -> bool {
        let (r, a) = (self.retrying.load(Ordering::Relaxed), self.active.load(Ordering::Relaxed));
        (r as f64) < (10f64).max(0.2 * a as f64)
    }
    pub fn active(&self) -> BudgetGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        BudgetGuard(Arc::clone(&self.active))
    }
    pub fn retrying(&self) -> BudgetGuard {
        self.retrying.fetch_add(1, Ordering::Relaxed);
        BudgetGuard(Arc::clone(&self.retrying))
    }
}

pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The host part of an `http://HOST[:PORT]` URL (an IPv6 literal without its brackets).
fn url_host(url: &str) -> Option<String> {
    let uri: hyper::Uri = url.parse().ok()?;
    if uri.scheme_str() != Some("http") {
        return None;
    }
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then(|| host.to_owned())
}
