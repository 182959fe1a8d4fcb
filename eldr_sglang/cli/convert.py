"""`eldr convert`: rewrite a trace v1 (every token's routing) as a trace v2 (prompt counts first)."""

from __future__ import annotations

from eldr_sglang.cli import args as A


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert a trace v1 to v2",
        description="Convert an ELDR trace v1 (.npz of every token's top-k) into a trace v2: each request's "
                    "prompt counts, and the decode routing of --keep-decode requests. See docs/traces.md.",
    )
    p.add_argument("trace", help="input trace v1 (.npz)")
    p.add_argument("--out", required=True, help="output trace v2 (.npz), written atomically")
    p.add_argument("--keep-decode", type=lambda t: None if t.strip().lower() == "all" else A.integer(0, A.MAX_REQUESTS)(t),
                   default=None, metavar="N|all", help="keep the decode routing of the first N requests (default: all)")
    p.add_argument("--chunk-requests", type=A.integer(1, 1 << 20), default=4096, metavar="N",
                   help="requests per chunk of the output (default 4096)")
    p.set_defaults(func=run)


def run(args) -> int:
    from eldr_sglang.io_safe import check_output
    from eldr_sglang.traces import load_trace
    from eldr_sglang.traces.counts_file import open_counts_trace, write_v1_as_counts

    check_output(args.out, what="--out", inputs=[("the input trace", args.trace)], create_parent=True)
    trace = load_trace(args.trace)  # TraceError names what is wrong (and says so for a v2 input)
    write_v1_as_counts(trace, args.out, keep_decode=args.keep_decode, chunk_requests=args.chunk_requests,
                       inputs=[("the input trace", args.trace)])
    with open_counts_trace(args.out) as t:
        print(f"wrote {args.out} (trace v2): {t.num_requests} requests, decode routing of "
              f"{t.meta['decode_requests']}, {t.num_layers}x{t.num_experts} top-{t.top_k}")
    return 0
