"""eldr-sglang: expert-locality-aware decode routing for SGLang PD-disaggregated MoE serving.

The hot path (signature normalizer, band router, baseline policies, queue tracker,
centroid file) lives in the Rust extension `eldr_sglang._core`; this package holds the
offline pipeline, the router service, the simulator and the `eldr` command line.
The Rust names are re-exported here lazily, so pure-Python modules import without it.
"""

from __future__ import annotations

_CORE_NAMES = {
    "FORMAT_VERSION",
    "POLICIES",
    "CentroidFileError",
    "CentroidSet",
    "Decision",
    "Lease",
    "NoHealthyWorker",
    "NoSignature",
    "Router",
    "SignatureSpec",
    "__version__",
    "count_topk",
    "distinct_per_layer",
    "write_centroids",
}


def __getattr__(name: str):
    if name in _CORE_NAMES:
        from eldr_sglang import _core

        return getattr(_core, name)
    raise AttributeError(f"module 'eldr_sglang' has no attribute {name!r}")


__all__ = sorted(_CORE_NAMES)
