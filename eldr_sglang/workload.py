"""Workloads: per simulated request, which prompt it sends, how many tokens it generates and
when it arrives (open loop) or how many clients keep requests in flight (closed loop), plus
the one arrival generator both the simulator and the synthetic traces use.

- `replay_workload(replay, ...)`: replays a trace's requests in the simulator;
- `synthetic_workload(requests, domains, rng, ...)`: domains, lengths and arrivals of a
  synthetic trace (`eldr_sglang.traces.synth` then draws the expert ids).

Arrival processes (`arrival_times`):
- "poisson": exponential inter-arrival gaps at `rate` requests/s (a per-request rate for
  the traffic bursts of a synthetic trace);
- "bursty":  gamma inter-arrival gaps at `rate` with coefficient of variation `cv` > 1;
and in `replay_workload` also
- "trace":   the trace's `arrival_s` (optionally time-scaled to a target rate);
- "closed":  `concurrency` clients; each sends its next request when the previous ends.

Request order follows the trace (domain bursts in the trace stay bursts) unless
`order="shuffle"`. Labels are never read by the simulator's workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

ARRIVALS = ("closed", "poisson", "bursty", "trace")


@dataclass
class Workload:
    trace_idx: np.ndarray  # [N] trace request replayed by simulated request i (synthetic: i itself)
    prompt_len: np.ndarray  # [N]
    output_len: np.ndarray  # [N] output tokens (first from prefill, rest from decode steps)
    arrival_s: np.ndarray | None  # [N] open loop; None for closed loop
    concurrency: int = 0  # closed loop: clients
    arrival: str = "closed"
    cycled: bool = False  # some requests generate more tokens than were recorded
    # synthetic traces only: each request's domain and regime, and the domains' popularity
    domain: np.ndarray | None = None  # int [N]
    regime: np.ndarray | None = None  # int [N]
    domain_weights: np.ndarray | None = None  # float [D]

    @property
    def num_requests(self) -> int:
        return int(self.trace_idx.shape[0])

    # a synthetic trace's names for the lengths: prompt rows and decode rows of the trace
    @property
    def prefill_len(self) -> np.ndarray:
        return self.prompt_len

    @property
    def decode_len(self) -> np.ndarray:
        return self.output_len

    @property
    def req_offsets(self) -> np.ndarray:
        """Token-row offsets of a trace holding prompt_len + output_len rows per request."""
        off = np.zeros(self.num_requests + 1, dtype=np.int64)
        np.cumsum(self.prompt_len + self.output_len, out=off[1:])
        return off

    def slice(self, a: int, b: int) -> "Workload":
        """Requests a..b-1 (the domain popularity is kept whole)."""
        cut = lambda x: None if x is None else x[a:b]  # noqa: E731
        return Workload(self.trace_idx[a:b] - a, self.prompt_len[a:b], self.output_len[a:b], cut(self.arrival_s),
                        self.concurrency, self.arrival, self.cycled, cut(self.domain), cut(self.regime),
                        self.domain_weights)

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


def arrival_times(process: str, n: int, rng: np.random.Generator, rate, cv: float = 3.0) -> np.ndarray:
    """[n] arrival times from 0: "poisson" (rate may be one number or one per request, the
    rate in force before each arrival) or "bursty" (gamma gaps with coefficient of variation cv)."""
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
    elif process == "bursty":
        if cv <= 1:
            raise ValueError(f"bursty arrival needs cv > 1, got {cv}")
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    else:
        raise ValueError(f"arrival process must be 'poisson' or 'bursty', got {process!r}")
    return np.cumsum(gaps) - gaps[0]


def replay_workload(
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
        return Workload(idx, prompt, out, arrival_times(arrival, n, rng, rate, cv), 0, arrival, cycled)
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


def _lengths(spec, n: int, rng: np.random.Generator, name: str, number_is_mean: bool, minimum: int) -> np.ndarray:
    if isinstance(spec, (int, np.integer, float, np.floating)) and not isinstance(spec, bool):
        m = float(spec)
        if not np.isfinite(m) or m < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {spec}")
        if not number_is_mean:
            return np.full(n, int(round(m)), dtype=np.int64)
        # gamma(shape 4) around the mean: spread like real prompt lengths, never below minimum
        x = np.rint(rng.gamma(4.0, m / 4.0, size=n)).astype(np.int64)
        return np.clip(x, minimum, max(minimum, int(8 * m)))
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ValueError(f"{name} range must be a (lo, hi) pair, got {spec!r}")
        lo, hi = int(spec[0]), int(spec[1])
        if lo < minimum or hi < lo:
            raise ValueError(f"{name} range must satisfy {minimum} <= lo <= hi, got ({lo}, {hi})")
        return rng.integers(lo, hi + 1, size=n, dtype=np.int64)
    arr = np.asarray(spec)
    if arr.ndim == 1 and arr.shape[0] == n and np.issubdtype(arr.dtype, np.integer):
        if arr.size and arr.min() < minimum:
            raise ValueError(f"{name} values must be >= {minimum}")
        return arr.astype(np.int64)
    raise ValueError(f"{name} must be a number, a (lo, hi) pair or {n} integers, got {spec!r}")


def synthetic_workload(
    requests: int,
    domains: int,
    rng: np.random.Generator,
    prompt_len=(128, 512),
    output_len=256,
    burstiness: float = 0.7,
    rate: float = 4.0,
    regime_len: float = 64.0,
    burst_prob: float = 0.3,
    burst_rate: float = 3.0,
    domain_weights: Sequence[float] | None = None,
) -> Workload:
    """Domains (a regime process over a Zipf popularity), lengths and Poisson arrivals with
    traffic bursts, for a synthetic trace of `requests` requests (see eldr_sglang.traces.synth)."""
    R, D = int(requests), int(domains)
    if R < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if D < 1:
        raise ValueError(f"domains must be >= 1, got {domains}")
    if not 0.0 <= burstiness <= 1.0:
        raise ValueError(f"burstiness must lie in [0, 1], got {burstiness}")
    if not (rate > 0 and np.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    if not regime_len >= 1:
        raise ValueError(f"regime_len must be >= 1, got {regime_len}")
    if not (0.0 <= burst_prob <= 1.0 and burst_rate > 0):
        raise ValueError("burst_prob must lie in [0, 1] and burst_rate must be > 0")
    if domain_weights is None:
        w = 1.0 / np.arange(1, D + 1)  # Zipf(1): a few popular domains, a long tail
    else:
        w = np.asarray(domain_weights, dtype=np.float64)
        if w.shape != (D,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"domain_weights must be {D} non-negative numbers with a positive sum")
    w = w / w.sum()
    # regime process over request index
    switch = rng.random(R) < 1.0 / regime_len
    switch[0] = True
    regime = np.cumsum(switch) - 1
    n_reg = int(regime[-1]) + 1
    dominant = rng.choice(D, size=n_reg, p=w)
    background = rng.choice(D, size=R, p=w)
    in_burst = rng.random(R) < burstiness
    domain = np.where(in_burst, dominant[regime], background)
    # arrivals: Poisson, regimes are traffic bursts with probability burst_prob
    is_burst = rng.random(n_reg) < burst_prob
    mult = np.where(is_burst, burst_rate, 1.0)[regime]
    base = rate * (burst_prob / burst_rate + (1.0 - burst_prob))  # mean rate == rate
    arrival = arrival_times("poisson", R, rng, base * mult)
    pre = _lengths(prompt_len, R, rng, "prompt_len", number_is_mean=True, minimum=1)
    dec = _lengths(output_len, R, rng, "output_len", number_is_mean=False, minimum=0)
    return Workload(np.arange(R, dtype=np.int64), pre, dec, arrival, arrival="poisson", domain=domain,
                    regime=regime, domain_weights=w)
