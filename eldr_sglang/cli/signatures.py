"""The prefill signatures of a trace's requests under a centroid file's spec: the input of
`eldr refit` and `eldr drift-check`."""

from __future__ import annotations

import numpy as np


def request_range(text, n):
    """The trace request indices --requests a:b names (all of them for None)."""
    if text is None:
        return np.arange(n, dtype=np.int64)
    a, sep, b = str(text).partition(":")
    if not sep:
        raise ValueError(f"--requests must look like a:b, got {text!r}")
    try:
        lo = int(a) if a else 0
        hi = int(b) if b else n
    except ValueError:
        raise ValueError(f"--requests must look like a:b with integers, got {text!r}") from None
    if not (0 <= lo < hi <= n):
        raise ValueError(f"--requests {text} is outside the trace's 0:{n}")
    return np.arange(lo, hi, dtype=np.int64)


def trace_signatures(centroids: str, trace_path: str, requests):
    """(centroid set, signatures [R, D], valid [R], trace request indices) of the requests' prompts
    under the centroid file's own spec (layer weights and IDF)."""
    from eldr_sglang import _core
    from eldr_sglang.offline.sources import prefill_source
    from eldr_sglang.traces import open_trace

    cs = _core.CentroidSet.open(str(centroids))
    with open_trace(trace_path) as t:  # v1 in memory, or v2: its counts read chunk by chunk
        if t.num_layers != cs.num_layers or t.num_experts != cs.num_experts:
            raise ValueError(f"the trace has {t.num_layers} layers x {t.num_experts} experts, the centroid file "
                             f"{cs.num_layers} x {cs.num_experts}")
        req = request_range(requests, t.num_requests)
        # the fit's own path: signatures through the Rust normalizer, chunk by chunk
        S, valid = prefill_source(t).signatures(cs.spec(), req, progress=False, dense=True)
        return cs, S, valid, req
