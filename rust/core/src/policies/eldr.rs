//! ELDR's band rule (ELDR.md): d_k = 1 - cos(s, mu_k), d* = min over healthy k, band =
//! {k healthy : d_k <= d* + tau}; choose the band member with the shortest queue, ties to the
//! smaller d_k (then the lower index). Without a usable signature: shortest queue.

use super::{shortest_healthy, Decision, Policy, Reason, RouteContext};

pub struct Eldr;

impl Policy for Eldr {
    fn name(&self) -> &'static str {
        "eldr"
    }

    fn uses_signature(&self) -> bool {
        true
    }

    fn choose(&self, ctx: &RouteContext) -> Decision {
        let Some(d) = ctx.distances else {
            return Decision { worker: shortest_healthy(ctx.loads, ctx.healthy), reason: ctx.fallback, d_star: None, band: None };
        };
        let d_star = (0..d.len()).filter(|&k| ctx.healthy[k]).map(|k| d[k]).fold(f64::INFINITY, f64::min);
        if !d_star.is_finite() {
            return Decision { worker: None, reason: Reason::Band, d_star: None, band: None };
        }
        let limit = d_star + ctx.tau;
        let mut best: Option<usize> = None;
        for k in 0..d.len() {
            if !ctx.healthy[k] || d[k] > limit {
                continue;
            }
            best = match best {
                Some(b) if (ctx.loads[b], d[b]) <= (ctx.loads[k], d[k]) => Some(b),
                _ => Some(k),
            };
        }
        let band = ctx.explain.then(|| (0..d.len()).filter(|&k| ctx.healthy[k] && d[k] <= limit).collect());
        Decision { worker: best, reason: Reason::Band, d_star: Some(d_star), band }
    }
}
