"""Deprecated alias: the numpy reference moved to `eldr_sglang.testing.reference` (tests only)."""

import warnings

from eldr_sglang.testing.reference import band_route, distances, signature  # noqa: F401

warnings.warn("eldr_sglang.reference moved to eldr_sglang.testing.reference", DeprecationWarning, stacklevel=2)
