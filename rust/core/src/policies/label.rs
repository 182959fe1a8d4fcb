//! Policy labels as the router's `--experiment` writes its arms: `name` or `name/F`, F the
//! bounded-load factor of a counts policy (`none` or `off`: the paper's rule). Parsed here
//! once (`_core.parse_arms`; the router's config reads it), with the command line's messages.

use super::spec::MAX_LOAD_FACTOR;
use super::{counts_policies, is_counts_policy, POLICIES};

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
    let (name, factor) = match label.split_once('/') {
        Some((n, f)) => (n, Some(f)),
        None => (label, None),
    };
    if name.contains('@') {
        return Err("tau is the router's (--eldr-tau), the same for every arm".into());
    }
    let Some(info) = POLICIES.iter().find(|p| p.name == name) else {
        let names: Vec<&str> = POLICIES.iter().map(|p| p.name).collect();
        return Err(format!("unknown policy {}; choose from {}", py_repr(name), names.join(", ")));
    };
    let mut load_factor = if is_counts_policy(name) { default_load_factor } else { None };
    if let Some(f) = factor {
        if !info.uses_counts {
            return Err(format!("/F (a load factor) applies to {} only", counts_policies().join(" and ")));
        }
        load_factor = parse_factor(f)?;
        if load_factor.is_some_and(|lf| !(lf.is_finite() && (0.0..=MAX_LOAD_FACTOR).contains(&lf))) {
            return Err("the load factor must be between 0 and 1e6".into()); // MAX_LOAD_FACTOR (a test pins it)
        }
    }
    Ok(ArmLabel { label: label.to_owned(), policy: info.name, load_factor })
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
    fn strings_are_quoted_as_python_quotes_them() {
        assert_eq!(py_repr("a"), "'a'");
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("'\""), "'\\'\"'");
        assert_eq!(py_repr("a\\b\n\x01"), "'a\\\\b\\n\\x01'");
    }
}
