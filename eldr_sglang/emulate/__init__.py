"""Emulated SGLang PD workers for the serving path on CPU (see `workers`).

    python -m eldr_sglang.emulate prefill --trace T.npz --port 31000 --bootstrap-port 31100
    python -m eldr_sglang.emulate decode  --trace T.npz --port 31010
    python -m eldr_sglang.emulate cluster --trace T.npz --prefill 2 --decode 4 --base-port 31000

`cluster` runs all workers in one process (prefill i on base+i with bootstrap base+100+i,
decode j on base+10+j) and prints one line `READY {json}` with their URLs.
Step and prefill times come from the simulator's ExecutionModel, scaled by --time-scale.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys

from aiohttp import web


# `cluster` port layout: prefill i on base+i, decode j on base+10+j, bootstrap i on base+100+i
MAX_CLUSTER_PREFILL = 10
MAX_CLUSTER_DECODE = 90


def build_parser() -> argparse.ArgumentParser:
    from eldr_sglang.cli.args import integer, real

    port = integer(1, 65535)
    ap = argparse.ArgumentParser(prog="python -m eldr_sglang.emulate", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)

    def common(p):
        p.add_argument("--trace", required=True, help="ELDR trace (.npz) whose routing the workers replay")
        p.add_argument("--model", default="auto", help="model profile (default: from the trace)")
        p.add_argument("--hardware", default="h200", help="hardware profile (default h200)")
        p.add_argument("--time-scale", type=real(0, lo_open=True), default=1.0, help="multiply every modelled time (<1: faster)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--no-signature", action="store_true", help="prefill: behave like an unpatched worker")
        p.add_argument("--signature-off", metavar="REASON", default=None,
                       help="prefill: behave like a patched worker whose parallel layout cannot be attributed "
                            "(/server_info says eldr_signature: off (REASON); no signature is streamed)")
        p.add_argument("--assign", choices=["hash", "sequential"], default="hash",
                       help="prefill: map prompts to trace requests by hash, or in arrival (trace) order")
        p.add_argument("--max-running-requests", type=integer(1, 1 << 20), default=256, help="decode batch limit")
        p.add_argument("--occupancy-source", choices=("signatures", "steps"), default="signatures",
                       help="decode: what its expert occupancy report (/v1/loads?eldr_layers=...) is made of: the "
                       "running requests' profiles the router sent (default), or its decode steps' experts, "
                       "averaged over the last 32 steps")
        p.add_argument("--bootstrap-timeout-secs", type=real(0, lo_open=True), default=300.0)
        p.add_argument("--log-level", default="warning")
        p.add_argument("--fault", action="append", default=[], metavar="[ROLE:INDEX=]MODE",
                       help="inject a fault (see eldr_sglang.emulate.workers): MODE for a single worker, "
                       "ROLE:INDEX=MODE (e.g. decode:1=hang) in a cluster; repeatable")

    p = sub.add_parser("prefill", help="one emulated prefill worker")
    common(p)
    p.add_argument("--port", type=port, required=True)
    p.add_argument("--bootstrap-port", type=port, required=True)
    d = sub.add_parser("decode", help="one emulated decode worker")
    common(d)
    d.add_argument("--port", type=port, required=True)
    c = sub.add_parser("cluster", help="prefill and decode workers in one process")
    common(c)
    c.add_argument("--prefill", type=integer(0, MAX_CLUSTER_PREFILL), default=2)
    c.add_argument("--decode", type=integer(0, MAX_CLUSTER_DECODE), default=4)
    c.add_argument("--base-port", type=port, required=True,
                   help="prefill i listens on BASE+i (bootstrap BASE+100+i), decode j on BASE+10+j")
    c.add_argument("--kv-in-process", action="store_true",
                   help="decode takes the KV of this process's prefill workers by a call instead of GET /kv/{room} "
                   "(same handoff and answers, less CPU: for benchmarks whose bottleneck must not be the emulator)")
    return ap


async def _run(args) -> None:
    from eldr_sglang.emulate.workers import DecodeWorker, PrefillWorker, WorkerSpec
    from eldr_sglang.traces import open_trace

    trace = open_trace(args.trace)  # v1, or v2 (the requests that kept decode routing are replayed)
    spec = WorkerSpec(trace=trace, model=args.model, hardware=args.hardware, time_scale=args.time_scale)
    runners = []

    async def site(app, port):
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, args.host, port, backlog=1024).start()
        runners.append(runner)

    urls = {"prefill": [], "decode": []}
    sequence = itertools.count() if args.assign == "sequential" else None
    if args.role == "cluster":
        plan = [("prefill", args.base_port + i, args.base_port + 100 + i) for i in range(args.prefill)]
        plan += [("decode", args.base_port + 10 + j, None) for j in range(args.decode)]
    elif args.role == "prefill":
        plan = [("prefill", args.port, args.bootstrap_port)]
    else:
        plan = [("decode", args.port, None)]
    faults: dict[tuple[str, int], list[str]] = {}
    for f in args.fault:
        key, sep, mode = f.partition("=")
        if sep:
            role_name, _, idx = key.partition(":")
            if role_name not in ("prefill", "decode") or not idx.isdigit():
                raise ValueError(f"--fault {f!r}: expected ROLE:INDEX=MODE with ROLE prefill or decode")
            faults.setdefault((role_name, int(idx)), []).append(mode)
        else:
            faults.setdefault((args.role, 0), []).append(f)
    seen = {"prefill": 0, "decode": 0}
    local_bootstrap: dict = {}  # (host, bootstrap port) -> PrefillWorker, with --kv-in-process
    for role, port, bport in plan:
        index = seen[role]
        seen[role] += 1
        specs = faults.get((role, index), [])
        if role == "prefill":
            w = PrefillWorker(spec, signature=not args.no_signature, bootstrap_timeout_s=args.bootstrap_timeout_secs,
                              sequence=sequence, signature_off=args.signature_off)
            await site(w.app(), port)
            await site(w.bootstrap_app(), bport)
            if getattr(args, "kv_in_process", False):
                local_bootstrap[(args.host, bport)] = w
            urls["prefill"].append([f"http://{args.host}:{port}", bport])
        else:
            w = DecodeWorker(spec, max_running=args.max_running_requests, kv_timeout_s=args.bootstrap_timeout_secs,
                             local_bootstrap=local_bootstrap, occupancy_source=args.occupancy_source)
            await site(w.app(), port)
            urls["decode"].append(f"http://{args.host}:{port}")
        for mode in specs:
            w.faults.set(mode)
    print("READY " + json.dumps(urls), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for r in runners:
            await r.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices[args.role]
    if args.role == "cluster":
        top = args.base_port + max(100 + args.prefill - 1 if args.prefill else 0, 10 + args.decode - 1 if args.decode else 0)
        if top > 65535:
            sub.error(f"argument --base-port: {args.base_port} puts the last worker on port {top}, above 65535")
    elif args.role == "prefill" and args.port == args.bootstrap_port:
        sub.error("argument --bootstrap-port: must differ from --port")
    logging.basicConfig(level=args.log_level.upper())
    try:
        import uvloop  # optional: a faster event loop when installed

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError) as exc:
        print(f"emulate: error: {exc}", file=sys.stderr)
        return 1
    return 0
