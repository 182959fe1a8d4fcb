"""Routing traces: the file format, the SGLang importers, collection, synthesis, statistics.

- `format`: the ELDR trace format v1 (`.npz` of per-token top-k ids), `Trace`, load/save.
- `counts_file`: the trace format v2 (per-request prefill counts first, decode routing
  optional), streamed to and from disk in chunks, and `open_trace` for either version.
- `source`: `TraceSource`, what a trace of either version offers its readers.
- `sglang_responses`: SGLang responses (`routed_experts`) -> traces.
- `collect`: `eldr collect`, a prompt dataset sent to a running SGLang server.
- `synth`: synthetic, domain-skewed traces for named model shapes.
- `stats`: routing statistics of a trace (entropy, hit rates, mutual information).

The format's names are re-exported here: `from eldr_sglang.traces import Trace, load_trace`.
"""

from .format import (  # noqa: F401
    MAX_EXPERTS,
    MAX_LAYERS,
    TRACE_FORMAT,
    TRACE_VERSION,
    Trace,
    TraceError,
    check_meta,
    load_trace,
    save_trace,
    trace_meta,
)
from .counts_file import open_trace  # noqa: F401
from .source import TraceSource  # noqa: F401
