//! ELDR's band rule (arXiv:2607.00466; README, "The ELDR rule"): d_k = 1 - cos(s, mu_k), d* = min over healthy k, band =
//! {k healthy : d_k <= d* + tau}; choose the band member with the shortest queue, ties to the
//! smaller d_k (then the lower index). Without a usable signature: shortest queue.
//!
//! Optional bounded loads (beyond the paper; off unless `load_factor` is set): when a burst of
//! one domain arrives, the band rule keeps sending it to the same few workers. As in
//! consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018), a
//! worker is a candidate only while its load is below `ceil((1 + f) * (total + 1) / n)`; the
//! band rule then runs over the candidates. The least-loaded worker is always a candidate, so
//! no worker ever exceeds (1 + f) times the mean load plus one.

use super::{load_cap, shortest_healthy, Decision, Policy, Reason, RouteContext};

pub struct Eldr;

/// The band's bound: worker k is in the band when d_k <= d* + tau. The router's rule below and
/// the calibration statistics (`band_size`, the drift baseline) share this one definition.
#[inline]
pub fn band_limit(d_star: f64, tau: f64) -> f64 {
    d_star + tau
}

/// Size of the band of one distance row with every worker eligible (the fit's calibration
/// statistic; the router's band also drops unhealthy and, bounded, full workers). 0 for an
/// empty row or one without a finite distance.
pub fn band_size(d: &[f64], tau: f64) -> usize {
    let d_star = d.iter().copied().fold(f64::INFINITY, f64::min);
    if !d_star.is_finite() {
        return 0;
    }
    let limit = band_limit(d_star, tau);
    d.iter().filter(|&&x| x <= limit).count()
}

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
        let cap = ctx.load_factor.map(|f| load_cap(ctx, f));
        let eligible = |k: usize| ctx.healthy[k] && cap.is_none_or(|c| ctx.loads[k] < c);
        let d_star = (0..d.len()).filter(|&k| eligible(k)).map(|k| d[k]).fold(f64::INFINITY, f64::min);
        if !d_star.is_finite() {
            // no eligible worker with a centroid (those that joined since the last refit have
            // none): the fallback's rule, over every healthy worker
            return Decision { worker: shortest_healthy(ctx.loads, ctx.healthy), reason: Reason::NoCentroids, d_star: None, band: None };
        }
        let limit = band_limit(d_star, ctx.tau);
        let mut best: Option<usize> = None;
        for k in 0..d.len() {
            if !eligible(k) || d[k] > limit {
                continue;
            }
            best = match best {
                Some(b) if (ctx.loads[b], d[b]) <= (ctx.loads[k], d[k]) => Some(b),
                _ => Some(k),
            };
        }
        let band = ctx.explain.then(|| (0..d.len()).filter(|&k| eligible(k) && d[k] <= limit).collect());
        Decision { worker: best, reason: Reason::Band, d_star: Some(d_star), band }
    }
}

#[cfg(test)]
mod band_size_tests {
    use super::band_size;

    #[test]
    fn counts_the_workers_within_tau_of_the_nearest() {
        assert_eq!(band_size(&[0.30, 0.10, 0.15, 0.21], 0.1), 2);
        assert_eq!(band_size(&[0.30, 0.10, 0.15, 0.20], 0.1), 3, "the bound is inclusive");
        assert_eq!(band_size(&[0.5, 0.5], 0.0), 2);
        assert_eq!(band_size(&[], 0.1), 0);
        assert_eq!(band_size(&[f64::NAN, f64::INFINITY], 0.1), 0);
    }
}
