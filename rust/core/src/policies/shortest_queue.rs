//! Fewest in-flight requests among healthy workers; ties to the lower index.

use super::{shortest_healthy, Decision, Policy, RouteContext};

pub struct ShortestQueue;

impl Policy for ShortestQueue {
    fn name(&self) -> &'static str {
        "shortest_queue"
    }

    fn choose(&self, ctx: &RouteContext) -> Decision {
        Decision::by_policy(shortest_healthy(ctx.loads, ctx.healthy))
    }
}
