"""The traces package re-exports its format names."""


def test_format_names_are_reexported_by_the_package():
    from eldr_sglang import traces
    from eldr_sglang.traces import format as fmt

    for name in ("Trace", "TraceError", "load_trace", "save_trace", "check_meta", "TRACE_VERSION"):
        assert getattr(traces, name) is getattr(fmt, name)
