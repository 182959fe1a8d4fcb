//! Uniformly random healthy worker (seeded, lock-free).

use super::{Decision, Policy, RouteContext};
use crate::rng::AtomicRng;

pub struct Random(AtomicRng);

impl Random {
    pub fn new(seed: u64) -> Self {
        Random(AtomicRng::new(seed))
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn choose(&self, ctx: &RouteContext) -> Decision {
        let n = ctx.healthy.iter().filter(|&&h| h).count();
        if n == 0 {
            return Decision::by_policy(None);
        }
        let pick = self.0.below(n);
        Decision::by_policy((0..ctx.healthy.len()).filter(|&w| ctx.healthy[w]).nth(pick))
    }
}
