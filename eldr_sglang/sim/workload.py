"""Workload: which trace request each simulated request replays, how long it generates,
and when it arrives (open loop) or how many clients keep requests in flight (closed loop).

Arrival processes:
- "trace":   the trace's `arrival_s` (optionally time-scaled to a target rate);
- "poisson": exponential inter-arrival gaps at `rate` requests/s;
- "bursty":  gamma inter-arrival gaps at `rate` with coefficient of variation `cv` > 1;
- "closed":  `concurrency` clients; each sends its next request when the previous ends.

Request order follows the trace (domain bursts in the trace stay bursts) unless
`order="shuffle"`. Labels are never read here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ARRIVALS = ("closed", "poisson", "bursty", "trace")


@dataclass
class Workload:
    trace_idx: np.ndarray  # [N] trace request replayed by simulated request i
    prompt_len: np.ndarray  # [N]
    output_len: np.ndarray  # [N] output tokens (first from prefill, rest from decode steps)
    arrival_s: np.ndarray | None  # [N] open loop; None for closed loop
    concurrency: int = 0  # closed loop: clients
    arrival: str = "closed"
    cycled: bool = False  # some requests generate more tokens than were recorded

    @property
    def num_requests(self) -> int:
        return int(self.trace_idx.shape[0])

    def total_output_tokens(self) -> int:
        return int(self.output_len.sum())

    def describe(self) -> dict:
        d = {
            "requests": self.num_requests,
            "arrival": self.arrival,
            "output_tokens": self.total_output_tokens(),
            "mean_prompt_len": float(self.prompt_len.mean()),
            "mean_output_len": float(self.output_len.mean()),
            "decode_rows_replayed_cyclically": self.cycled,
        }
        if self.arrival == "closed":
            d["concurrency"] = self.concurrency
        elif self.arrival_s is not None and self.num_requests > 1:
            span = float(self.arrival_s[-1] - self.arrival_s[0])
            d["offered_rate_req_s"] = (self.num_requests - 1) / span if span > 0 else float("inf")
        return d


def make_workload(
    replay,
    *,
    requests: np.ndarray | int | None = None,
    order: str = "trace",
    output_len: int | None = None,
    arrival: str = "closed",
    concurrency: int | None = None,
    rate: float | None = None,
    cv: float = 3.0,
    seed: int = 0,
    context_len: int | None = None,
) -> Workload:
    """Build a workload over a TraceReplay.

    `requests`: trace request indices to replay (array), a count N (the trace's requests in
    order, wrapping around when N exceeds the trace), or None for every request once.
    `output_len`: fixed output tokens per request; None uses each request's recorded length.
    `context_len`: simulated prompt tokens per request (KV cache, attention reads, prefill and
    KV transfer time); None uses the recorded prompt length. The routing signature is always
    computed from the recorded prompt rows, so this sets only the attention load (the shared
    traces' prompts are short: median 36-75 tokens).
    """
    rng = np.random.default_rng(seed)
    R = replay.num_requests
    if requests is None:
        idx = np.arange(R, dtype=np.int64)
    elif np.isscalar(requests):
        n = int(requests)
        if n <= 0:
            raise ValueError(f"requests must be positive, got {n}")
        idx = np.arange(n, dtype=np.int64) % R
    else:
        idx = np.asarray(requests, dtype=np.int64)
        if idx.size == 0:
            raise ValueError("the workload holds no requests")
        if idx.min() < 0 or idx.max() >= R:
            raise ValueError(f"request indices must lie in 0..{R - 1}")
    if order == "shuffle":
        idx = idx[rng.permutation(len(idx))]
    elif order != "trace":
        raise ValueError(f"order must be 'trace' or 'shuffle', got {order!r}")
    n = len(idx)
    if output_len is None:
        out = replay.recorded_output_len[idx].astype(np.int64)
    else:
        if output_len < 1:
            raise ValueError(f"output length must be at least 1, got {output_len}")
        out = np.full(n, int(output_len), dtype=np.int64)
    cycled = bool(np.any(out - 1 > replay.dec_len[idx]))
    prompt = replay.prompt_len[idx].astype(np.int64)
    if context_len is not None:
        if context_len < 1:
            raise ValueError(f"context length must be at least 1, got {context_len}")
        prompt = np.full(n, int(context_len), dtype=np.int64)

    if arrival == "closed":
        if not concurrency or concurrency < 1:
            raise ValueError("closed-loop arrival needs --concurrency >= 1")
        return Workload(idx, prompt, out, None, int(concurrency), "closed", cycled)
    if arrival in ("poisson", "bursty"):
        if not rate or rate <= 0:
            raise ValueError(f"{arrival} arrival needs a positive --rate (requests/s)")
        if arrival == "poisson":
            gaps = rng.exponential(1.0 / rate, size=n)
        else:
            if cv <= 1:
                raise ValueError(f"bursty arrival needs cv > 1, got {cv}")
            shape = 1.0 / (cv * cv)
            gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
        t = np.cumsum(gaps) - gaps[0]
        return Workload(idx, prompt, out, t, 0, arrival, cycled)
    if arrival == "trace":
        a = replay.trace.arrival_s
        if a is None:
            raise ValueError("the trace has no arrival_s; use --rate or --concurrency")
        t = np.asarray(a, dtype=np.float64)[idx]
        if np.any(np.diff(t) < 0):
            order_t = np.argsort(t, kind="stable")
            idx, prompt, out, t = idx[order_t], prompt[order_t], out[order_t], t[order_t]
        t = t - t[0]
        if rate:
            span = t[-1] if n > 1 else 0.0
            if span > 0:
                t = t * ((n - 1) / span) / rate
        return Workload(idx, prompt, out, t, 0, "trace", cycled)
    raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
