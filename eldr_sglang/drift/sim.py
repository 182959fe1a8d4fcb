"""Deprecated name of eldr_sglang.drift.drifting_workload (renamed so it is not mistaken for the
simulator package eldr_sglang.sim)."""

import warnings

from eldr_sglang.drift.drifting_workload import *  # noqa: F401,F403
from eldr_sglang.drift.drifting_workload import AdaptivePolicy, drifting_trace  # noqa: F401

warnings.warn("eldr_sglang.drift.sim is now eldr_sglang.drift.drifting_workload", DeprecationWarning, stacklevel=2)
