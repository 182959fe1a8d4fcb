//! Healthy workers in turn (a shared atomic cursor; unhealthy ones are skipped).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Decision, Policy, RouteContext};

#[derive(Default)]
pub struct RoundRobin(AtomicUsize);

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn choose(&self, ctx: &RouteContext) -> Decision {
        let n = ctx.healthy.len();
        let start = self.0.fetch_add(1, Ordering::Relaxed);
        Decision::by_policy((0..n).map(|i| (start + i) % n).find(|&w| ctx.healthy[w]))
    }
}
