//! Power of two choices (Mitzenmacher 2001): sample two distinct healthy workers, take the
//! one with the shorter queue (ties to the first sample).

use super::{Decision, Policy, RouteContext};
use crate::rng::AtomicRng;

pub struct PowerOfTwo(AtomicRng);

impl PowerOfTwo {
    pub fn new(seed: u64) -> Self {
        PowerOfTwo(AtomicRng::new(seed))
    }
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn choose(&self, ctx: &RouteContext) -> Decision {
        let healthy: Vec<usize> = (0..ctx.healthy.len()).filter(|&w| ctx.healthy[w]).collect();
        let n = healthy.len();
        if n <= 1 {
            return Decision::by_policy(healthy.first().copied());
        }
        let a = self.0.below(n);
        let b = (a + 1 + self.0.below(n - 1)) % n; // distinct from a
        let (a, b) = (healthy[a], healthy[b]);
        Decision::by_policy(Some(if ctx.loads[b] < ctx.loads[a] { b } else { a }))
    }
}
