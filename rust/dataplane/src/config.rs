//! The data plane's configuration: the Python launcher's RouterConfig, as JSON
//! (`eldr_sglang.router.config.plane_config`). This is the one check of its numeric
//! settings: Python's RouterConfig runs it too ([`Config::check_numbers`] through
//! `_core.DataPlane.check_numbers`) so a bad flag is refused before anything starts, with
//! the flag's name, and does not check them again.

use std::fmt;
use std::time::Duration;

use hyper::Uri;
use serde::Deserialize;
use eldr_core::fmt_g;
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
    /// The public port (the check takes 1..=65535, as --port).
    pub port: u16,
    pub prefill: Vec<PrefillWorker>,
    pub decode: Vec<String>,
    /// Every path the data plane does not serve itself goes here (the Python control plane).
    pub control_url: String,
    /// The decode policy: the router's (its spec's), which `from_json` sets; the launcher's
    /// JSON does not repeat it.
    #[serde(default)]
    pub policy: String,
    pub prefill_policy: String,
    pub seed: u64,
    pub signature_timeout_s: f64,
    pub request_timeout_s: f64,
    pub connect_timeout_s: f64,
    pub first_byte_timeout_s: f64,
    /// A streamed decode's response head must come within this (at most the first-byte
    /// timeout): a worker at work sends it before anything runs, so one that has not is hung.
    #[serde(default = "default_decode_progress")]
    pub decode_progress_timeout_s: f64,
    pub stall_timeout_s: f64,
    pub retries: u32,
    pub eject_after_failures: u32,
    pub eject_base_s: f64,
    pub eject_max_s: f64,
    pub client_header_timeout_s: f64,
    pub client_body_timeout_s: f64,
    pub max_payload_size: usize,
    pub explain_headers: bool,
    /// Send each request's expert profile to its decode worker (`eldr_profile`), which sums
    /// them for its occupancy report (--eldr-occupancy-reports): only to a worker whose last
    /// load poll carried a report (an unpatched one would ignore it).
    #[serde(default)]
    pub forward_profile: bool,
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
    /// The bytes of request bodies held at once (None: [`Config::buffer_limit`]'s default).
    #[serde(default)]
    pub max_buffered_bytes: Option<usize>,
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
/// The default bound on request-body bytes held at once (128 bodies of the default 8 MiB).
pub const DEFAULT_MAX_BUFFERED: usize = 1 << 30;
/// The SGLang gateway's `--queue-timeout-secs` default.
pub const DEFAULT_QUEUE_TIMEOUT_S: f64 = 60.0;
/// Largest admission bound or queue accepted (beyond it a bound means nothing).
pub const MAX_ADMISSION: usize = 1 << 20;

/// The default of `--decode-progress-timeout-secs`: far below a client's patience (a 12 s
/// client lost requests to a hung decode when only the 60 s first-byte timeout bounded it).
pub const DEFAULT_DECODE_PROGRESS_S: f64 = 5.0;

fn default_decode_progress() -> f64 {
    DEFAULT_DECODE_PROGRESS_S
}

fn default_queue_timeout() -> f64 {
    DEFAULT_QUEUE_TIMEOUT_S
}

impl Config {
    /// `router_policy`: the decode policy of the router the plane routes on (the policy
    /// reaches the data plane once, through the router's spec).
    pub fn from_json(text: &str, router_policy: &str) -> Result<Config, ConfigError> {
        // the numbers are checked on the JSON as given, so that a negative count or a NaN
        // timeout is named by its flag instead of failing the typed read
        let raw: serde_json::Value = serde_json::from_str(text)?;
        check_numbers(&raw).map_err(ConfigError::Invalid)?;
        let mut cfg: Config = serde_json::from_value(raw)?;
        cfg.policy = router_policy.to_owned();
        cfg.check()?;
        Ok(cfg)
    }

