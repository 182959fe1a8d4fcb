"""Route latency of the Rust hot path vs the numpy reference, side by side in one run.

One route = the Python call + signature from counts + distances to K centroids + band rule
(+ queue acquire/release, measured separately). Counts are those of a prompt of
`--tokens` tokens drawn with domain-skewed routing, given dense [L, E] or sparse (index,
count). Shapes: Mixtral-8x7B (32x8, top-2), GPT-OSS-20B (24x32, top-4), DeepSeek-V3
(58x256, top-8); K in {4, 8, 16}. The middle 60% of layers are selected.

The `wire` rows start from the prefill's stream event as the router receives it (the SSE
`data:` bytes holding the `eldr_signature` payload, encoded as the prefill encodes it, within
16 KiB): the Rust path (`_core.decode_event` + `Router.route_counts`, the payload read
straight into the signature) against the path it replaced (json.loads of the event, the
numpy decode into a dense [L, E] array, `route_dense`; the numpy decode here skips the old
decoder's validation, so the old path's figure is if anything low). The `wire:*` rows time
its parts alone: `decode_event`, `route_counts` of the decoded counts, and `route_dense` of
the same (decoded) counts as a dense float32 array.

The locality balancer is timed beside ELDR on the same counts and centroid file (K from
--locality-workers, with --inflight requests already counted per worker): building the
request's profile from the dense counts, its route, and acquire+release of its lease, each
with the profile over the file's selected layers (what the router service does) and over all
layers (what the simulator's study used). ELDR's side: route_dense and a plain lease.

    python benchmarks/bench_router.py [--tokens 2048] [--calls 3000] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from eldr_sglang import Router, _core, write_centroids
from eldr_sglang._core import ExpertProfile
from eldr_sglang.sglang_ext.payload import META_KEY, encode_counts
from eldr_sglang.testing import reference as ref

SHAPES = {"mixtral-8x7b": (32, 8, 2), "gpt-oss-20b": (24, 32, 4), "deepseek-v3": (58, 256, 8)}


def middle_mask(L: int) -> np.ndarray:
    w = np.zeros(L, np.float32)
    w[int(0.2 * L) : int(0.8 * L) or L] = 1.0
    return w


def prompt_counts(rng, L, E, k, tokens):
    pref = rng.dirichlet(np.full(E, 0.3), size=L)
    counts = np.zeros((L, E), np.uint32)
    for layer in range(L):
        # k distinct experts per token, drawn by the layer's preference (Gumbel top-k)
        g = np.log(pref[layer]) + rng.gumbel(size=(tokens, E))
        picks = np.argpartition(-g, k - 1, axis=1)[:, :k]
        counts[layer] = np.bincount(picks.ravel(), minlength=E)
    return counts


def timed(fn, calls):
    for _ in range(min(200, calls)):
        fn()
    out = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        out[i] = time.perf_counter_ns() - t0
    return out / 1000.0  # µs


def numpy_route(counts, w, idf, cents, loads, healthy, tau):
    sig = ref.signature(counts, w, idf)
    return ref.band_route(sig, cents, loads, healthy, tau)[0]


def bench_shape(name, K, tokens, calls, repeats, rng, tmp):
    L, E, k = SHAPES[name]
    w = middle_mask(L)
    idf = rng.uniform(0.05, 3.0, (L, E)).astype(np.float32)
    D = int((w > 0).sum()) * E
    cents = rng.random((K, D)).astype(np.float32) ** 3
    path = Path(tmp) / f"{name}-{K}.eldr"
    write_centroids(str(path), cents, w, idf, tau=0.1)
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    router = Router("eldr", centroids=str(path))
    counts = prompt_counts(rng, L, E, k, tokens)
    nz = np.flatnonzero(counts)
    index, values = nz.astype(np.int64), counts.ravel()[nz].astype(np.float32)
    loads, healthy = [0] * K, [True] * K

    def np_sparse():
        dense = np.zeros(L * E, np.float32)
        dense[index] = values
        return numpy_route(dense.reshape(L, E), w, idf, cents, loads, healthy, 0.1)

    # the two must agree before their speed is compared
    assert router.route_sparse(index, values) == np_sparse() == router.route_dense(counts)
    payload = encode_counts(counts, list(range(L)), tokens)
    event = json.dumps({"text": "", "meta_info": {"id": "r0", META_KEY: [payload]}}).encode()
    layout = (L, E)

    def wire_old():  # the router before: parse the event, numpy decode to dense, route dense
        p = json.loads(event)["meta_info"][META_KEY][0]
        return router.route_dense(ref.decode_counts(p))

    def wire_new():
        return router.route_counts(_core.decode_event(event, layout=layout))

    assert wire_old() == wire_new()
    wire_counts = _core.decode_event(event, layout=layout)
    wire_dense = wire_counts.to_layout(L, E)  # the same (decoded) counts, dense float32
    rust_fns = {
        "sparse": lambda: router.route_sparse(index, values),
        "dense": lambda: router.route_dense(counts),
        "wire": wire_new,
        # the wire row's parts, each from Python
        "wire:decode_event": lambda: _core.decode_event(event, layout=layout),
        "wire:route_counts": lambda: router.route_counts(wire_counts),
        "wire:route_dense_same_counts": lambda: router.route_dense(wire_dense),
    }
    numpy_fns = {
        "sparse": np_sparse,
        "dense": lambda: numpy_route(counts, w, idf, cents, loads, healthy, 0.1),
        "wire": wire_old,
    }
    # Interleaved repeats: every cell once per round, so a burst of load from the other
    # sessions on the machine hits all cells alike; p50 = min over rounds of the round's
    # median, p99 = median over rounds of the round's p99.
    med, p99 = {}, {}
    for _ in range(repeats):
        for key, fn in [(("rust", k), f) for k, f in rust_fns.items()] + [(("numpy", k), f) for k, f in numpy_fns.items()]:
            t = timed(fn, calls if key[0] == "rust" else max(calls // 5, 200))
            med.setdefault(key, []).append(float(np.median(t)))
            p99.setdefault(key, []).append(float(np.percentile(t, 99)))
    p50_of = {key: min(v) for key, v in med.items()}
    p99_of = {key: float(np.median(v)) for key, v in p99.items()}
    rows = []
    for form in rust_fns:
        has_np = ("numpy", form) in p50_of
        rows.append(
            {
                "shape": name, "K": K, "D": D, "input": form, "nnz": int(nz.size),
                "encoding": payload["enc"] if form.startswith("wire") else None,
                "bits": payload["bits"] if form.startswith("wire") else None,
                "rust_p50_us": p50_of[("rust", form)], "rust_p99_us": p99_of[("rust", form)],
                "rust_p50_us_per_round": med[("rust", form)],
                "numpy_p50_us": p50_of[("numpy", form)] if has_np else None,
                "numpy_p99_us": p99_of[("numpy", form)] if has_np else None,
                "speedup_p50": p50_of[("numpy", form)] / p50_of[("rust", form)] if has_np else None,
            }
        )
    return rows


def bench_locality(name, K, tokens, calls, inflight, rng, tmp):
    """Locality vs ELDR per request at one shape: (profile build, route, acquire+release) µs."""
    L, E, k = SHAPES[name]
    w = middle_mask(L)
    idf = rng.uniform(0.05, 3.0, (L, E)).astype(np.float32)
    D = int((w > 0).sum()) * E
    path = Path(tmp) / f"loc-{name}-{K}.eldr"
    write_centroids(str(path), rng.random((K, D)).astype(np.float32) ** 3, w, idf, tau=0.1)
    eldr = Router("eldr", centroids=str(path), load_factor=0.05)
    sel = Router("locality", centroids=str(path), load_factor=0.05)
    full = Router("locality", num_workers=K, load_factor=0.05)

    def full_profile(c):
        nz = np.flatnonzero(c)
        return ExpertProfile(L, E, nz.astype(np.int64), c.ravel()[nz].astype(np.float64), tokens)

    # the state a busy router is in: `inflight` requests of other prompts on every worker
    held = []
    for i in range(inflight * K):
        c = prompt_counts(rng, L, E, k, tokens)
        held += [sel.acquire(i % K, 0, profile=sel.profile_dense(c, tokens)),
                 full.acquire(i % K, 0, profile=full_profile(c)), eldr.acquire(i % K, 0)]
    counts = prompt_counts(rng, L, E, k, tokens).astype(np.float32)  # float32, as the router decodes it
    p_sel, p_full = sel.profile_dense(counts, tokens), full_profile(counts)
    med = lambda t: float(np.median(t))  # noqa: E731
    p99 = lambda t: float(np.percentile(t, 99))  # noqa: E731
    t = {
        "eldr_route": timed(lambda: eldr.route_dense(counts), calls),
        "eldr_lease": timed(lambda: eldr.acquire(3 % K, 0).release(), calls),
        "sel_profile": timed(lambda: sel.profile_dense(counts, tokens), calls),
        "sel_route": timed(lambda: sel.route_profile(p_sel), calls),
        "sel_lease": timed(lambda: sel.acquire(3 % K, 0, profile=p_sel).release(), calls),
        "all_route": timed(lambda: full.route_profile(p_full), calls),
        "all_lease": timed(lambda: full.acquire(3 % K, 0, profile=p_full).release(), calls),
    }
    for lease in held:
        lease.release()
    row = {"shape": name, "K": K, "tokens": tokens, "inflight_per_worker": inflight,
           "selected_layers": int((w > 0).sum()), "layers": L, "nnz_selected": p_sel.nnz, "nnz_all": p_full.nnz}
    for key, v in t.items():
        row[f"{key}_p50_us"], row[f"{key}_p99_us"] = med(v), p99(v)
    eldr_total = row["eldr_route_p50_us"] + row["eldr_lease_p50_us"]
    row["locality_selected_total_p50_us"] = row["sel_profile_p50_us"] + row["sel_route_p50_us"] + row["sel_lease_p50_us"]
    row["locality_all_total_p50_us"] = row["all_route_p50_us"] + row["all_lease_p50_us"]  # profile built in numpy: not counted
    row["selected_vs_eldr"] = row["locality_selected_total_p50_us"] / eldr_total
    row["all_vs_eldr"] = row["locality_all_total_p50_us"] / eldr_total
    return row


def print_locality(rows):
    print("\nlocality balancer vs eldr per request, µs p50 (p99); Python call included")
    hdr = (f"{'shape':<13}{'K':>3}{'layers':>8}{'nnz':>7}{'eldr route':>15}{'eldr lease':>13}{'profile':>15}"
           f"{'loc route':>15}{'loc acq+rel':>15}{'total vs eldr':>15}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        def c(key):
            return f"{r[key + '_p50_us']:.1f} ({r[key + '_p99_us']:.0f})"
        print(f"{r['shape']:<13}{r['K']:>3}{str(r['selected_layers']) + '/' + str(r['layers']):>8}{r['nnz_selected']:>7}"
              f"{c('eldr_route'):>15}{c('eldr_lease'):>13}{c('sel_profile'):>15}{c('sel_route'):>15}{c('sel_lease'):>15}"
              f"{r['selected_vs_eldr']:>14.1f}x")
        print(f"{'  all layers':<13}{'':>3}{str(r['layers']) + '/' + str(r['layers']):>8}{r['nnz_all']:>7}{'':>15}{'':>13}"
              f"{'(numpy)':>15}{c('all_route'):>15}{c('all_lease'):>15}{r['all_vs_eldr']:>14.1f}x")
    print("total = profile + route + acquire+release of locality over route + lease of eldr; "
          "'all layers' = the profile the simulator used (built in numpy, not timed)")


def bench_lease(calls):
    router = Router("shortest_queue", num_workers=8)

    def pair():
        router.acquire(3, 100).release()

    t = timed(pair, calls)
    return {"python_acquire_release_p50_us": float(np.median(t)), "python_acquire_release_p99_us": float(np.percentile(t, 99))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens behind the counts")
    ap.add_argument("--calls", type=int, default=3000, help="timed Rust calls per cell and round")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over all cells, interleaved (p50: min over rounds of the median; p99: median of the rounds' p99)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--workers", default="4,8,16", help="comma list of K")
    ap.add_argument("--locality-workers", default="8", help="comma list of K for the locality rows ('' : none)")
    ap.add_argument("--inflight", type=int, default=4, help="requests already in flight per worker in the locality rows")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    import os

    load_start = os.getloadavg()
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            if name not in SHAPES:
                ap.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
            for K in map(int, args.workers.split(",")):
                rows.extend(bench_shape(name, K, args.tokens, args.calls, args.repeats, rng, tmp))
        loc_rows = [bench_locality(name, K, args.tokens, args.calls, args.inflight, rng, tmp)
                    for name in args.shapes.split(",") for K in map(int, filter(None, args.locality_workers.split(",")))]
    lease = bench_lease(args.calls * 10)
    load_end = os.getloadavg()
    hdr = f"{'shape':<14}{'K':>3}{'D':>7}{'input':>40}{'nnz':>7}{'rust p50':>10}{'rust p99':>10}{'numpy p50':>11}{'numpy p99':>11}{'speedup':>9}"
    print(f"route latency, µs (prompt of {args.tokens} tokens; Python call included; "
          f"{args.repeats} interleaved round(s) of {args.calls} calls: p50 = min over rounds of the median)")
    print(f"load average at start {load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f}, "
          f"at end {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f} (1/5/15 min)")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        npy = (f"{r['numpy_p50_us']:>11.1f}{r['numpy_p99_us']:>11.1f}{r['speedup_p50']:>8.1f}x" if r["numpy_p50_us"] is not None
               else f"{'':>11}{'':>11}{'':>9}")
        label = r["input"] if not r["input"].startswith("wire") else f"{r['input']} ({r['encoding']} {r['bits']}b)"
        print(f"{r['shape']:<14}{r['K']:>3}{r['D']:>7}{label:>40}{r['nnz']:>7}{r['rust_p50_us']:>10.1f}{r['rust_p99_us']:>10.1f}" + npy)
    print(f"\nlease acquire+release from Python: p50 {lease['python_acquire_release_p50_us']:.2f} µs, "
          f"p99 {lease['python_acquire_release_p99_us']:.2f} µs (Rust-only figure: cargo bench -p eldr-core)")
    if loc_rows:
        print_locality(loc_rows)
    print("(wire rows: 'numpy' = the path the Rust wire decode replaced: json.loads + numpy decode + route_dense;"
          " wire:* = the wire row's parts, each called alone from Python)")
    target = next((r for r in rows if r["shape"] == "deepseek-v3" and r["K"] == 8 and r["input"] == "sparse"), None)
    if target:
        print(
            f"targets (deepseek-v3, K=8, sparse): p50 {target['rust_p50_us']:.1f} µs (<= 20), "
            f"p99 {target['rust_p99_us']:.1f} µs (<= 50), {target['speedup_p50']:.0f}x numpy (>= 20)"
        )
    wire = next((r for r in rows if r["shape"] == "deepseek-v3" and r["K"] == 8 and r["input"] == "wire"), None)
    if wire:
        print(
            f"target (deepseek-v3, K=8, from the wire payload, {wire['encoding']}): p50 {wire['rust_p50_us']:.1f} µs (<= 20), "
            f"{wire['speedup_p50']:.1f}x the old path (p50 {wire['numpy_p50_us']:.1f} µs)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "calls": args.calls, "repeats": args.repeats,
                                               "load_average_start": load_start, "load_average": load_end, "routes": rows,
                                               "lease": lease, "locality": loc_rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
