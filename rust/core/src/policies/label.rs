//! Policy labels, one grammar for the router and the simulator: `name[@tau][/F][:rc=R]`.
//! `@tau` is ELDR's band width (eldr only), `/F` the bounded-load factor of a counts policy
//! (`none` or `off`: the paper's rule), `:rc=R` the locality cost's per-request term
//! (locality and paged). The router's `--experiment` arms take `name` or `name/F`
//! ([`parse_arms`]: tau is the router's); the simulator's labels take all three
//! ([`parse_label`]; `eldr simulate --policies`). Every bound is the router's (spec.rs), so a
//! label the simulator takes is one the router takes. Parsed here once, with the command
//! line's messages.

use super::spec::{MAX_LOAD_FACTOR, MAX_REQUEST_COST, MAX_TAU};
use super::{counts_policies, is_counts_policy, POLICIES};

/// The locality cost's variant over paged experts: a label of its own (the router spells it
/// `locality` with `--enable-paged-experts`).
pub const PAGED: &str = "paged";

/// One policy label's parts (a part not written: None).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLabel {
    pub policy: &'static str,
    pub tau: Option<f64>,
    /// `/F` as written: `Some(None)` for `/none`.
    pub load_factor: Option<Option<f64>>,
    pub request_cost: Option<f64>,
}

/// `name[@tau][/F][:rc=R]` -> its parts, each checked against the router's bounds.
pub fn parse_label(label: &str) -> Result<PolicyLabel, String> {
    parse_parts(label, true)
}

