"""`eldr route-demo`: fit-free routing on a toy domain-skewed workload, in a second.

Each of K domains gets an expert profile; the centroid file holds those profiles directly
(no fit), and requests drawn from the domains are routed by every policy. It shows the
band rule at work: how often a request lands on its own domain's worker, and the load
spread. The full study (fit + simulated TPOT) is `eldr demo`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from eldr_sglang.cli import args as A


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route-demo", help="fit-free routing demo on a toy domain-skewed workload")
    p.add_argument("--workers", type=A.integer(1, 1024), default=4, help="decode workers = domains (default 4)")
    p.add_argument("--requests", type=A.integer(1, 10_000_000), default=2000, help="requests to route (default 2000)")
    p.add_argument("--tau", type=A.tau, default=0.1, help="band width (default 0.1)")
    p.add_argument("--seed", type=A.seed, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from eldr_sglang import POLICIES, Router, write_centroids

    if args.workers < 1 or args.requests < 1:
        raise ValueError("--workers and --requests must be at least 1")
    rng = np.random.default_rng(args.seed)
    L, E, k = 12, 32, 4
    profiles = rng.dirichlet(np.full(E, 0.1), size=(args.workers, L))  # [K, L, E]
    weights = np.ones(L, np.float32)
    idf = np.ones((L, E), np.float32)
    domains = rng.integers(args.workers, size=args.requests)
    counts = np.stack([rng.multinomial(64 * k, profiles[d, l]) for d in domains for l in range(L)])
    counts = counts.reshape(args.requests, L, E).astype(np.uint32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "toy.eldr"
        write_centroids(str(path), profiles.reshape(args.workers, -1).astype(np.float32), weights, idf, tau=args.tau)
        for policy in POLICIES:
            router = Router(policy, num_workers=args.workers, centroids=str(path), seed=args.seed)
            leases, own = [], 0
            for i in range(args.requests):
                w = router.route_dense(counts[i])
                own += int(w == domains[i])
                leases.append(router.acquire(w))
                if len(leases) > 4 * args.workers:  # a steady in-flight window
                    leases.pop(0).release()
            loads = np.bincount([lease.worker for lease in leases], minlength=args.workers)
            rows.append((policy, own / args.requests, loads.max() - loads.min()))
            for lease in leases:
                lease.release()
    print(f"{'policy':<16}{'own-domain worker':>18}{'final load spread':>19}")
    for policy, own, spread in rows:
        print(f"{policy:<16}{own:>17.1%}{spread:>19d}")
    return 0
