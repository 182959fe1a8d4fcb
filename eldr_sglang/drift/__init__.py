"""Drift-aware re-clustering (issue 6): detect when live traffic leaves the fit's profile
and refit the centroids online.

- monitor.py    DriftMonitor: windowed d* and cluster-share statistics vs the fit's baseline
- reservoir.py  SignatureReservoir: fixed-memory uniform sample over a sliding horizon
- refit.py      refit from the reservoir (background process), least-disturbance worker
                mapping, atomic write, RefitController (drift / schedule / on demand)
- sim.py        the adaptive ELDR policy for the simulator and a drifting workload

See docs/drift.md.
"""

from eldr_sglang.drift.monitor import DriftMonitor, baseline_from_provenance, js_divergence
from eldr_sglang.drift.refit import RefitController, RefitError, refit_centroids, refit_file, remap_to_workers
from eldr_sglang.drift.reservoir import SignatureReservoir

__all__ = [
    "DriftMonitor",
    "RefitController",
    "RefitError",
    "SignatureReservoir",
    "baseline_from_provenance",
    "js_divergence",
    "refit_centroids",
    "refit_file",
    "remap_to_workers",
]
