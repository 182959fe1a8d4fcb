"""The simulator's workload lives in `eldr_sglang.workload` (one Workload for the simulator
and the synthetic traces); these names stay importable from here."""

from eldr_sglang.workload import ARRIVALS, Workload, arrival_times, replay_workload  # noqa: F401

make_workload = replay_workload  # the old name