/// `a`, `a and b`, `a, b and c`.
fn join_and(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// [`parse_label`]; `paged`: whether the paged-experts label is one (not among the router's arms).
fn parse_parts(label: &str, paged: bool) -> Result<PolicyLabel, String> {
    let (head, rc) = match label.split_once(':') {
        Some((h, opt)) => (h.trim(), Some(parse_rc(opt)?)),
        None => (label.trim(), None),
    };
    let (head, factor) = match head.split_once('/') {
        Some((n, f)) => (n, Some(f)),
        None => (head, None),
    };
    let (name, tau) = match head.split_once('@') {
        Some((n, t)) => (n, Some(t)),
        None => (head, None),
    };
    let policy = if paged && name == PAGED {
        PAGED
    } else {
        match POLICIES.iter().find(|p| p.name == name) {
            Some(info) => info.name,
            None => {
                let names: Vec<&str> = POLICIES.iter().map(|p| p.name).chain(paged.then_some(PAGED)).collect();
                return Err(format!("unknown policy {}; choose from {}", py_repr(name), names.join(", ")));
            }
        }
    };
    let bounded: Vec<&str> = counts_policies().into_iter().chain(paged.then_some(PAGED)).collect();
    let tau = match tau {
        None => None,
        Some(_) if policy != "eldr" => return Err("@tau (the band width) applies to eldr only".into()),
        Some(t) => match py_float(t.trim()) {
            Some(v) if v.is_finite() && (0.0..=MAX_TAU).contains(&v) => Some(v),
            Some(_) => return Err(format!("tau must be between 0 and {MAX_TAU}")),
            None => return Err(format!("expected a number for tau, got {}", py_repr(t))),
        },
    };
    let load_factor = match factor {
        None => None,
        Some(_) if !bounded.contains(&policy) => return Err(format!("/F (a load factor) applies to {} only", join_and(&bounded))),
        Some(f) => {
            let lf = parse_factor(f)?;
            if lf.is_some_and(|lf| !(lf.is_finite() && (0.0..=MAX_LOAD_FACTOR).contains(&lf))) {
                return Err("the load factor must be between 0 and 1e6".into()); // MAX_LOAD_FACTOR (a test pins it)
            }
            Some(lf)
        }
    };
    if rc.is_some() && !(policy == "locality" || policy == PAGED) {
        return Err(format!(":rc=R (the locality cost's per-request term) applies to locality and {PAGED} only"));
    }
    Ok(PolicyLabel { policy, tau, load_factor, request_cost: rc })
}

/// `rc=R` -> R, finite and in [0, MAX_REQUEST_COST].
fn parse_rc(opt: &str) -> Result<f64, String> {
    let Some((key, value)) = opt.split_once('=').filter(|(k, _)| k.trim() == "rc") else {
        return Err(format!("unknown option {}: use :rc=R (the per-request term)", py_repr(opt)));
    };
    match py_float(value.trim()) {
        Some(r) if r.is_finite() && (0.0..=MAX_REQUEST_COST).contains(&r) => Ok(r),
        Some(_) => Err(format!("the request cost must be between 0 and {MAX_REQUEST_COST:e}")),
        None => Err(format!("expected a number for {}=, got {}", key.trim(), py_repr(value))),
    }
}

/// The most arms an experiment takes (and the fewest: 2).
pub const MAX_ARMS: usize = 16;

/// One arm: its label as given (trimmed), its policy and load factor (None: none, or not a
/// bounded-load policy).
#[derive(Debug, Clone, PartialEq)]
pub struct ArmLabel {
    pub label: String,
    pub policy: &'static str,
    pub load_factor: Option<f64>,
}

/// `"locality/0.05,round_robin"` -> arms; a plain counts policy takes `default_load_factor`
/// (`--eldr-load-factor`). The error is the command line's line.
pub fn parse_arms(text: &str, default_load_factor: Option<f64>) -> Result<Vec<ArmLabel>, String> {
    let mut arms: Vec<ArmLabel> = Vec::new();
    for raw in text.split(',') {
        let label = raw.trim();
        if label.is_empty() {
            return Err(format!("expected arms like locality/0.05,round_robin, got {}", py_repr(text)));
        }
        let arm = parse_arm(label, default_load_factor).map_err(|why| format!("arm {}: {why}", py_repr(label)))?;
        if arms.iter().any(|a| a.label == label) {
            return Err(format!("arm {} is given twice", py_repr(label)));
        }
        arms.push(arm);
    }
    if !(2..=MAX_ARMS).contains(&arms.len()) {
        return Err(format!("an experiment needs 2 to {MAX_ARMS} arms, got {}", arms.len()));
    }
    Ok(arms)
}

fn parse_arm(label: &str, default_load_factor: Option<f64>) -> Result<ArmLabel, String> {
    if label.contains('@') {
        return Err("tau is the router's (--eldr-tau), the same for every arm".into());
    }
    if label.contains(':') {
        return Err("the per-request term is the router's (--eldr-request-cost), the same for every arm".into());
    }
    let parsed = parse_parts(label, false)?;
    let load_factor = match parsed.load_factor {
        Some(lf) => lf,
        None if is_counts_policy(parsed.policy) => default_load_factor,
        None => None,
    };
    Ok(ArmLabel { label: label.to_owned(), policy: parsed.policy, load_factor })
}

/// A load factor as `--eldr-load-factor` reads it: a number, or `none`/`off` (None).
fn parse_factor(text: &str) -> Result<Option<f64>, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("none") || t.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    py_float(t).map(Some).ok_or_else(|| format!("expected a number >= 0 or 'none', got {}", py_repr(text)))
}

/// A number as Python's `float()` reads it: Rust's grammar plus underscores between digits.
fn py_float(t: &str) -> Option<f64> {
    let b = t.as_bytes();
    let ok = (0..b.len()).all(|i| b[i] != b'_' || (i > 0 && i + 1 < b.len() && b[i - 1].is_ascii_digit() && b[i + 1].is_ascii_digit()));
    if !ok {
        return None;
    }
    t.replace('_', "").parse::<f64>().ok()
}

