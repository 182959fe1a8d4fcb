"""`eldr simulate`: simulate a PD cluster's decode TPOT under several routing policies."""

from __future__ import annotations

import argparse
import sys

from eldr_sglang.cli import args as A
from eldr_sglang.sim.policies import BASELINES
from eldr_sglang.sim.prefill import DEFAULT_PREFILL_POLICY, PREFILL_POLICIES

DEFAULT_POLICIES = "random,round_robin,shortest_queue,power_of_two,eldr,default"
COST_MODELS = ("default", "paper-fixed", "paper-fixed+overhead", "band")


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
    p.add_argument("--trace", help="ELDR trace (.npz), v1 or v2 (v2: the requests that kept decode routing replay)")
    p.add_argument("--centroids", help="centroid file from `eldr fit` (needed by eldr)")
    p.add_argument("--policies", type=A.policies, default=None,
                   help=f"comma list of {', '.join(BASELINES)}, eldr, eldr@TAU, eldr/F, locality/F, "
                        "locality/F:rc=R (R: the locality cost's per-request term, distinct experts per layer; "
                        f"without :rc, the router's default {_core_default_rc()}), "
                        "oracle, default (the router's default), and the bounds perfect_overlap and clairvoyant[/F] "
                        f"(default {DEFAULT_POLICIES}; under --protocol strict the protocol's set)")
    p.add_argument("--protocol", choices=["none", "strict"], default="none",
                   help="strict: the study protocol that cannot flatter (>= 2000 held-out requests, warm-up dropped, "
                        "--splits fit/eval splits fitted here, shuffled and trace order, closed and open loop, fixed and "
                        "recorded outputs, both bounds; see docs/simulator.md); refuses --centroids")
    p.add_argument("--splits", type=A.integer(1, 64), default=2, help="--protocol strict: fit/eval splits (default 2)")
    p.add_argument("--cost-model", choices=COST_MODELS, default="default",
                   help="execution-model variant: default roofline, paper-fixed (+ the per-MoE-layer fixed cost that "
                        "reproduces the paper's 4.7x), paper-fixed+overhead (+ a 2 ms step overhead), band (all three)")
    p.add_argument("--ep", type=A.integer(1, 4096), default=1, help="expert-parallel ranks per decode worker (default 1: experts sharded over TP)")
    p.add_argument("--calibration", help="calibration file from benchmarks/gpu_calibrate.py: replaces the roofline expert time; "
                                         "one with other_s (--device cpu) replaces the whole decode step; one written by "
                                         "benchmarks/sim_vs_engine.py also makes the decode workers share the host CPU "
                                         "as its engine's did (sim/host.py)")
    p.add_argument("--context-len", type=A.integer(0, A.MAX_TOKENS), default=0, help="simulated prompt tokens per request (default: as recorded)")
    p.add_argument("--tau", type=A.tau, default=None, help="ELDR band width (default: the centroid file's)")
    p.add_argument("--eldr-load-factor", type=A.load_factor, default=None, metavar="F",
                   help="ELDR with bounded loads: a worker is a candidate only below (1+F) x mean load + 1 "
                        "(default: off, the paper's rule; per policy: eldr/F)")
    p.add_argument("--model", help="model profile (default: from the trace's meta_json.model)")
    p.add_argument("--hardware", default="h200", help="hardware profile (default h200; cpu: a calibrated CPU, needs a "
                                                     "--calibration from gpu_calibrate.py --device cpu)")
    p.add_argument("--tp", type=A.integer(0, 1024), default=0, help="GPUs per worker (default: fewest that hold the weights)")
    p.add_argument("--workers", type=A.integer(0, A.MAX_WORKERS), default=0, help="decode workers K (default: the centroid file's, else 8)")
    p.add_argument("--prefill-workers", type=A.integer(0, A.MAX_WORKERS), default=0, help="prefill workers (default: K)")
    p.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default=DEFAULT_PREFILL_POLICY,
                   help="prefill placement (default round_robin, as the router service's --prefill-policy; "
                        "earliest_free: the worker that frees up first, the simulator's rule before)")
    p.add_argument("--max-running", type=A.integer(1, 1_000_000), default=256, help="max running requests per decode worker")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=A.listed(A.integer(1, 10_000_000)), help="closed loop: concurrent clients (a comma list sweeps load)")
    load.add_argument("--rate", type=A.listed(A.real(0.0, 1e9, lo_open=True)), help="open loop: requests/s (a comma list sweeps load)")
    p.add_argument("--arrival", choices=["poisson", "bursty", "trace"], default=None,
                   help="open-loop arrival process (default poisson with --rate; trace = the trace's arrival_s)")
    p.add_argument("--requests", type=A.integer(0, A.MAX_REQUESTS), default=0, help="simulated requests (default: every trace request once; more wrap around)")
    p.add_argument("--output-len", type=A.integer(0, A.MAX_TOKENS), default=0, help="output tokens per request (default: as recorded)")
    p.add_argument("--order", choices=["trace", "shuffle"], default="trace", help="request order (default: the trace's)")
    p.add_argument("--offload-experts", type=A.integer(0, A.MAX_EXPERTS), default=0, metavar="C",
                   help="model SGLang's paged experts (--enable-paged-experts --paged-experts-num-resident C): "
                        "each decode worker is one GPU keeping C experts per MoE layer resident (LRU, waves when a "
                        "step touches more than C), the rest paged in from host memory over PCIe; reports hit rate, "
                        "page-ins per step and reuse per worker (docs/simulator.md)")
    p.add_argument("--seed", type=A.seed, default=0)
    p.add_argument("--json", help="write the summary JSON here")
    p.add_argument("--plot", help="write a PNG here (TPOT vs load when sweeping)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--list-profiles", action="store_true", help="list model and hardware profiles and exit")
    A.add_max_memory(p)
    p.set_defaults(func=run)


