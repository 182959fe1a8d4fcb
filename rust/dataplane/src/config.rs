//! The data plane's configuration: the Python launcher's RouterConfig, as JSON.

use std::fmt;
use std::time::Duration;

use hyper::Uri;
use serde::Deserialize;
use thiserror::Error;

/// A bad data-plane configuration; the message says which setting and why.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("data plane config is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct PrefillWorker {
    pub url: String,
    /// What decode workers connect to for the KV (the URL's host).
    pub host: String,
    pub bootstrap_port: Option<u16>,
}

fn default_threads() -> usize {
    2
}

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub host: String,
    /// 0: any free port (`DataPlane::start` returns the bound one).
    pub port: u16,
    pub prefill: Vec<PrefillWorker>,
    pub decode: Vec<String>,
    /// Every path the data plane does not serve itself goes here (the Python control plane).
    pub control_url: String,
    pub policy: String,
    pub prefill_policy: String,
    pub late_binding: bool,
    pub seed: u64,
    pub signature_timeout_s: f64,
    pub request_timeout_s: f64,
    pub connect_timeout_s: f64,
    pub first_byte_timeout_s: f64,
    pub stall_timeout_s: f64,
    pub retries: u32,
    pub eject_after_failures: u32,
    pub eject_base_s: f64,
    pub eject_max_s: f64,
    pub client_header_timeout_s: f64,
    pub client_body_timeout_s: f64,
    pub max_payload_size: usize,
    pub explain_headers: bool,
    /// Tokio worker threads.
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// Decisions queued for the drift monitor (`DataPlane::take_drift`); 0: drift feed off.
    #[serde(default)]
    pub signature_reservoir: usize,
    /// The refit reservoir's shape, for the keep/slot draw ([`crate::reservoir`]); needed
    /// when the drift feed is on.
    #[serde(default)]
    pub reservoir: Option<ReservoirShape>,
    /// Admission control (see [`crate::admission`]): requests in flight through the router
    /// at once (None: [`Config::max_concurrent`]'s default; 0: no bound), the wait queue in
    /// front of them (None: as many as the bound), and the longest wait in it.
    #[serde(default)]
    pub max_concurrent_requests: Option<usize>,
    #[serde(default)]
    pub queue_size: Option<usize>,
    #[serde(default = "default_queue_timeout")]
    pub queue_timeout_s: f64,
    /// A switchback experiment over decode policies (see [`crate::experiment`]); `policy`
    /// is then its first arm's.
    #[serde(default)]
    pub experiment: Option<crate::experiment::ExperimentConfig>,
}

/// Bucketed Algorithm R: `per_bucket` signatures stored out of every `span` offers
/// (`eldr_sglang.drift.reservoir.reservoir_shape` derives both from the drift options).
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct ReservoirShape {
    pub per_bucket: u64,
    pub span: u64,
}

/// Requests one decode worker is expected to hold at once, for the default admission bound.
/// SGLang decode workers run a few hundred requests per batch at most (SGLang 0.5.23 sets
/// `max_running_requests = 256` for DeepSeek-V4, the emulated decode worker's default is
/// 256); a router that lets more through only moves the queue into the workers, where the
/// requests time out, get their workers ejected and can no longer be refused cleanly.
pub const DEFAULT_SLOTS_PER_DECODE: usize = 256;
/// The SGLang gateway's `--queue-timeout-secs` default.
pub const DEFAULT_QUEUE_TIMEOUT_S: f64 = 60.0;
/// Largest admission bound or queue accepted (beyond it a bound means nothing).
pub const MAX_ADMISSION: usize = 1 << 20;

fn default_queue_timeout() -> f64 {
    DEFAULT_QUEUE_TIMEOUT_S
}

impl Config {
    pub fn from_json(text: &str) -> Result<Config, ConfigError> {
        let cfg: Config = serde_json::from_str(text)?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.prefill.is_empty() || self.decode.is_empty() {
            return bad("at least one prefill and one decode worker are needed".into());
        }
        for url in self.prefill.iter().map(|p| &p.url).chain(&self.decode).chain(std::iter::once(&self.control_url)) {
            let uri: Uri = match url.parse() {
                Ok(u) => u,
                Err(e) => return bad(format!("worker URL {url:?}: {e}")),
            };
            if uri.scheme_str() != Some("http") || uri.host().is_none() {
                return bad(format!("worker URL {url:?}: the Rust data plane speaks plain http://host:port only"));
            }
        }
        if !eldr_core::is_prefill_policy(&self.prefill_policy) {
            return bad(format!("unknown prefill policy {:?}", self.prefill_policy));
        }
        for (name, v) in [
            ("signature_timeout_s", self.signature_timeout_s),
            ("request_timeout_s", self.request_timeout_s),
            ("connect_timeout_s", self.connect_timeout_s),
            ("first_byte_timeout_s", self.first_byte_timeout_s),
            ("stall_timeout_s", self.stall_timeout_s),
            ("eject_base_s", self.eject_base_s),
            ("eject_max_s", self.eject_max_s),
            ("client_header_timeout_s", self.client_header_timeout_s),
            ("client_body_timeout_s", self.client_body_timeout_s),
        ] {
            if !(v.is_finite() && v > 0.0 && v < 1e9) {
                return bad(format!("{name} must be a positive number of seconds, got {v}"));
            }
        }
        if !(self.queue_timeout_s.is_finite() && self.queue_timeout_s > 0.0 && self.queue_timeout_s < 1e9) {
            return bad(format!("queue_timeout_s must be a positive number of seconds, got {}", self.queue_timeout_s));
        }
        for (name, v) in [("max_concurrent_requests", self.max_concurrent_requests), ("queue_size", self.queue_size)] {
            if v.is_some_and(|n| n > MAX_ADMISSION) {
                return bad(format!("{name} must be at most {MAX_ADMISSION}, got {}", v.unwrap_or(0)));
            }
        }
        if self.signature_reservoir > 0 && self.reservoir.is_none() && self.counts_policy() {
            return bad("signature_reservoir (the drift feed) needs the reservoir shape {\"per_bucket\", \"span\"}".into());
        }
        if let Some(x) = &self.experiment {
            x.check().map_err(ConfigError::Invalid)?;
            if x.arms[0].policy != self.policy {
                return bad(format!("experiment: arm 0 is {:?}, the policy {:?}", x.arms[0].policy, self.policy));
            }
            if self.signature_reservoir > 0 {
                return bad("experiment: the drift feed must be off (a refit would change the centroids between blocks)".into());
            }
        }
        if self.threads == 0 || self.threads > 64 {
            return bad(format!("threads must be 1..=64, got {}", self.threads));
        }
        Ok(())
    }

    /// The admission bound: the configured one, else DEFAULT_SLOTS_PER_DECODE per decode
    /// worker (0: no bound).
    pub fn max_concurrent(&self) -> usize {
        self.max_concurrent_requests.unwrap_or(DEFAULT_SLOTS_PER_DECODE * self.decode.len())
    }

    /// The wait queue: the configured one, else as long as the bound (a queued request then
    /// waits about one request's time per slot ahead of it, not an unbounded backlog).
    pub fn queue(&self) -> usize {
        self.queue_size.unwrap_or_else(|| self.max_concurrent())
    }

    /// Whether the decode policy routes on the prefill's expert counts (it counts fallbacks).
    pub fn counts_policy(&self) -> bool {
        eldr_core::is_counts_policy(&self.policy)
    }
}

pub fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}
