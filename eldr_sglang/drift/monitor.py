"""Drift detection from routed decisions.

The offline fit stores a baseline in the centroid file's provenance (`baseline`, computed by
`eldr_sglang.offline.report.baseline_stats` on the calibration signatures):
`mean_d_star`, `std_d_star`, `p50/p90/p99_d_star`, `nearest_share` (share of calibration
requests whose nearest centroid is k) and `mean_band_size`.

The monitor keeps tumbling windows of `window` routed requests that had a signature. Per
window it computes

- the mean assignment distance d* and its shift from the baseline in baseline standard
  deviations, `d_shift = (mean_w - mean_b) / std_b` (an effect size, not a z-test: with
  hundreds of requests per window a z-test flags differences far too small to matter),
  and the relative increase `d_rel = mean_w / mean_b - 1`;
- the nearest-centroid shares and their Jensen-Shannon divergence from the baseline shares
  (natural log, so 0 <= JS <= ln 2) and total variation distance.

A window is *out of profile* when `d_shift >= d_shift_threshold` (traffic lies farther from
every centroid than the calibration set did) or `js >= js_threshold` (traffic falls on the
centroids in other proportions than at calibration time). The monitor reports drift once
`patience` consecutive windows are out of profile; one bursty window (a domain burst) is not
drift.

Caveat worth knowing: the fit's baseline is measured on the very signatures the centroids
were fitted to, so it is optimistic -- unseen traffic from the same distribution has a
somewhat larger d* (+0.1 to +0.4 baseline s.d. on 600-1000-request synthetic fits). And
domain-skewed traffic comes in bursts, so the shares of one window swing even when nothing
drifts (JS up to ~0.05 per 512-request window, ~0.1 per 256-request window on the calibrated
synthetic traces, against ~0.15-0.25 after a real change of domain mix). The defaults
(window 512, 1.0 s.d., JS 0.1, patience 2) leave room for both; docs/drift.md has the
measured figures.

Cost per observation: O(1) for `observe(d_star, nearest)`, O(K) for `observe_decision` (the
argmin over the K distances); O(K) more at the end of each window.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from typing import Callable

import numpy as np


def js_divergence(p, q) -> float:
    """Jensen-Shannon divergence (natural log) of two distributions over the same support."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    p = p / p.sum() if p.sum() > 0 else p
    q = q / q.sum() if q.sum() > 0 else q
    m = 0.5 * (p + q)

    def kl(a, b):
        nz = a > 0
        return float(np.sum(a[nz] * np.log(a[nz] / b[nz])))

    return max(0.0, 0.5 * kl(p, m) + 0.5 * kl(q, m))


def baseline_from_provenance(provenance, num_workers: int | None = None) -> dict:
    """The drift baseline from a centroid file's provenance (JSON text or dict). Raises
    ValueError naming the field when the file carries no usable baseline: not an object, a
    null or non-numeric statistic, or (given `num_workers`) shares for another number of
    workers than the file's K -- such a baseline is rejected, never used as if it fit."""
    from eldr_sglang import json_fields as F

    provenance = F.as_object(provenance, "centroid file provenance")
    if provenance.get("baseline") is None:
        raise ValueError("the centroid file has no drift baseline (provenance.baseline); refit it with `eldr fit`")
    b = F.get_object(provenance, "baseline", "provenance")
    missing = [k for k in ("mean_d_star", "std_d_star", "nearest_share") if k not in b]
    if missing:
        raise ValueError(f"the centroid file's baseline lacks {', '.join(missing)}")
    mean = F.get_number(b, "mean_d_star", "provenance.baseline")
    std = F.get_number(b, "std_d_star", "provenance.baseline")
    raw = F.get_list(b, "nearest_share", "provenance.baseline")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in raw):
        raise ValueError("provenance.baseline.nearest_share must be a list of numbers")
    shares = np.asarray(raw, dtype=np.float64)
    if shares.ndim != 1 or shares.size < 1 or not np.all(np.isfinite(shares)) or np.any(shares < 0) or shares.sum() <= 0:
        raise ValueError("the centroid file's baseline nearest_share is not a distribution")
    if num_workers is not None and shares.size != num_workers:
        raise ValueError(f"provenance.baseline.nearest_share has {shares.size} entries for K={num_workers} workers")
    return {**b, "mean_d_star": mean, "std_d_star": std, "nearest_share": (shares / shares.sum()).tolist()}