def list_profiles() -> str:
    from eldr_sglang.models import MODEL_PROFILES
    from eldr_sglang.sim.profiles import HARDWARE_PROFILES

    lines = ["models:"]
    for m in MODEL_PROFILES.values():
        lines.append(
            f"  {m.name:18s} {m.hf_id:32s} {m.num_moe_layers} MoE layers x {m.num_experts} experts, top-{m.top_k}, "
            f"expert {m.expert_bytes() / 1e6:.1f} MB, KV {m.kv_bytes_per_token() / 1e3:.1f} kB/token, "
            f"{m.total_params() / 1e9:.1f}B params"
        )
    lines.append("hardware:")
    for h in HARDWARE_PROFILES.values():
        if h.calibrated_only:
            lines.append(f"  {h.name:8s} {h.source}")
            continue
        lines.append(
            f"  {h.name:8s} {h.hbm_bytes / 1e9:.0f} GB HBM at {h.hbm_bw / 1e12:.2f} TB/s, "
            f"BF16 {h.bf16_flops / 1e12:.0f} / FP8 {h.fp8_flops / 1e12:.0f} TFLOP/s dense, host link {h.host_link_bw / 1e9:.0f} GB/s"
        )
    return "\n".join(lines)


def _check_memory(args) -> None:
    from eldr_sglang import memory

    shape = memory.trace_shape(args.trace)
    if shape is None:
        return  # unreadable: load_trace says why
    dim = 0
    if args.centroids:
        from eldr_sglang._core import CentroidSet

        dim = CentroidSet.open(args.centroids).dim
    n = args.requests or shape.requests
    memory.require(memory.simulate_bytes(shape, dim, n), f"simulation of {n} requests", args.max_memory)


def run(args: argparse.Namespace) -> int:
    if args.list_profiles:
        print(list_profiles())
        return 0
    if not args.trace:
        raise ValueError("--trace is required (or --list-profiles)")

    from eldr_sglang.io_safe import check_outputs
    from eldr_sglang.traces import open_trace

    # before any work: neither output may replace a non-regular file, an input, or the other
    check_outputs([("--json", args.json), ("--plot", args.plot)], inputs=[("--trace", args.trace), ("--centroids", args.centroids)])
    if args.protocol == "strict" and args.centroids:
        raise ValueError("--protocol strict fits its own centroids on held-out splits; drop --centroids")
    _check_memory(args)
    with open_trace(args.trace) as source:  # v1 in memory, or v2: the requests that kept decode routing replay
        return _simulate(args, source)


