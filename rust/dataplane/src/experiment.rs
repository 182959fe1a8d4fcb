//! The switchback experiment (`--experiment A,B --switch-every 10m`): the whole cluster runs
//! one decode policy (an *arm*) per time block, in a seeded random order, so two policies
//! never share decode batches and their blocks can be compared (`eldr experiment report`).
//!
//! - The schedule ([`arm_of`]) is balanced: blocks come in rounds of one block per arm, each
//!   round a permutation drawn from the seed, so after every round each arm has run equally
//!   often whatever the run's length.
//! - A request takes the arm of the block it starts in (its [`Tag`]) and keeps it to its end,
//!   failovers and re-sends included: a switch never moves or fails a request in flight.
//!   Each arm is a core router of its own ([`eldr_core::Router::sibling`]): it shares the
//!   workers' loads and the centroid file, and its policy state (the locality balancer's
//!   expert loads) holds only its own requests, released by their guards as they end.
//! - A request that starts while another arm still has requests in flight is flagged
//!   warm-up: its batches still hold the previous arm's requests. The block's statistics
//!   leave warm-up requests out.
//! - The clock is a task on the data plane's runtime ([`run`]); an admin call switches at
//!   once ([`Experiment::switch`]). Either takes one short lock; the request path takes the
//!   block table's lock at its start and its end (and once more for its TPOT).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use eldr_core::rng::AtomicRng;
use eldr_core::Router;
use serde::Deserialize;
use serde_json::{json, Value};

/// Most arms an experiment may have (each is a label value of the latency metrics): the
/// core's, whose label parser reads them.
pub use eldr_core::policies::MAX_ARMS;
/// Shortest and longest block.
pub const MIN_BLOCK_S: f64 = 0.1;
pub const MAX_BLOCK_S: f64 = 7.0 * 86400.0;
/// TPOTs kept per block for its median (a uniform sample beyond, Algorithm R): the median
/// of 8192 draws is within about 1.4 % of the block's (1.25 sd / sqrt(n) for a spread of 1 sd).
const SAMPLE_PER_BLOCK: usize = 8192;
/// Blocks whose statistics are kept (the oldest finished ones go first).
const MAX_BLOCKS: usize = 100_000;

/// An arm: its label (`locality/0.05`), policy and load factor, as the core's label parser
/// reads the label; its binding is its router spec's (the main router's `--eldr-bind` over
/// the arm's policy).
#[derive(Debug, Clone)]
pub struct ArmConfig {
    pub label: String,
    pub policy: String,
    pub load_factor: Option<f64>,
}

/// The experiment as the launcher gives it: the arms as `--experiment` writes them, parsed
/// here by the core's one label parser (`eldr_core::policies::parse_arms`), with
/// `--eldr-load-factor` for a plain counts policy.
#[derive(Debug, Clone, Deserialize)]
pub struct ExperimentWire {
    pub arms: String,
    #[serde(default)]
    pub default_load_factor: Option<f64>,
    pub switch_every_s: f64,
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "ExperimentWire")]
pub struct ExperimentConfig {
    pub arms: Vec<ArmConfig>,
    pub switch_every_s: f64,
    pub seed: u64,
}

impl TryFrom<ExperimentWire> for ExperimentConfig {
    type Error = String;
    fn try_from(w: ExperimentWire) -> Result<Self, String> {
        let arms = eldr_core::policies::parse_arms(&w.arms, w.default_load_factor).map_err(|e| format!("experiment: {e}"))?;
        let arms = arms.into_iter().map(|a| ArmConfig { label: a.label, policy: a.policy.to_owned(), load_factor: a.load_factor }).collect();
        Ok(ExperimentConfig { arms, switch_every_s: w.switch_every_s, seed: w.seed })
    }
}

impl ExperimentConfig {
    pub fn check(&self) -> Result<(), String> {
        let n = self.arms.len();
        if !(2..=MAX_ARMS).contains(&n) {
            return Err(format!("experiment: give 2 to {MAX_ARMS} arms, got {n}"));
        }
        for (i, a) in self.arms.iter().enumerate() {
            if a.label.is_empty() || a.label.len() > 64 || a.label.chars().any(|c| c.is_control()) {
                return Err(format!("experiment: arm {i}'s label must be 1 to 64 printable characters"));
            }
            // the policies, load factors and repeats are the label parser's (ExperimentWire)
        }
        let s = self.switch_every_s;
        if !(s.is_finite() && (MIN_BLOCK_S..=MAX_BLOCK_S).contains(&s)) {
            return Err(format!("experiment: switch_every_s must be between {MIN_BLOCK_S} and {MAX_BLOCK_S} seconds, got {s}"));
        }
        Ok(())
    }
}

