"""What the "signatures" occupancy source costs per request and per poll (issue 32). CONSTRUCTED
profiles: for each model shape, prompts of T tokens whose top-k experts are drawn uniformly
per selected layer (a uniform draw touches the most cells: the worst case for the sizes).

Per request: the core's profile -> `eldr_profile` JSON (the data plane does this once per
decode attempt), its size, and the decode worker's add + remove of it
(sglang_ext/profile_occupancy.py). Per poll of one worker: the worker's report for its
running requests, and the router's blend of it (`Router.report_occupancy`).

    python benchmarks/occupancy_overhead.py [--json PATH]

Times are medians of repeated calls on this machine, in microseconds; they are the side that
grows with the model, not a claim about any other machine."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

# (name, MoE layers the centroid file selects, experts per layer, top-k, prompt tokens, batch)
SHAPES = [("gpt-oss-20b", 8, 32, 4, 512, 32), ("deepseek-v3", 8, 256, 8, 512, 32), ("deepseek-v3", 8, 256, 8, 4096, 32)]


def _median_us(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * float(np.median(ts))


def measure(L: int, E: int, k: int, T: int, batch: int, seed: int = 0) -> dict:
    from eldr_sglang import _core
    from eldr_sglang.sglang_ext.profile_occupancy import ProfileOccupancy

    rng = np.random.default_rng(seed)

    def profile():
        counts = np.stack([np.bincount(rng.integers(0, E, size=T * k), minlength=E) for _ in range(L)]).ravel()
        idx = np.flatnonzero(counts)
        return _core.ExpertProfile(L, E, idx.astype(np.int64), counts[idx].astype(np.float64), T)

    profs = [profile() for _ in range(batch)]
    wires = [json.loads(p.to_wire_json()) for p in profs]
    occ = ProfileOccupancy()
    for w in wires[1:]:
        occ.add(w)
    layers = ",".join(map(str, range(L)))

    def add_remove():
        occ.remove(occ.add(wires[0]))

    router = _core.Router(policy="locality", num_workers=2, seed=0)
    leases = [router.acquire(0, 1, profile=p) for p in profs[: batch // 2]]
    idle = np.asarray(occ.report(layers)["eldr_occupancy"]["idle"], dtype=np.float64).ravel()

    def blend():
        router.report_occupancy(router.occupancy_snapshot(0), idle)

    row = {"layers": L, "experts": E, "top_k": k, "prompt_tokens": T, "batch": batch,
           "cells_per_request": int(np.mean([p.nnz for p in profs])),
           "profile_bytes": int(np.mean([len(p.to_wire_json()) for p in profs])),
           "to_json_us": _median_us(profs[0].to_wire_json, 200),
           "worker_add_remove_us": _median_us(add_remove, 200),
           "worker_report_us": _median_us(lambda: occ.report(layers), 50),
           "router_blend_us": _median_us(blend, 50)}
    del leases
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON (never over an existing file)")
    args = ap.parse_args()
    rows = []
    for name, L, E, k, T, B in SHAPES:
        r = measure(L, E, k, T, B)
        r["model"] = name
        rows.append(r)
    print("| model | selected layers x experts | prompt tokens | cells/request | eldr_profile bytes | to JSON us | "
          "worker add+remove us | worker report us (batch) | router blend us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['layers']} x {r['experts']} | {r['prompt_tokens']} | {r['cells_per_request']} | "
              f"{r['profile_bytes']} | {r['to_json_us']:.1f} | {r['worker_add_remove_us']:.1f} | "
              f"{r['worker_report_us']:.0f} ({r['batch']}) | {r['router_blend_us']:.0f} |")
    if args.json:
        from eldr_sglang import io_safe

        io_safe.write_text(args.json, json.dumps({"constructed": True, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
