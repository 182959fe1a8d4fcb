"""The traces package: the old top-level module names still import, warn, and are the new modules."""

import importlib
import sys
import warnings

import pytest

MOVED = {
    "eldr_sglang.sglang_io": "eldr_sglang.traces.sglang_responses",
    "eldr_sglang.collect": "eldr_sglang.traces.collect",
    "eldr_sglang.synth": "eldr_sglang.traces.synth",
    "eldr_sglang.trace_stats": "eldr_sglang.traces.stats",
}


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_old_module_path_warns_and_aliases_the_new_module(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    assert mod is importlib.import_module(new)


def test_format_names_are_reexported_by_the_package():
    from eldr_sglang import traces
    from eldr_sglang.traces import format as fmt

    for name in ("Trace", "TraceError", "load_trace", "save_trace", "check_meta", "TRACE_VERSION"):
        assert getattr(traces, name) is getattr(fmt, name)
