"""Deprecated alias of `eldr_sglang.traces.stats` (moved into the traces package); import that instead."""

import sys
import warnings

from eldr_sglang.traces import stats as _moved

warnings.warn(
    "eldr_sglang.trace_stats is deprecated; import eldr_sglang.traces.stats instead",
    DeprecationWarning,
    stacklevel=2,
)
# The old name is the new module itself, so every public and private name, and monkeypatching, carry over.
sys.modules[__name__] = _moved
