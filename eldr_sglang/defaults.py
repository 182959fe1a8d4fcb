"""The routing default the protocol study supports, in one place.

`eldr simulate --policies default` resolves to it, and the router service's config can import
it (this module imports nothing). It was chosen from benchmarks/results/tpot_study_protocol.md:
see the README's TPOT section for the numbers and every cell where it loses to a balancer.
"""

DEFAULT_POLICY = "locality"  # the locality-aware balancer (Rust policies/locality.rs)
DEFAULT_TAU = 0.1  # used only when DEFAULT_POLICY is "eldr"
DEFAULT_LOAD_FACTOR = 0.05  # the bounded-load cap of eldr/F, shared by locality/F


def default_policy_label() -> str:
    """The simulator's label for the default: policy/load_factor (e.g. "eldr/0.05")."""
    return f"{DEFAULT_POLICY}/{DEFAULT_LOAD_FACTOR:g}" if DEFAULT_LOAD_FACTOR is not None else DEFAULT_POLICY
