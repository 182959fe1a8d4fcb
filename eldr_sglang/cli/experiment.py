"""`eldr experiment report`: a switchback run's block-level comparison of two arms.

    eldr experiment report (RUN.jsonl | --url http://ROUTER:PORT) [--arms A,B] [--warmup S]
                           [--json OUT] [--plot OUT.png]
        per-block TPOT p50 and mean per arm (each block's warm-up dropped), the change
        between the arms with a confidence interval from the block statistics, and the
        blocks per arm a run needs to detect a 2, 5 or 10 % change (eldr_sglang.experiment).
        --url reads a router running `--experiment` (GET /eldr/experiment); a saved copy of
        that JSON is read as RUN too.
"""

from __future__ import annotations

from eldr_sglang.cli import args as A


def register(subparsers) -> None:
    from eldr_sglang.experiment import FETCH_DEADLINE_S, FETCH_MAX_BYTES

    e = subparsers.add_parser("experiment", help="analyse a switchback experiment between decode policies",
                              description="Switchback experiments: the cluster alternates decode policies (arms) in time "
                                          "blocks; the blocks are compared.")
    sub = e.add_subparsers(dest="experiment_command", metavar="SUBCOMMAND", required=True)
    r = sub.add_parser("report", help="compare two arms' TPOT over the blocks of a run",
                       description="Per-block TPOT p50 and mean per arm, each block's warm-up dropped; the change "
                                   "between two arms as (arm 1 / arm 2) - 1 of the blocks' geometric means, with a "
                                   "Welch t confidence interval over blocks; and how many blocks per arm detect a given "
                                   "change. Input: a router running --experiment (--url), or a file: JSON Lines of "
                                   "requests ({block, arm, tpot_s, t_s, warmup}) or of blocks ({block, arm, tpot_p50_s, "
                                   "tpot_mean_s, n}), or a JSON object with a 'requests' or 'blocks' list (a saved GET "
                                   "/eldr/experiment). Blocks still running are left out.")
    r.add_argument("run", nargs="?", default=None, help="the run's records (JSON Lines or JSON)")
    r.add_argument("--url", default=None, metavar="URL",
                   help="read the blocks from a router running --experiment (its base URL; GET URL/eldr/experiment; the "
                        f"whole answer within {FETCH_DEADLINE_S:g} s and at most {FETCH_MAX_BYTES >> 20} MiB)")
    r.add_argument("--arms", type=A.listed(lambda t: t.strip()), default=None, metavar="A,B",
                   help="the two arms to compare, arm 1 first (default: the run's two arms, in order of appearance)")
    r.add_argument("--warmup", type=A.real(0.0, 86400.0), default=0.0, metavar="S",
                   help="drop requests that started within S seconds of their block's start (default 0: only those "
                        "flagged warmup)")
    r.add_argument("--min-requests", type=A.integer(1, A.MAX_REQUESTS), default=5, metavar="N",
                   help="leave out blocks with fewer than N requests after the warm-up (default 5)")
    r.add_argument("--confidence", type=A.real(0.5, 1.0, hi_open=True), default=0.95, help="confidence level (default 0.95)")
    r.add_argument("--json", dest="json_out", metavar="OUT", help="write the result as JSON here")
    r.add_argument("--plot", metavar="OUT.png", help="write a plot of the block statistics here (needs matplotlib)")
    r.set_defaults(func=run_report)


def run_report(args) -> int:
    from eldr_sglang import experiment as X
    from eldr_sglang.io_safe import check_outputs, write_json

    if (args.run is None) == (args.url is None):
        raise ValueError("give the run's records (a file) or --url of the router running the experiment, not both")
    check_outputs([("--json", args.json_out), ("--plot", args.plot)], inputs=[("run", args.run)] if args.run else [])
    arms = None
    if args.arms is not None:
        if len(args.arms) != 2 or args.arms[0] == args.arms[1]:
            raise ValueError(f"--arms takes two different arms, got {','.join(args.arms)}")
        arms = (args.arms[0], args.arms[1])
    kind, records = X.load_records(args.run) if args.run else X.fetch_records(args.url)
    X.check_tpot(kind, records)
    if kind == "requests":
        blocks, short = X.blocks_from_requests(records, args.warmup, args.min_requests)
    else:
        blocks, short = X.blocks_from_records(records, args.min_requests)
    res = X.report(blocks, arms, args.confidence)
    res["blocks_left_out"] = short
    a, b = res["arms"]
    print(f"switchback: {a} (arm 1) vs {b} (arm 2), {res['blocks']} blocks "
          f"({res['p50']['blocks'][0]} + {res['p50']['blocks'][1]}); "
          f"{sum(k.dropped for k in blocks)} warm-up requests dropped"
          + (f"; {len(short)} blocks left out (still running, or fewer than {args.min_requests} requests)" if short else ""))
    print(f"{'block':>5} {'arm':>16} {'n':>6} {'p50 ms':>9} {'mean ms':>9}")
    for k in blocks:
        print(f"{k.block:5d} {k.arm[-16:]:>16} {k.n:6d} {k.p50 * 1e3:9.3f} {k.mean * 1e3:9.3f}")
    for stat in X.STATS:
        r = res[stat]
        print(f"TPOT {stat:>4}: {a} vs {b} {r['diff']:+.2%}  ({r['confidence']:.0%} CI {r['ci_low']:+.2%} .. "
              f"{r['ci_high']:+.2%}; block geometric means {r['geo_mean_s'][0] * 1e3:.3f} vs {r['geo_mean_s'][1] * 1e3:.3f} ms)")
    need = res["blocks_needed"]
    print("blocks per arm to detect a change (5% level, 80% power, from this run's block variance): "
          + ", ".join(f"{float(e):.0%}: {v['p50']} (p50) / {v['mean']} (mean)" for e, v in need.items()))
    if args.json_out:
        write_json(res, args.json_out)
        print(f"wrote {args.json_out}")
    if args.plot:
        X.plot(blocks, res, args.plot)
        print(f"wrote {args.plot}")
    return 0
