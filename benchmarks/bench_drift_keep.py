"""How many routed requests copy their signature for the refit reservoir, before and after
the data plane draws the reservoir's keep/slot decision ahead of the route
(rust/dataplane/src/reservoir.rs), and what each copy costs in Python.

Before, with drift handling on, every routed request kept its signature: the Rust route's
KEEP variant, a sparse copy into the drift feed, numpy arrays across the boundary and a dense
unit signature in the hook. After, only the requests the reservoir stores do. The fraction is
Algorithm R's: in steady state a request at position n of its bucket (uniform over 0..span)
is stored with probability min(1, m / (n + 1)), so a bucket copies m (1 + H_span - H_m) of its
span signatures. This script draws with the real sampler (`_core.ReservoirSampler`) and
prints that next to the formula, then times the Python hand-over (`SignatureReservoir.offer`
with the data plane's sparse signature) for a stored and a skipped decision at DeepSeek-V3's
middle-band dimension. The Rust route's cost with and without the kept signature is the
criterion pair `wire_log6_route_counts` / `wire_log6_route_counts_keep` in
rust/core/benches/route.rs. Prints one JSON object.

    python benchmarks/bench_drift_keep.py [--requests 100000]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np


def harmonic(n: int) -> float:
    return sum(1.0 / i for i in range(1, n + 1))


def main(argv: list[str] | None = None) -> dict:
    from eldr_sglang import _core
    from eldr_sglang.drift.reservoir import SignatureReservoir, reservoir_shape
    from eldr_sglang.router.dataplane import DriftView

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100_000, help="offers drawn per shape")
    ap.add_argument("--dim", type=int, default=29 * 256, help="signature dimension (DeepSeek-V3 middle band)")
    ap.add_argument("--nnz", type=int, default=3000, help="non-zeros of the sparse signature")
    a = ap.parse_args(argv)
    out: dict = {"requests": a.requests, "shapes": []}
    for capacity, horizon in [(4096, 16384), (1024, 16384), (256, 16384)]:
        m, span = reservoir_shape(capacity, horizon)
        s = _core.ReservoirSampler(m, span, seed=0)
        warm = 32 * span  # all buckets full once
        for _ in range(warm):
            s.draw()
        kept = sum(s.draw()[1] is not None for _ in range(a.requests))
        formula = (m * (1 + harmonic(span) - harmonic(m))) / span
        out["shapes"].append({"capacity": capacity, "horizon": horizon, "per_bucket": m, "span": span,
                              "signatures_per_1000_before": 1000, "signatures_per_1000_after": round(1000 * kept / a.requests, 1),
                              "formula_per_1000": round(1000 * formula, 1)})
    # the Python side of one decision: a stored one densifies and copies its signature, a skipped one does not
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(a.dim, a.nnz, replace=False)).astype(np.uint32)
    val = rng.random(a.nnz).astype(np.float32)
    sig = (idx, val, float(np.linalg.norm(val)))
    r = SignatureReservoir(a.dim, capacity=1024, horizon=16384)
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        v = DriftView(1, "band", [0.1] * 8, sig, a.dim, (i, i % r.per_bucket))
        r.offer(i, i % r.per_bucket, v.unit_signature)
    stored_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for i in range(n, 2 * n):
        v = DriftView(1, "band", [0.1] * 8, None, a.dim, (i, None))
        r.offer(i, None, v.unit_signature)
    skipped_us = (time.perf_counter() - t0) / n * 1e6
    out["python_offer_us"] = {"stored": round(stored_us, 2), "skipped": round(skipped_us, 2),
                              "ratio": round(stored_us / skipped_us, 1) if skipped_us > 0 else math.inf}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
