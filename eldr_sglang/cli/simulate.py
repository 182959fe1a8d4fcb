"""`eldr simulate`: simulate a PD cluster's decode TPOT under several routing policies."""

from __future__ import annotations

import argparse
import sys

DEFAULT_POLICIES = "random,round_robin,shortest_queue,power_of_two,eldr"


def register(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate decode TPOT per routing policy on a routing trace",
        description=(
            "Discrete-event simulation of a PD-disaggregated MoE cluster driven by a trace's real "
            "expert routing: prefill workers, late decode binding through the Rust router, K decode "
            "workers with continuous batching, a roofline execution-time model."
        ),
    )
    p.add_argument("--trace", help="ELDR trace (.npz)")
    p.add_argument("--centroids", help="centroid file from `eldr fit` (needed by eldr)")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma list of random, round_robin, shortest_queue, power_of_two, eldr, eldr@TAU, oracle (default {DEFAULT_POLICIES})")
    p.add_argument("--tau", type=float, default=None, help="ELDR band width (default: the centroid file's)")
    p.add_argument("--eldr-load-factor", type=float, default=None, metavar="F",
                   help="ELDR with bounded loads: a worker is a candidate only below (1+F) x mean load + 1 "
                        "(default: off, the paper's rule; per policy: eldr/F)")
    p.add_argument("--model", help="model profile (default: from the trace's meta_json.model)")
    p.add_argument("--hardware", default="h200", help="hardware profile (default h200)")
    p.add_argument("--tp", type=int, default=0, help="GPUs per worker (default: fewest that hold the weights)")
    p.add_argument("--workers", type=int, default=0, help="decode workers K (default: the centroid file's, else 8)")
    p.add_argument("--prefill-workers", type=int, default=0, help="prefill workers (default: K)")
    p.add_argument("--max-running", type=int, default=256, help="max running requests per decode worker")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="closed loop: concurrent clients (a comma list sweeps load)")
    load.add_argument("--rate", help="open loop: requests/s (a comma list sweeps load)")
    p.add_argument("--arrival", choices=["poisson", "bursty", "trace"], default=None,
                   help="open-loop arrival process (default poisson with --rate; trace = the trace's arrival_s)")
    p.add_argument("--requests", type=int, default=0, help="simulated requests (default: every trace request once; more wrap around)")
    p.add_argument("--output-len", type=int, default=0, help="output tokens per request (default: as recorded)")
    p.add_argument("--order", choices=["trace", "shuffle"], default="trace", help="request order (default: the trace's)")
    p.add_argument("--offload-experts", type=int, default=0, metavar="C",
                   help="expert-offload mode: GPU cache of C experts per MoE layer (LRU), misses over PCIe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary JSON here")
    p.add_argument("--plot", help="write a PNG here (TPOT vs load when sweeping)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--list-profiles", action="store_true", help="list model and hardware profiles and exit")
    p.set_defaults(func=run)


def _loads(text: str | None, kind) -> list:
    if text is None:
        return []
    try:
        vals = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad load list {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"load values must be positive, got {text!r}")
    return vals