/// A string as Python's `repr` writes it (the command line's messages quote what was typed
/// that way): single quotes unless it holds one and no double quote.
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arms_parse_with_their_load_factors() {
        let arms = parse_arms("locality/0.05, round_robin ,eldr/none,eldr/OFF ", Some(0.2)).unwrap();
        let got: Vec<_> = arms.iter().map(|a| (a.label.as_str(), a.policy, a.load_factor)).collect();
        assert_eq!(got, [("locality/0.05", "locality", Some(0.05)), ("round_robin", "round_robin", None), ("eldr/none", "eldr", None), ("eldr/OFF", "eldr", None)]);
        assert_eq!(parse_arms("eldr,random", Some(0.2)).unwrap()[0].load_factor, Some(0.2), "a plain counts policy takes the default");
    }

    #[test]
    fn bad_arms_are_the_command_lines_lines() {
        let e = |t: &str| parse_arms(t, None).unwrap_err();
        assert_eq!(e("round_robin"), "an experiment needs 2 to 16 arms, got 1");
        assert_eq!(e("round_robin,,random"), "expected arms like locality/0.05,round_robin, got 'round_robin,,random'");
        assert_eq!(e("round_robin,round_robin"), "arm 'round_robin' is given twice");
        assert_eq!(e("round_robin,fastest"), "arm 'fastest': unknown policy 'fastest'; choose from eldr, locality, random, round_robin, shortest_queue, power_of_two");
        assert_eq!(e("round_robin/0.1,random"), "arm 'round_robin/0.1': /F (a load factor) applies to eldr and locality only");
        assert_eq!(e("locality/x,random"), "arm 'locality/x': expected a number >= 0 or 'none', got 'x'");
        assert_eq!(MAX_LOAD_FACTOR, 1e6, "the message names the bound");
        assert_eq!(e("locality/-1,random"), "arm 'locality/-1': the load factor must be between 0 and 1e6");
        assert_eq!(e("locality/nan,random"), "arm 'locality/nan': the load factor must be between 0 and 1e6");
        assert_eq!(e("locality/1__0,random"), "arm 'locality/1__0': expected a number >= 0 or 'none', got '1__0'");
        assert_eq!(parse_arms("locality/1_0,random", None).unwrap()[0].load_factor, Some(10.0), "as Python's float() reads it");
        assert_eq!(e("eldr@0.2,random"), "arm 'eldr@0.2': tau is the router's (--eldr-tau), the same for every arm");
        assert_eq!(e(&(0..17).map(|i| format!("eldr/{i}")).collect::<Vec<_>>().join(",")), "an experiment needs 2 to 16 arms, got 17");
    }

    #[test]
    fn labels_parse_every_part_against_the_routers_bounds() {
        let l = |t: &str| parse_label(t).unwrap();
        assert_eq!(l("eldr@0.3/0.05"), PolicyLabel { policy: "eldr", tau: Some(0.3), load_factor: Some(Some(0.05)), request_cost: None });
        assert_eq!(l(" locality/none:rc=0.4 "), PolicyLabel { policy: "locality", tau: None, load_factor: Some(None), request_cost: Some(0.4) });
        assert_eq!(l("paged:rc=0"), PolicyLabel { policy: "paged", tau: None, load_factor: None, request_cost: Some(0.0) });
        assert_eq!(l("round_robin"), PolicyLabel { policy: "round_robin", tau: None, load_factor: None, request_cost: None });
        let e = |t: &str| parse_label(t).unwrap_err();
        assert_eq!(e("eldr@3"), "tau must be between 0 and 2", "the router's bound (MAX_TAU), not the simulator's own");
        assert_eq!(e("eldr/2e6"), "the load factor must be between 0 and 1e6");
        assert_eq!(e("locality@0.1"), "@tau (the band width) applies to eldr only");
        assert_eq!(e("random/0.1"), "/F (a load factor) applies to eldr, locality and paged only");
        assert_eq!(e("eldr:rc=1"), ":rc=R (the locality cost's per-request term) applies to locality and paged only");
        assert_eq!(e("locality:rc=-1"), "the request cost must be between 0 and 1e6");
        assert_eq!(e("locality:x=1"), "unknown option 'x=1': use :rc=R (the per-request term)");
        assert_eq!(e("oracle"), "unknown policy 'oracle'; choose from eldr, locality, random, round_robin, shortest_queue, power_of_two, paged");
        assert!(parse_arms("paged,random", None).unwrap_err().starts_with("arm 'paged': unknown policy 'paged'"), "paged is no arm");
        assert_eq!(parse_arms("locality:rc=1,random", None).unwrap_err(), "arm 'locality:rc=1': the per-request term is the router's (--eldr-request-cost), the same for every arm");
    }

    #[test]
    fn strings_are_quoted_as_python_quotes_them() {
        assert_eq!(py_repr("a"), "'a'");
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("'\""), "'\\'\"'");
        assert_eq!(py_repr("a\\b\n\x01"), "'a\\\\b\\n\\x01'");
    }
}