/// The arm of block `block` among `arms`: block b is in round b / arms, which runs every arm
/// once in an order drawn from (seed, round) (Fisher-Yates on SplitMix64).
pub fn arm_of(seed: u64, arms: usize, block: u64) -> usize {
    let n = arms.max(1);
    let round = block / n as u64;
    let rng = AtomicRng::new(seed ^ round.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i + 1));
    }
    order[(block % n as u64) as usize]
}

/// One arm: its label (the latency metrics' `policy` label under an experiment), router and
/// binding.
pub struct Arm {
    pub label: &'static str,
    pub router: Arc<Router>,
    pub late: bool,
}

/// One block's running statistics.
struct BlockStats {
    block: u64,
    arm: usize,
    start_unix_s: f64,
    end_unix_s: Option<f64>,
    /// Requests started in it, those flagged warm-up, those still in flight.
    requests: u64,
    warmup: u64,
    inflight: i64,
    /// Non-warm-up TPOTs: how many, their sum, a uniform sample of them.
    n: u64,
    sum: f64,
    sample: Vec<f32>,
    /// (p50, mean) once the block has ended and its last request too.
    sealed: Option<(Option<f64>, Option<f64>)>,
}

impl BlockStats {
    fn new(block: u64, arm: usize) -> Self {
        BlockStats { block, arm, start_unix_s: unix_now(), end_unix_s: None, requests: 0, warmup: 0, inflight: 0, n: 0, sum: 0.0, sample: Vec::new(), sealed: None }
    }

    fn stats(&self) -> (Option<f64>, Option<f64>) {
        if let Some(s) = self.sealed {
            return s;
        }
        if self.n == 0 {
            return (None, None);
        }
        let mut v: Vec<f64> = self.sample.iter().map(|&x| x as f64).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let m = v.len();
        let p50 = if m % 2 == 1 { v[m / 2] } else { 0.5 * (v[m / 2 - 1] + v[m / 2]) };
        (Some(p50), Some(self.sum / self.n as f64))
    }

    fn complete(&self) -> bool {
        self.end_unix_s.is_some() && self.inflight == 0
    }

    fn seal_if_complete(&mut self) {
        if self.sealed.is_none() && self.complete() {
            self.sealed = Some(self.stats());
            self.sample = Vec::new();
        }
    }
}

struct Blocks {
    /// Consecutive blocks, the current one last.
    list: VecDeque<BlockStats>,
    /// When the current block started (the clock's reference).
    started: Instant,
}

impl Blocks {
    fn get(&mut self, block: u64) -> Option<&mut BlockStats> {
        let first = self.list.front()?.block;
        self.list.get_mut(block.checked_sub(first)? as usize)
    }
}

pub struct Experiment {
    pub arms: Vec<Arm>,
    pub every: Duration,
    seed: u64,
    /// block << 8 | arm, read once per request.
    current: AtomicU64,
    /// Requests in flight per arm (for the warm-up flag).
    inflight: Box<[AtomicI64]>,
    blocks: Mutex<Blocks>,
    rng: AtomicRng,
    /// Wakes the clock after an admin switch (it restarts the block's countdown).
    pub(crate) wake: tokio::sync::Notify,
}

/// A request's arm and block, held until it ends (the answer's last byte or its failure).
pub struct Tag {
    exp: Arc<Experiment>,
    pub block: u64,
    pub arm: usize,
    pub warmup: bool,
}

impl Drop for Tag {
    fn drop(&mut self) {
        self.exp.inflight[self.arm].fetch_sub(1, Ordering::Relaxed);
        let mut b = self.exp.lock();
        if let Some(s) = b.get(self.block) {
            s.inflight -= 1;
            s.seal_if_complete();
        }
    }
}

