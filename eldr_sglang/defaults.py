"""The routing default the protocol study supports (and the fit's stopping share).

The routing defaults are defined once, in the Rust core (rust/core/src/policies/config.rs),
and read here: `eldr simulate --policies default` resolves to them, and the router service's
config reads them. They were chosen from benchmarks/results/tpot_study_protocol.md: see the
README's TPOT section for the numbers and every cell where the default loses to a balancer.
"""

from eldr_sglang._core import DEFAULT_LOAD_FACTOR, DEFAULT_POLICY, DEFAULT_TAU

__all__ = ["DEFAULT_LOAD_FACTOR", "DEFAULT_POLICY", "DEFAULT_TAU", "FIT_CHANGE_TOL", "FIT_SAMPLE_GROWTH", "default_policy_label"]

# `eldr fit`: Lloyd's iterations stop once at most this share of the requests changed cluster
# in one (or the objective improved by at most --tol). Chosen on GPT-OSS-20B traces at 200k
# and 1M requests, K = 64: benchmarks/results/bench_scale.md ("stopping rule").
FIT_CHANGE_TOL = 2e-3
# `eldr fit`: the winning restart (on a 20k sample) is refined on samples this many times
# larger before all requests (0: straight to all of them); same source.
FIT_SAMPLE_GROWTH = 10.0


def default_policy_label() -> str:
    """The simulator's label for the default: policy/load_factor (e.g. "eldr/0.05")."""
    return f"{DEFAULT_POLICY}/{DEFAULT_LOAD_FACTOR:g}" if DEFAULT_LOAD_FACTOR is not None else DEFAULT_POLICY
