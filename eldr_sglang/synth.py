"""Deprecated alias of `eldr_sglang.traces.synth` (moved into the traces package); import that instead."""

import sys
import warnings

from eldr_sglang.traces import synth as _moved

warnings.warn(
    "eldr_sglang.synth is deprecated; import eldr_sglang.traces.synth instead",
    DeprecationWarning,
    stacklevel=2,
)
# The old name is the new module itself, so every public and private name, and monkeypatching, carry over.
sys.modules[__name__] = _moved