    /// Only the numeric settings of `text` (what the router's command line sets), each named
    /// by its flag: the router's config runs this before anything starts.
    pub fn check_numbers(text: &str) -> Result<(), ConfigError> {
        check_numbers(&serde_json::from_str(text)?).map_err(ConfigError::Invalid)
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
        if self.max_buffered_bytes.is_some_and(|b| b < self.max_payload_size) {
            return bad(format!("--max-buffered-bytes ({}) must be >= --max-payload-size ({})", self.buffer_limit(), self.max_payload_size));
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

    /// The bound on request-body bytes held at once: the configured one, else 1 GiB (at
    /// least one largest body).
    pub fn buffer_limit(&self) -> usize {
        self.max_buffered_bytes.unwrap_or(DEFAULT_MAX_BUFFERED.max(self.max_payload_size))
    }

    /// Whether the decode policy routes on the prefill's expert counts (it counts fallbacks).
    pub fn counts_policy(&self) -> bool {
        eldr_core::is_counts_policy(&self.policy)
    }
}

const DAY_S: f64 = 86400.0;
const WEEK_S: f64 = 7.0 * DAY_S;

/// One numeric setting: its JSON key, the router flag that sets it, its bounds, whether it
/// is an integer, and whether 0 is allowed outside the bounds (0: off or no bound).
struct Bound {
    key: &'static str,
    flag: &'static str,
    lo: f64,
    hi: f64,
    integer: bool,
    zero_ok: bool,
}

const fn secs_in(key: &'static str, flag: &'static str, hi: f64) -> Bound {
    Bound { key, flag, lo: 1e-3, hi, integer: false, zero_ok: false }
}

const fn count(key: &'static str, flag: &'static str, lo: f64, hi: f64, zero_ok: bool) -> Bound {
    Bound { key, flag, lo, hi, integer: true, zero_ok }
}

/// The data plane's numeric settings, in the order they are checked. A timeout shorter than
/// a millisecond cannot be met; longer than a day (a week for a whole request or stream) is
/// a typo. MAX_ADMISSION bounds the admission settings.
const BOUNDS: [Bound; 19] = [
    count("port", "--port", 1.0, 65535.0, false),
    secs_in("signature_timeout_s", "--eldr-signature-timeout-secs", DAY_S),
    count("seed", "--seed", 0.0, u64::MAX as f64, true),
    secs_in("request_timeout_s", "--request-timeout-secs", WEEK_S),
    count("max_payload_size", "--max-payload-size", 1.0, (1u64 << 31) as f64, false),
    secs_in("connect_timeout_s", "--upstream-connect-timeout-secs", DAY_S),
    secs_in("first_byte_timeout_s", "--first-byte-timeout-secs", WEEK_S),
    secs_in("decode_progress_timeout_s", "--decode-progress-timeout-secs", DAY_S),
    secs_in("stall_timeout_s", "--stall-timeout-secs", WEEK_S),
    count("retries", "--retries", 0.0, 64.0, true),
    count("eject_after_failures", "--eject-after-failures", 1.0, 1_000_000.0, false),
    secs_in("eject_base_s", "--eject-base-secs", DAY_S),
    secs_in("eject_max_s", "--eject-max-secs", WEEK_S),
    secs_in("client_header_timeout_s", "--client-header-timeout-secs", DAY_S),
    secs_in("client_body_timeout_s", "--client-body-timeout-secs", DAY_S),
    count("max_concurrent_requests", "--max-concurrent-requests", 0.0, MAX_ADMISSION as f64, true),
    count("queue_size", "--queue-size", 0.0, MAX_ADMISSION as f64, true),
    secs_in("queue_timeout_s", "--queue-timeout-secs", DAY_S),
    count("max_buffered_bytes", "--max-buffered-bytes", 1.0, (1u64 << 40) as f64, false),
];

/// A JSON value as a number: Python writes a NaN or infinite float as the string "nan",
/// "inf" or "-inf" (JSON has none). Err: what to print of a value that is no number.
fn number(v: &serde_json::Value) -> Result<f64, String> {
    match v {
        serde_json::Value::Number(n) => Ok(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) if s == "nan" => Ok(f64::NAN),
        serde_json::Value::String(s) if s == "inf" => Ok(f64::INFINITY),
        serde_json::Value::String(s) if s == "-inf" => Ok(f64::NEG_INFINITY),
        serde_json::Value::Bool(b) => Err(if *b { "True" } else { "False" }.into()),
        other => Err(other.to_string()),
    }
}

/// Every numeric setting in range, named by its flag, in the words of the router's command
/// line (`must be between 0.001 and 86400, got 0`); absent or null settings are skipped.
fn check_numbers(raw: &serde_json::Value) -> Result<(), String> {
    for b in &BOUNDS {
        let Some(v) = raw.get(b.key).filter(|v| !v.is_null()) else { continue };
        let x = number(v).map_err(|shown| format!("{} must be {}, got {shown}", b.flag, if b.integer { "an integer" } else { "a number" }))?;
        // an integer beyond 64 bits reads as a whole float: out of range, not "not an integer"
        let whole = v.is_i64() || v.is_u64() || (v.is_f64() && x.fract() == 0.0 && x.abs() >= 9.2e18);
        if b.integer && !whole {
            let shown = if x.is_nan() { "nan".to_string() } else if x.is_infinite() { fmt_g(x) } else { format!("{x:?}") };
            return Err(format!("{} must be an integer, got {shown}", b.flag));
        }
        if !x.is_finite() {
            return Err(format!("{} must be a finite number, got {}", b.flag, fmt_g(x)));
        }
        // an integer past 64 bits (a whole float here) is past every bound
        let exact = !b.integer || v.is_i64() || v.is_u64();
        if (b.zero_ok && x == 0.0) || (exact && (b.lo..=b.hi).contains(&x)) {
            continue;
        }
        let off = if b.zero_ok && b.lo > 0.0 { " (or 0: off)" } else { "" };
        let got = match (b.integer, v.as_i64(), v.as_u64()) {
            (false, _, _) => fmt_g(x),
            (true, Some(n), _) => n.to_string(),
            (true, None, Some(n)) => n.to_string(),
            (true, None, None) => format!("{x:.0}"),
        };
        return Err(format!("{} must be between {} and {}{off}, got {got}", b.flag, fmt_g(b.lo), fmt_g(b.hi)));
    }
    let secs_of = |k: &str| raw.get(k).and_then(|v| v.as_f64());
    if let (Some(max), Some(base)) = (secs_of("eject_max_s"), secs_of("eject_base_s")) {
        if max < base {
            return Err(format!("--eject-max-secs ({}) must be >= --eject-base-secs ({})", fmt_g(max), fmt_g(base)));
        }
    }
    Ok(())
}

pub fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_as_python_g() {
        for (v, want) in [(86400.0, "86400"), (1e-3, "0.001"), (604800.0, "604800"), (2147483648.0, "2.14748e+09"), (1e300, "1e+300"), (-0.5, "-0.5"), (0.0, "0"), (1048576.0, "1.04858e+06"), (1.5e-5, "1.5e-05"), (f64::NAN, "nan"), (f64::NEG_INFINITY, "-inf")] {
            assert_eq!(fmt_g(v), want);
        }
    }

    #[test]
    fn numeric_settings_are_named_by_their_flag() {
        let check = |json: &str| check_numbers(&serde_json::from_str(json).unwrap());
        assert_eq!(check(r#"{"stall_timeout_s": 0}"#).unwrap_err(), "--stall-timeout-secs must be between 0.001 and 604800, got 0");
        assert_eq!(check(r#"{"stall_timeout_s": "nan"}"#).unwrap_err(), "--stall-timeout-secs must be a finite number, got nan");
        assert_eq!(check(r#"{"retries": -1}"#).unwrap_err(), "--retries must be between 0 and 64, got -1");
        assert_eq!(check(r#"{"retries": 1.5}"#).unwrap_err(), "--retries must be an integer, got 1.5");
        assert_eq!(check(r#"{"max_payload_size": -1}"#).unwrap_err(), "--max-payload-size must be between 1 and 2.14748e+09, got -1");
        assert_eq!(check(r#"{"seed": 18446744073709551616}"#).unwrap_err(), "--seed must be between 0 and 1.84467e+19, got 18446744073709551616");
        assert_eq!(check(r#"{"port": true}"#).unwrap_err(), "--port must be an integer, got True");
        assert_eq!(check(r#"{"eject_base_s": 10, "eject_max_s": 5}"#).unwrap_err(), "--eject-max-secs (5) must be >= --eject-base-secs (10)");
        // 0 is off where it always was; null is "not set"
        assert!(check(r#"{"retries": 0, "max_concurrent_requests": 0, "queue_size": null, "seed": 18446744073709551615}"#).is_ok());
    }
}
