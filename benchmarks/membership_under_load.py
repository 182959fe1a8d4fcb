"""A membership change under load: does the router lose a request while a decode worker is
added and another removed through --workers-file, and how long until each change takes effect?

Setup: an emulated cluster (`python -m eldr_sglang.emulate cluster`: 1 prefill, 3 decode), the
router started with --workers-file alone (decode 0 and 1), its default policy with a centroid
file fitted for those two (the added worker has no centroid until a refit; more router flags
after `--`, e.g. `-- --disagg-router round_robin`), and --clients closed-loop clients
(each sends the next request when its last one ends). After --warmup seconds decode 2 is
added to the file; --phase seconds later decode 0 is removed; --phase seconds later the run ends.

Reported: requests, failures (any answer but 200, or none), and for each change the seconds
from writing the file to its effect: the add, to the first request routed to the new worker
(by the time the request was sent); the remove, to the last request sent that was still routed
to the removed worker (a negative figure: none was sent after the write). Requests served per
decode worker in each phase show the traffic moving.

    python benchmarks/membership_under_load.py [--clients 16] [--phase 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from eldr_sglang.testing.pd_cluster import get_json, make_trace_files, post, start_cluster, start_router

GEN = {"text": "membership under load", "sampling_params": {"max_new_tokens": 8}}


def _write(path: Path, cluster: dict, decodes: list[str]) -> float:
    (purl, bport), = cluster["prefill"]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"prefill": [{"url": purl, "bootstrap_port": bport}], "decode": [{"url": u} for u in decodes]}, f)
    os.replace(tmp, path)
    return time.monotonic()


def _slots(base: str) -> dict[str, str]:
    """slot (as X-ELDR-Decode-Worker gives it) -> url, every slot ever used."""
    return {str(w["slot"]): w["url"] for w in get_json(base + "/eldr/status")["decode_workers"]}


def _clients(base: str, n: int, stop: threading.Event) -> tuple[list, list[threading.Thread]]:
    results: list[tuple[float, float, int, str | None]] = []  # (sent, ended, status, decode slot)
    lock = threading.Lock()

    def client():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                code, headers, _ = post(base + "/generate", GEN, timeout=60)
                got = (t0, time.monotonic(), code, headers.get("X-ELDR-Decode-Worker"))
            except OSError:
                got = (t0, time.monotonic(), 0, None)
            with lock:
                results.append(got)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="membership_"))
    _, tpath, cpath = make_trace_files(work, requests=40, seed=5, workers=2)  # centroids for the 2 decode at start
    cproc, cluster = start_cluster(tpath, work, prefill=1, decode=3, time_scale=args.time_scale)
    d0, d1, d2 = cluster["decode"]
    path = work / "workers.json"
    _write(path, cluster, [d0, d1])
    rproc = None
    try:
        rproc, base = start_router({"prefill": [], "decode": []}, work, [
            "--workers-file", str(path), "--workers-file-interval", str(args.interval),
            "--load-monitor-interval", "0.2", "--health-check-interval-secs", "1", "--eldr-centroids", str(cpath),
            *args.router_args])
        stop = threading.Event()
        t_start = time.monotonic()
        results, threads = _clients(base, args.clients, stop)
        time.sleep(args.warmup)
        t_add = _write(path, cluster, [d0, d1, d2])
        time.sleep(args.phase)
        t_remove = _write(path, cluster, [d1, d2])
        time.sleep(args.phase)
        stop.set()
        for t in threads:
            t.join(timeout=90)
        t_end = time.monotonic()
        slots = _slots(base)
        membership = get_json(base + "/eldr/status")["membership"]
    finally:
        if rproc is not None:
            rproc.stop()
        cproc.stop()
    return _summary(args, results, slots, (t_start, t_add, t_remove, t_end), (d0, d2), membership)


def _summary(args, results, slots, times, changed, membership) -> dict:
    t_start, t_add, t_remove, t_end = times
    removed, added = changed
    url_of = [(sent, ended, code, slots.get(w) if w is not None else None) for sent, ended, code, w in results]
    to_added = [sent for sent, _, code, u in url_of if u == added]
    to_removed = [sent for sent, _, code, u in url_of if u == removed]
    phases = {"before the add": (t_start, t_add), "after the add": (t_add, t_remove), "after the remove": (t_remove, t_end)}
    per_phase = {}
    for name, (lo, hi) in phases.items():
        counts: dict[str, int] = {}
        for sent, _, code, u in url_of:
            if lo <= sent < hi and u is not None:
                counts[u] = counts.get(u, 0) + 1
        per_phase[name] = counts
    return {
        "requests": len(results),
        "failures": sum(1 for r in results if r[2] != 200),
        "clients": args.clients,
        "workers_file_interval_s": args.interval,
        "time_scale": args.time_scale,
        "add_effect_s": round(min(to_added) - t_add, 3) if to_added else None,
        "remove_effect_s": round(max(to_removed) - t_remove, 3) if to_removed else None,
        "duration_s": round(t_end - t_start, 2),
        "requests_per_worker": per_phase,
        "router_args": args.router_args,
        "final_membership": membership["workers"],
    }


def _table(s: dict) -> str:
    rows = [("requests", s["requests"]), ("failures", s["failures"]), ("clients (closed loop)", s["clients"]),
            ("--workers-file-interval (s)", s["workers_file_interval_s"]),
            ("add: file written -> first request to the new worker (s)", s["add_effect_s"]),
            ("remove: file written -> last request sent to the removed worker (s)", s["remove_effect_s"]),
            ("run (s)", s["duration_s"])]
    out = [f"| {k} | {v} |" for k, v in rows]
    out.append("")
    out.append("| phase | " + " | ".join(sorted({u for c in s["requests_per_worker"].values() for u in c})) + " |")
    workers = sorted({u for c in s["requests_per_worker"].values() for u in c})
    for name, c in s["requests_per_worker"].items():
        out.append(f"| {name} | " + " | ".join(str(c.get(u, 0)) for u in workers) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients (default 16)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the add (default 3)")
    ap.add_argument("--phase", type=float, default=5.0, help="seconds after each change (default 5)")
    ap.add_argument("--interval", type=float, default=1.0, help="--workers-file-interval (default 1, the router's)")
    ap.add_argument("--time-scale", type=float, default=0.05, help="emulated worker time scale (default 0.05)")
    ap.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    ap.add_argument("router_args", nargs="*", help="more router flags, after --")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.warmup < 0 or args.phase <= 0 or args.interval <= 0 or args.time_scale <= 0:
        print("membership_under_load: --clients >= 1, --phase, --interval and --time-scale > 0", file=sys.stderr)
        return 2
    s = run(args)
    print(_table(s))
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2) + "\n")
    return 0 if s["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