def _simulate(args, source) -> int:
    from eldr_sglang.models import get_model
    from eldr_sglang.sim.cluster import ClusterConfig
    from eldr_sglang.sim.profiles import get_hardware
    from eldr_sglang.sim.replay import TraceReplay
    from eldr_sglang.sim.runner import paper_check, parse_policies

    replay = TraceReplay(source)
    trace = replay.trace
    if replay.is_counts:
        print(f"trace v2 {args.trace}: replaying the {replay.num_requests} of its {source.num_requests} requests that "
              f"kept decode routing (prompts from their counts)", file=sys.stderr)
    model = get_model(args.model or source.model)
    hw = get_hardware(args.hardware)
    models = _models(args, model, hw)
    if args.protocol == "strict":
        return run_strict(args, replay, models)
    if len(models) > 1:
        raise ValueError("--cost-model band needs --protocol strict")
    em = next(iter(models.values()))
    specs = parse_policies(args.policies or DEFAULT_POLICIES, args.tau, args.eldr_load_factor)
    K = _decode_workers(args)
    if any(s.policy == "eldr" for s in specs) and not args.centroids:
        raise ValueError("policy eldr needs --centroids (make one with `eldr fit`)")
    cfg = ClusterConfig(num_decode=K, num_prefill=args.prefill_workers, max_running=args.max_running,
                        prefill_policy=args.prefill_policy, host=_shared_host(args), host_seed=args.seed)
    points = _load_points(args, trace, K)
    print(f"model {model.name} on {K} decode workers x tp={em.tp} {hw.name}; trace {args.trace}: "
          f"{trace.num_requests} requests, {trace.num_layers} MoE layers x {trace.num_experts} experts, top-{trace.top_k}")
    print(paper_check(em))
    sweep, runs, last_policies, last_distinct = _sweep(args, replay, points, specs, em, cfg)
    meta = {
        "trace": str(args.trace), "model": em.describe(), "workers": K, "centroids": args.centroids,
        "paper_check": paper_check(em), "seed": args.seed,
    }
    _write_outputs(args, meta, sweep, runs, last_policies, last_distinct, title=f"{model.name}, K={K}")
    return 0


def _decode_workers(args) -> int:
    """K: --workers, which must agree with the centroid file's worker count; else that count, else 8."""
    K = args.workers
    if args.centroids:
        from eldr_sglang._core import CentroidSet

        cs = CentroidSet.open(args.centroids)
        if K and K != cs.num_workers:
            raise ValueError(f"--workers {K} but the centroid file has {cs.num_workers} workers")
        K = cs.num_workers
    return K or 8


def _load_points(args, trace, K: int) -> list[tuple[str, float | None]]:
    """The (arrival, concurrency or rate) points to run: the given sweep, else trace arrivals,
    else a closed loop at 16 clients per worker."""
    conc = list(args.concurrency or [])  # parsed and checked by argparse
    rates = list(args.rate or [])
    if conc:
        return [("closed", c) for c in conc]
    if rates:
        return [(args.arrival or "poisson", r) for r in rates]
    if args.arrival == "trace" or trace.arrival_s is not None:
        return [("trace", None)]
    print(f"no load given: closed loop at concurrency {16 * K}", file=sys.stderr)
    return [("closed", 16 * K)]