impl Tag {
    /// The request's time per output token (its answer ended whole).
    pub fn record_tpot(&self, tpot_s: f64) {
        if self.warmup || !(tpot_s.is_finite() && tpot_s >= 0.0) {
            return;
        }
        let slot = {
            let mut b = self.exp.lock();
            let Some(s) = b.get(self.block) else { return };
            s.n += 1;
            s.sum += tpot_s;
            if s.sample.len() < SAMPLE_PER_BLOCK {
                s.sample.push(tpot_s as f32);
                return;
            }
            s.n
        };
        // Algorithm R: the k-th value replaces a random kept one with probability size / k
        let j = (self.exp.rng.next_u64() % slot) as usize;
        if j < SAMPLE_PER_BLOCK {
            let mut b = self.exp.lock();
            if let Some(s) = b.get(self.block) {
                if s.sealed.is_none() && j < s.sample.len() {
                    s.sample[j] = tpot_s as f32;
                }
            }
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn pack(block: u64, arm: usize) -> u64 {
    (block << 8) | arm as u64
}

fn unpack(v: u64) -> (u64, usize) {
    (v >> 8, (v & 0xff) as usize)
}

impl Experiment {
    /// Arm 0 routes on `main` (the router the control plane holds; its policy must be arm
    /// 0's); the others on siblings of it.
    pub fn new(cfg: &ExperimentConfig, main: &Arc<Router>, seed: u64) -> Result<Experiment, String> {
        cfg.check()?;
        let mut arms = Vec::with_capacity(cfg.arms.len());
        for (i, a) in cfg.arms.iter().enumerate() {
            let router = if i == 0 {
                if main.policy_name() != a.policy {
                    return Err(format!("experiment: arm 0 is {:?}, the router's policy {}", a.policy, main.policy_name()));
                }
                Arc::clone(main)
            } else {
                let arm_err = |e: &dyn std::fmt::Display| format!("experiment: arm {:?}: {e}", a.label);
                let policy = eldr_core::PolicyConfig::parse(&a.policy, seed).map_err(|e| arm_err(&e))?;
                let spec = eldr_core::RouterSpec { policy, tau: None, load_factor: a.load_factor, bind: main.spec().bind };
                Arc::new(main.sibling(spec).map_err(|e| arm_err(&e))?)
            };
            // bounded: one label per arm of each plane, for the metrics' 'static labels
            let label: &'static str = Box::leak(a.label.clone().into_boxed_str());
            let late = router.binds_late();
            arms.push(Arm { label, router, late });
        }
        let first = arm_of(cfg.seed, arms.len(), 0);
        let mut list = VecDeque::new();
        list.push_back(BlockStats::new(0, first));
        Ok(Experiment {
            inflight: arms.iter().map(|_| AtomicI64::new(0)).collect(),
            arms,
            every: Duration::from_secs_f64(cfg.switch_every_s),
            seed: cfg.seed,
            current: AtomicU64::new(pack(0, first)),
            blocks: Mutex::new(Blocks { list, started: Instant::now() }),
            rng: AtomicRng::new(cfg.seed ^ 0x5EED),
            wake: tokio::sync::Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Blocks> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// (block, arm) now.
    pub fn current(&self) -> (u64, usize) {
        unpack(self.current.load(Ordering::Acquire))
    }

    /// Tag a request that starts now with the current block's arm.
    pub fn begin(self: &Arc<Self>) -> Arc<Tag> {
        // under the lock a switch (which holds it) cannot end the block between the read and the count
        let mut b = self.lock();
        let (block, arm) = self.current();
        self.inflight[arm].fetch_add(1, Ordering::Relaxed);
        let warmup = self.inflight.iter().enumerate().any(|(i, c)| i != arm && c.load(Ordering::Relaxed) > 0);
        if let Some(s) = b.get(block) {
            s.requests += 1;
            s.inflight += 1;
            s.warmup += warmup as u64;
        }
        drop(b);
        Arc::new(Tag { exp: Arc::clone(self), block, arm, warmup })
    }

    /// Restart the current block's clock (the data plane starts serving now).
    pub fn restart_clock(&self) {
        let mut b = self.lock();
        b.started = Instant::now();
        if let Some(s) = b.list.back_mut() {
            s.start_unix_s = unix_now();
        }
    }

    /// End the current block and start the next: on `to`, or the schedule's arm. Returns
    /// the new (block, arm).
    pub fn switch(&self, to: Option<usize>) -> (u64, usize) {
        let out = self.advance(None, to);
        self.wake.notify_one();
        out
    }

    /// The clock's switch: only if block `from` is still the current one (an admin switch
    /// may have come first).
    fn advance(&self, from: Option<u64>, to: Option<usize>) -> (u64, usize) {
        let mut b = self.lock();
        let (block, arm) = self.current();
        if from.is_some_and(|f| f != block) {
            return (block, arm);
        }
        let next = block + 1;
        let arm = to.filter(|&a| a < self.arms.len()).unwrap_or_else(|| arm_of(self.seed, self.arms.len(), next));
        let now = unix_now();
        if let Some(s) = b.list.back_mut() {
            s.end_unix_s = Some(now);
            s.seal_if_complete();
        }
        b.list.push_back(BlockStats::new(next, arm));
        b.started = Instant::now();
        while b.list.len() > MAX_BLOCKS {
            b.list.pop_front();
        }
        self.current.store(pack(next, arm), Ordering::Release);
        (next, arm)
    }

    /// When the current block is due to end, and which block that is.
    fn due(&self) -> (Instant, u64) {
        let b = self.lock();
        (b.started + self.every, self.current().0)
    }

    /// /eldr/status's view: the arms, the current block and arm, its age, and requests in
    /// flight per arm.
    pub fn status(&self) -> Value {
        let (block, arm) = self.current();
        let elapsed = self.lock().started.elapsed().as_secs_f64();
        json!({
            "arms": self.arms.iter().map(|a| a.label).collect::<Vec<_>>(),
            "block": block,
            "arm": self.arms[arm].label,
            "arm_index": arm,
            "block_elapsed_s": elapsed,
            "switch_every_s": self.every.as_secs_f64(),
            "next_switch_in_s": (self.every.as_secs_f64() - elapsed).max(0.0),
            "seed": self.seed,
            "inflight_by_arm": self.inflight.iter().map(|c| c.load(Ordering::Relaxed)).collect::<Vec<_>>(),
        })
    }

    /// GET /eldr/experiment: the status and every block's statistics, in the block-record
    /// form `eldr experiment report` reads ({"blocks": [{"block", "arm", "tpot_p50_s",
    /// "tpot_mean_s", "n", "warmup_n", ...}]}). A block is `complete` once it has ended and
    /// its last request has too; until then its figures are partial.
    pub fn snapshot(&self) -> Value {
        let blocks: Vec<Value> = self.lock().list.iter().map(|s| {
            let (p50, mean) = s.stats();
            json!({
                "block": s.block,
                "arm": self.arms[s.arm].label,
                "start_unix_s": s.start_unix_s,
                "end_unix_s": s.end_unix_s,
                "complete": s.complete(),
                "requests": s.requests,
                "warmup_n": s.warmup,
                "inflight": s.inflight,
                "n": s.n,
                "tpot_p50_s": p50,
                "tpot_mean_s": mean,
            })
        }).collect();
        json!({"experiment": self.status(), "blocks": blocks})
    }
}

/// The experiment's clock: switch when the current block's time is up, restarting the
/// countdown after an admin switch. Runs on the data plane's runtime until it stops.
pub async fn run(exp: Arc<Experiment>) {
    loop {
        let (due, block) = exp.due();
        tokio::select! {
            _ = tokio::time::sleep_until(due) => {
                exp.advance(Some(block), None);
            }
            _ = exp.wake.notified() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(arms: &[&str], every: f64) -> Result<ExperimentConfig, String> {
        ExperimentConfig::try_from(ExperimentWire { arms: arms.join(","), default_load_factor: None, switch_every_s: every, seed: 7 })
    }

    fn cfg(arms: &[&str], every: f64) -> ExperimentConfig {
        wire(arms, every).unwrap()
    }

    #[test]
    fn the_schedule_is_seeded_and_balanced_every_round() {
        for arms in [2usize, 3, 5] {
            let order: Vec<usize> = (0..60).map(|b| arm_of(11, arms, b)).collect();
            assert_eq!(order, (0..60).map(|b| arm_of(11, arms, b)).collect::<Vec<_>>(), "same seed, same order");
            for round in order.chunks(arms) {
                let mut r = round.to_vec();
                r.sort();
                assert_eq!(r, (0..arms).collect::<Vec<_>>(), "each round runs every arm once");
            }
            let other: Vec<usize> = (0..60).map(|b| arm_of(12, arms, b)).collect();
            assert_ne!(order, other, "another seed, another order");
            // not one fixed rotation: the rounds' orders differ
            let rounds: std::collections::HashSet<Vec<usize>> = order.chunks(arms).map(|c| c.to_vec()).collect();
            assert!(rounds.len() > 1);
        }
    }

    #[test]
    fn bad_experiments_are_refused_with_the_reason() {
        // the arms are the core's label parser's, in the command line's words
        let w = |arms: &[&str]| wire(arms, 60.0).unwrap_err();
        assert_eq!(w(&["locality"]), "experiment: an experiment needs 2 to 16 arms, got 1");
        assert_eq!(w(&["round_robin", "round_robin"]), "experiment: arm 'round_robin' is given twice");
        assert!(w(&["round_robin", "fastest"]).starts_with("experiment: arm 'fastest': unknown policy 'fastest'"));
        let e = |c: ExperimentConfig| c.check().unwrap_err();
        assert!(e(cfg(&["round_robin", "random"], 0.0)).contains("switch_every_s"));
        assert!(e(cfg(&["round_robin", "random"], f64::NAN)).contains("switch_every_s"));
        assert!(cfg(&["round_robin", "random"], 600.0).check().is_ok());
    }

    #[test]
    fn the_launchers_arms_are_labels_parsed_by_the_core() {
        let x: ExperimentConfig = serde_json::from_str(r#"{"arms": "locality/0.05,eldr,round_robin", "default_load_factor": 0.2, "switch_every_s": 60}"#).unwrap();
        let got: Vec<_> = x.arms.iter().map(|a| (a.label.as_str(), a.policy.as_str(), a.load_factor)).collect();
        assert_eq!(got, [("locality/0.05", "locality", Some(0.05)), ("eldr", "eldr", Some(0.2)), ("round_robin", "round_robin", None)]);
        let bad = serde_json::from_str::<ExperimentConfig>(r#"{"arms": "eldr/x,random", "switch_every_s": 60}"#).unwrap_err();
        assert!(bad.to_string().contains("experiment: arm 'eldr/x': expected a number >= 0 or 'none', got 'x'"), "{bad}");
    }

    fn exp(every: f64) -> Arc<Experiment> {
        let main = Arc::new(Router::new(eldr_core::RouterSpec::of(eldr_core::PolicyConfig::RoundRobin), Some(2), None, 0, 0).unwrap());
        Arc::new(Experiment::new(&cfg(&["round_robin", "shortest_queue"], every), &main, 0).unwrap())
    }

    #[test]
    fn warm_up_lasts_while_another_arm_has_requests_in_flight() {
        let x = exp(600.0);
        let (_, a0) = x.current();
        let old = x.begin();
        assert!(!old.warmup);
        let (b1, a1) = x.switch(None);
        assert_eq!(b1, 1);
        let arm1 = if a1 == a0 { x.switch(Some(1 - a0)).1 } else { a1 };
        assert_ne!(arm1, a0);
        let during = x.begin();
        assert!(during.warmup, "the previous arm's request is still in flight");
        during.record_tpot(0.5);
        drop(old);
        let after = x.begin();
        assert!(!after.warmup);
        after.record_tpot(0.010);
        let snap = x.snapshot();
        let cur = snap["blocks"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(cur["requests"], 2);
        assert_eq!(cur["warmup_n"], 1);
        assert_eq!(cur["n"], 1, "the warm-up request's TPOT is left out");
        assert!((cur["tpot_p50_s"].as_f64().unwrap() - 0.010).abs() < 1e-9);
        assert_eq!(cur["complete"], false);
        // block 0 ended and its request too: complete
        assert_eq!(snap["blocks"][0]["complete"], true);
    }

    #[test]
    fn block_statistics_are_the_median_and_mean_of_their_requests() {
        let x = exp(600.0);
        for v in [0.01, 0.02, 0.03, 0.10] {
            x.begin().record_tpot(v);
        }
        x.switch(None);
        let b0 = x.snapshot()["blocks"][0].clone();
        assert_eq!(b0["complete"], true);
        assert_eq!(b0["n"], 4);
        assert!((b0["tpot_p50_s"].as_f64().unwrap() - 0.025).abs() < 1e-6);
        assert!((b0["tpot_mean_s"].as_f64().unwrap() - 0.04).abs() < 1e-9);
    }

    #[tokio::test(start_paused = true)]
    async fn the_clock_switches_every_block_and_restarts_after_an_admin_switch() {
        let x = exp(10.0);
        tokio::spawn(run(Arc::clone(&x)));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(x.current().0, 0);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(x.current().0, 1);
        tokio::time::sleep(Duration::from_secs(5)).await;
        x.switch(None);
        assert_eq!(x.current().0, 2);
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(x.current().0, 2, "the countdown restarted at the admin switch");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(x.current().0, 3);
    }
}