class DriftMonitor:
    """Windowed d* and cluster-share statistics against the fit's baseline."""

    def __init__(
        self,
        baseline: dict | str,
        *,
        window: int = 512,
        d_shift_threshold: float = 1.0,
        js_threshold: float = 0.1,
        patience: int = 2,
        history: int = 64,
        min_std: float = 1e-3,
        generation: int | None = None,
        baseline_loader: Callable[[], dict | str] | None = None,
        on_window: Callable[[dict], None] | None = None,
        num_workers: int | None = None,
    ):
        if int(window) < 8:
            raise ValueError(f"window must be >= 8 routed requests, got {window}")
        if int(patience) < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if not (d_shift_threshold > 0 and js_threshold > 0):
            raise ValueError("drift thresholds must be > 0")
        self.window = int(window)
        self.d_shift_threshold = float(d_shift_threshold)
        self.js_threshold = float(js_threshold)
        self.patience = int(patience)
        self.min_std = float(min_std)
        self.baseline_loader = baseline_loader
        self.on_window = on_window  # called with each closed window's statistics (e.g. to log)
        self._lock = threading.Lock()
        self._history: deque = deque(maxlen=int(history))
        self.observations = 0
        self.no_signature = 0
        self.rebases = 0
        self.rebase_error: str | None = None
        self.windows_closed = 0  # over the monitor's life (history keeps only the latest)
        self.windows_out = 0
        self.mismatched = 0  # decisions whose distances do not have the baseline's K entries
        self.num_workers = num_workers
        self._set_baseline(self._parse(baseline), generation)

    @classmethod
    def from_centroid_set(cls, cs, **kw) -> "DriftMonitor":
        """Monitor against an opened `_core.CentroidSet`'s provenance baseline."""
        return cls(cs.provenance_json, num_workers=int(cs.num_workers), **kw)

    def _parse(self, baseline) -> dict:
        wrapped = {"baseline": baseline} if isinstance(baseline, dict) and "baseline" not in baseline else baseline
        return baseline_from_provenance(wrapped, self.num_workers)

    # ------------------------------------------------------------------ baseline
    def _set_baseline(self, baseline: dict, generation: int | None) -> None:
        self.baseline = baseline
        self.K = len(baseline["nearest_share"])
        self._base_share = np.asarray(baseline["nearest_share"], dtype=np.float64)
        self._base_mean = float(baseline["mean_d_star"])
        self._base_std = max(float(baseline["std_d_star"]), self.min_std)
        self.generation = generation
        self._reset_window()
        self._in_row = 0
        self._drift_since: int | None = None  # observation index where the first out-of-profile window began
        self._last: dict | None = None

    def _reset_window(self) -> None:
        self._n = 0
        self._sum = 0.0
        self._sumsq = 0.0
        self._counts = np.zeros(self.K, dtype=np.int64)
        self._win_start = self.observations

    def rebase(self, baseline: dict | str, generation: int | None = None) -> None:
        """Compare against a new baseline (after the router loaded refitted centroids)."""
        b = self._parse(baseline)
        with self._lock:
            self._set_baseline(b, generation)
            self.rebases += 1

    # ------------------------------------------------------------------ observing
    def observe_decision(self, decision) -> None:
        """Feed one `Router.route_*(..., explain=True)` Decision. Decisions without
        distances (no signature, baseline policies) only count as `no_signature`. A new
        centroid generation rebases on `baseline_loader()` when one is given."""
        gen = getattr(decision, "generation", None)
        if gen is not None and self.generation is not None and gen != self.generation and gen != 0:
            self._on_generation(int(gen))
        elif self.generation is None and gen:
            self.generation = int(gen)
        dist = getattr(decision, "distances", None)
        if dist is not None and not isinstance(dist, list):
            dist = [float(x) for x in dist]
        if not dist:
            with self._lock:
                self.no_signature += 1
            return
        # d* over *all* centroids: the Decision's own d_star is the minimum over the workers
        # that were eligible (healthy, and under the cap with bounded loads), which measures
        # the routing constraint, not how far the traffic is from the fitted profile.
        if len(dist) != self.K:
            # centroids of another K than the baseline: not comparable; counted, not used
            with self._lock:
                self.mismatched += 1
            return
        d_star = min(dist)
        self.observe(float(d_star), dist.index(d_star))

    def _on_generation(self, gen: int) -> None:
        if self.baseline_loader is None:
            with self._lock:
                self.generation = gen
            return
        try:
            self.rebase(self.baseline_loader(), gen)
            self.rebase_error = None
        except Exception as exc:  # keep monitoring against the old baseline, say why
            self.rebase_error = f"generation {gen}: {exc}"
            with self._lock:
                self.generation = gen

    def observe(self, d_star: float, nearest: int) -> None:
        """One routed request with a signature: its d* and its nearest centroid."""
        if not (0 <= nearest < self.K) or not math.isfinite(d_star):
            return
        with self._lock:
            self.observations += 1
            self._n += 1
            self._sum += d_star
            self._sumsq += d_star * d_star
            self._counts[nearest] += 1
            closed = self._close_window() if self._n >= self.window else None
        if closed is not None and self.on_window is not None:
            try:
                self.on_window(closed)
            except Exception:  # a logging callback must never break routing
                pass

    def _close_window(self) -> dict:
        n = self._n
        mean = self._sum / n
        var = max(0.0, self._sumsq / n - mean * mean)
        shares = self._counts / n
        d_shift = (mean - self._base_mean) / self._base_std
        js = js_divergence(shares, self._base_share)
        tv = 0.5 * float(np.abs(shares - self._base_share).sum())
        reasons = []
        if d_shift >= self.d_shift_threshold:
            reasons.append(f"mean d* {mean:.4f} is {d_shift:+.2f} baseline s.d. from {self._base_mean:.4f} (threshold {self.d_shift_threshold:g})")
        if js >= self.js_threshold:
            reasons.append(f"cluster-share JS divergence {js:.4f} >= {self.js_threshold:g}")
        out = bool(reasons)
        self.windows_closed += 1
        self.windows_out += int(out)
        if out:
            if self._in_row == 0:
                self._drift_since = self._win_start
            self._in_row += 1
        else:
            self._in_row = 0
            self._drift_since = None
        self._last = {
            "end": self.observations,
            "n": n,
            "mean_d_star": mean,
            "std_d_star": math.sqrt(var),
            "d_shift": d_shift,
            "d_rel": mean / self._base_mean - 1.0 if self._base_mean > 0 else float("inf"),
            "js": js,
            "tv": tv,
            "shares": shares.round(4).tolist(),
            "out_of_profile": out,
            "reasons": reasons,
        }
        self._history.append(self._last)
        self._reset_window()
        return self._last

    # ------------------------------------------------------------------ reading
    def drifted(self) -> tuple[bool, str]:
        """(True, reason) once `patience` consecutive windows were out of profile."""
        with self._lock:
            if self._in_row >= self.patience and self._last is not None:
                return True, f"{self._in_row} windows out of profile: " + "; ".join(self._last["reasons"])
            return False, ""

    @property
    def drift_since(self) -> int | None:
        """Observation index where the current out-of-profile run began (None without one)."""
        return self._drift_since

    def windows(self) -> list[dict]:
        with self._lock:
            return list(self._history)

    def snapshot(self) -> dict:
        """Flat numbers for /metrics and logs (NaN before the first window closes)."""
        d, why = self.drifted()
        with self._lock:
            last = self._last or {}
            return {
                "generation": self.generation,
                "observations": self.observations,
                "no_signature": self.no_signature,
                "mismatched": self.mismatched,
                "windows": self.windows_closed,
                "windows_out_of_profile_total": self.windows_out,
                "window": self.window,
                "window_fill": self._n,
                "baseline_mean_d_star": self._base_mean,
                "baseline_std_d_star": self._base_std,
                "mean_d_star": last.get("mean_d_star", float("nan")),
                "d_shift": last.get("d_shift", float("nan")),
                "d_rel": last.get("d_rel", float("nan")),
                "share_js": last.get("js", float("nan")),
                "share_tv": last.get("tv", float("nan")),
                "shares": last.get("shares", []),
                "out_of_profile_windows": self._in_row,
                "drifted": d,
                "reason": why,
                "rebases": self.rebases,
                "rebase_error": self.rebase_error,
            }