def _sweep(args, replay, points, specs, em, cfg):
    """Every policy at every load point, each table printed as it is done; returns (per-policy
    sweep, per-point runs, the last point's policy metrics and per-step distinct experts)."""
    from eldr_sglang.sim.report import format_table, format_workers
    from eldr_sglang.sim.runner import run_comparison
    from eldr_sglang.workload import replay_workload

    sweep: dict[str, list] = {s.label: [] for s in specs}
    runs = []
    last_distinct: dict = {}
    last_policies: dict = {}
    for arrival, value in points:
        wl = replay_workload(
            replay, requests=args.requests or None, order=args.order, output_len=args.output_len or None,
            arrival=arrival, concurrency=value if arrival == "closed" else None,
            rate=value if arrival in ("poisson", "bursty") else (value if arrival == "trace" else None), seed=args.seed,
            context_len=args.context_len or None,
        )
        if wl.cycled:
            print("note: requests generate more tokens than recorded; their decode routing is replayed cyclically", file=sys.stderr)
        pol, res = run_comparison(
            replay, wl, specs, em, cfg, centroids=args.centroids, seed=args.seed,
            progress=not args.no_progress, keep_results=True,  # plain lines when piped
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
    return sweep, runs, last_policies, last_distinct


def _write_outputs(args, meta, sweep, runs, last_policies, last_distinct, title: str) -> None:
    """--json (the last point's summary, plus the sweep when there are several) and --plot."""
    from eldr_sglang.sim.report import json_summary, plot_runs, plot_sweep, write_json

    if args.json:
        obj = json_summary(last_policies, meta)
        if len(runs) > 1:
            obj["sweep"] = runs
        write_json(obj, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        if len(runs) > 1:
            xl = "concurrency (clients)" if args.concurrency else "request rate (req/s)"
            plot_sweep(sweep, args.plot, xlabel=xl, title=title)
        else:
            plot_runs(last_policies, last_distinct, args.plot, title=title)
        print(f"wrote {args.plot}")


def _core_default_rc() -> str:
    from eldr_sglang._core import DEFAULT_REQUEST_COST

    return f"{DEFAULT_REQUEST_COST:g}"


def _shared_host(args):
    """The calibration's shared host CPU (sim/host.py), if it has one."""
    from eldr_sglang.sim.host import load_shared_host

    return load_shared_host(args.calibration) if args.calibration else None


def _models(args, model, hw) -> dict:
    """{variant: ExecutionModel} for --cost-model (one, or the three of the band)."""
    from eldr_sglang.sim.cost_model import SENSITIVITY_VARIANTS, load_calibration, sensitivity_model

    kw = dict(tp=args.tp, offload_cache_experts=args.offload_experts, ep=args.ep)
    if args.calibration:
        kw["calibration"] = load_calibration(args.calibration, model.name, args.hardware, profile=model)
    names = SENSITIVITY_VARIANTS if args.cost_model == "band" else (args.cost_model,)
    return {v: sensitivity_model(v, model, hw, **kw) for v in names}


def run_strict(args, replay, models: dict) -> int:
    """--protocol strict: fit on each split's fit half here, evaluate on its held-out half."""
    from eldr_sglang.sim.protocol import (
        BOUND_LABELS, STRICT_MIN_REQUESTS, STRICT_POLICIES, random_splits, run_protocol, strict_cells, summarize, versus_best,
    )
    from eldr_sglang.sim.report import LOAD_BALANCERS, write_json
    from eldr_sglang.sim.runner import paper_check, parse_policies

    if args.rate or args.arrival or args.order != "trace" or args.output_len:
        raise ValueError("--protocol strict sets arrivals, order and output lengths itself; drop --rate/--arrival/--order/--output-len")
    if args.splits < 1:
        raise ValueError("--splits must be at least 1")
    if _shared_host(args) is not None:
        raise ValueError("--protocol strict does not model a shared host CPU; its --calibration must have no 'host' section")
    requests = args.requests or STRICT_MIN_REQUESTS
    if requests < STRICT_MIN_REQUESTS:
        raise ValueError(f"--protocol strict needs --requests >= {STRICT_MIN_REQUESTS}")
    K = args.workers or 8
    per_worker = [c / K for c in (args.concurrency or [])] or [8.0, 32.0]
    policies = args.policies or STRICT_POLICIES
    parse_policies(policies)  # fail early on a bad list
    em0 = next(iter(models.values()))
    print(f"strict protocol: {replay.num_requests} trace requests, K={K}, {args.splits} split(s), "
          f"cost model(s) {', '.join(models)}; {paper_check(em0)}")
    recs = run_protocol(replay, models, K, strict_cells(loads=per_worker), random_splits(replay.num_requests, args.splits, args.seed),
                        policies=policies, requests=requests, tau=args.tau if args.tau is not None else 0.1, seed=args.seed,
                        context_len=args.context_len or None,
                        log=None if args.no_progress else (lambda *a: print(*a, file=sys.stderr, flush=True)))
    labels = [lab for lab in recs[0]["policies"] if not lab.startswith("_") and lab not in LOAD_BALANCERS] if recs else []
    print("\nchange against the best load balancer of each run: median (min..max) over splits x cells")
    print("| policy | cost model | TPOT p50 | TPOT p99 | mean ITL | throughput | runs losing p50 / p99 |")
    print("|---|---|---|---|---|---|---|")

    def sp(s):
        return f"{s['median']:+.1f}% ({s['min']:+.1f}..{s['max']:+.1f})"

    for lab, byv in summarize(recs, labels).items():
        for v, s in byv.items():
            print(f"| {lab} | {v} | {sp(s['tpot_p50'])} | {sp(s['tpot_p99'])} | {sp(s['itl_mean'])} | {sp(s['throughput'])} | "
                  f"{s['loses_p50']} / {s['loses_p99']} of {s['runs']} |")
    print("\nper run (p50 / p99 vs best LB):")
    for r in recs:
        cells = "  ".join(f"{lab} {versus_best(r['policies'], lab)['tpot_p50']:+.1f}/{versus_best(r['policies'], lab)['tpot_p99']:+.1f}"
                          for lab in labels if lab not in BOUND_LABELS)
        print(f"  split {r['split']} {r['variant']:21s} {r['cell']:34s} {cells}")
    if args.json:
        write_json({"protocol": "strict", "workers": K, "trace": str(args.trace), "models": {v: m.describe() for v, m in models.items()},
                    "records": recs}, args.json)
        print(f"wrote {args.json}")
    return 0