def list_profiles() -> str:
    from eldr_sglang.sim.profiles import HARDWARE_PROFILES, MODEL_PROFILES

    lines = ["models:"]
    for m in MODEL_PROFILES.values():
        lines.append(
            f"  {m.name:18s} {m.hf_id:32s} {m.num_moe_layers} MoE layers x {m.num_experts} experts, top-{m.top_k}, "
            f"expert {m.expert_bytes() / 1e6:.1f} MB, KV {m.kv_bytes_per_token() / 1e3:.1f} kB/token, "
            f"{m.total_params() / 1e9:.1f}B params"
        )
    lines.append("hardware:")
    for h in HARDWARE_PROFILES.values():
        lines.append(
            f"  {h.name:8s} {h.hbm_bytes / 1e9:.0f} GB HBM at {h.hbm_bw / 1e12:.2f} TB/s, "
            f"BF16 {h.bf16_flops / 1e12:.0f} / FP8 {h.fp8_flops / 1e12:.0f} TFLOP/s dense, host link {h.host_link_bw / 1e9:.0f} GB/s"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.list_profiles:
        print(list_profiles())
        return 0
    if not args.trace:
        raise ValueError("--trace is required (or --list-profiles)")

    from eldr_sglang.sim.cluster import ClusterConfig
    from eldr_sglang.sim.cost_model import ExecutionModel
    from eldr_sglang.sim.profiles import get_hardware, get_model
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.sim.report import format_table, format_workers, json_summary, plot_runs, plot_sweep, write_json
    from eldr_sglang.sim.runner import paper_check, parse_policies, run_comparison
    from eldr_sglang.sim.workload import make_workload
    from eldr_sglang.traces import load_trace

    from eldr_sglang.io_safe import check_outputs

    # before any work: neither output may replace a non-regular file, an input, or the other
    check_outputs([("--json", args.json), ("--plot", args.plot)], inputs=[("--trace", args.trace), ("--centroids", args.centroids)])
    specs = parse_policies(args.policies, args.tau, args.eldr_load_factor)
    trace = load_trace(args.trace)
    model = get_model(args.model or trace.model)
    hw = get_hardware(args.hardware)
    em = ExecutionModel(model, hw, tp=args.tp, offload_cache_experts=args.offload_experts)
    K = args.workers
    if args.centroids:
        from eldr_sglang._core import CentroidSet

        cs = CentroidSet.open(args.centroids)
        if K and K != cs.num_workers:
            raise ValueError(f"--workers {K} but the centroid file has {cs.num_workers} workers")
        K = cs.num_workers
    K = K or 8
    if any(s.policy == "eldr" for s in specs) and not args.centroids:
        raise ValueError("policy eldr needs --centroids (make one with `eldr fit`)")
    cfg = ClusterConfig(num_decode=K, num_prefill=args.prefill_workers, max_running=args.max_running)
    replay = TraceReplay(trace)

    conc = _loads(args.concurrency, int)
    rates = _loads(args.rate, float)
    if conc:
        points = [("closed", c) for c in conc]
    elif rates:
        points = [(args.arrival or "poisson", r) for r in rates]
    elif args.arrival == "trace" or trace.arrival_s is not None:
        points = [("trace", None)]
    else:
        points = [("closed", 16 * K)]
        print(f"no load given: closed loop at concurrency {16 * K}", file=sys.stderr)

    print(f"model {model.name} on {K} decode workers x tp={em.tp} {hw.name}; trace {args.trace}: "
          f"{trace.num_requests} requests, {trace.num_layers} MoE layers x {trace.num_experts} experts, top-{trace.top_k}")
    print(paper_check(em))
    sweep: dict[str, list] = {s.label: [] for s in specs}
    runs = []
    last_distinct = {}
    last_policies = {}
    for arrival, value in points:
        wl = make_workload(
            replay, requests=args.requests or None, order=args.order, output_len=args.output_len or None,
            arrival=arrival, concurrency=value if arrival == "closed" else None,
            rate=value if arrival in ("poisson", "bursty") else (value if arrival == "trace" else None), seed=args.seed,
        )
        if wl.cycled:
            print("note: requests generate more tokens than recorded; their decode routing is replayed cyclically", file=sys.stderr)
        pol, res = run_comparison(
            replay, wl, specs, em, cfg, centroids=args.centroids, seed=args.seed,
            progress=not args.no_progress and sys.stderr.isatty(), keep_results=True,
        )
        load_txt = f"concurrency {value}" if arrival == "closed" else (f"{arrival} {value} req/s" if value else "trace arrivals")
        print()
        print(format_table(pol, title=f"[{load_txt}] {wl.num_requests} requests, {wl.total_output_tokens()} output tokens"))
        print(format_workers(pol))
        for name, m in pol.items():
            sweep[name].append((value if value is not None else 0, m))
        runs.append({"load": {"arrival": arrival, "value": value}, "workload": wl.describe(), "policies": pol})
        last_distinct = {n: r.step_distinct for n, r in res.items()}
        last_policies = pol
    meta = {
        "trace": str(args.trace), "model": em.describe(), "workers": K, "centroids": args.centroids,
        "paper_check": paper_check(em), "seed": args.seed,
    }
    if args.json:
        obj = json_summary(last_policies, meta)
        if len(runs) > 1:
            obj["sweep"] = runs
        write_json(obj, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        if len(points) > 1:
            xl = "concurrency (clients)" if conc else "request rate (req/s)"
            plot_sweep(sweep, args.plot, xlabel=xl, title=f"{model.name}, K={K}")
        else:
            plot_runs(last_policies, last_distinct, args.plot, title=f"{model.name}, K={K}")
        print(f"wrote {args.plot}")
    return 0
