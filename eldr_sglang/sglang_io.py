"""Deprecated alias of `eldr_sglang.traces.sglang_responses` (moved into the traces package); import that instead."""

import sys
import warnings

from eldr_sglang.traces import sglang_responses as _moved

warnings.warn(
    "eldr_sglang.sglang_io is deprecated; import eldr_sglang.traces.sglang_responses instead",
    DeprecationWarning,
    stacklevel=2,
)
# The old name is the new module itself, so every public and private name, and monkeypatching, carry over.
sys.modules[__name__] = _moved
