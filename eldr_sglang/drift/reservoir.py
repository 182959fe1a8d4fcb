"""A fixed-memory sample of recent prefill signatures, for refitting the centroids.

Why not plain Algorithm R (Vitter 1985) over the whole stream: it keeps a uniform sample of
*everything ever seen*, so after a drift the old traffic dominates the sample forever and a
refit would fit the past. Why not a ring buffer of the last `capacity` signatures: it is
uniform over a sliding window, but the window is only as long as the memory, so a short
burst of one domain (a few hundred requests) fills the whole sample.

What we do -- bucketed Algorithm R over a sliding horizon:

- The stream is cut into consecutive buckets of `span = horizon // buckets` observations;
  the reservoir keeps the last `buckets` of them (the current, partially filled bucket and
  the `buckets - 1` full ones before it) and drops the oldest when a new one starts.
- Each bucket keeps a uniform sample of `m = capacity // buckets` of its observations with
  Algorithm R (the i-th observation of a bucket replaces a random slot with probability
  m / i), so memory is fixed at `capacity` signatures and each observation costs O(D) for
  the copy plus O(1).
- Every observation of a full bucket is in the sample with probability m / span. The
  current bucket has seen n <= span observations and keeps min(n, m) of them, a higher
  rate; `sample()` subsamples it down to round(n * m / span), so in the returned sample
  **every observation of the horizon has the same inclusion probability m / span**. The
  horizon slides in steps of one bucket: it covers between (buckets - 1) * span and
  buckets * span of the latest observations.
- `sample(last=n)` returns only the buckets that lie within the latest n observations
  (bucket granularity) -- used to refit on the traffic since a detected drift began. The
  default 32 buckets over a horizon of 16384 make that granularity 512 observations.

Memory: capacity * dim * 4 bytes (float32). For a DeepSeek-V3 middle-band signature
(about 29 layers x 256 experts = 7424 dims) the default capacity 4096 is about 120 MB;
choose a smaller capacity there.
"""

from __future__ import annotations

import random
import threading

import numpy as np


class SignatureReservoir:
    """Uniform sample of the signatures of a sliding horizon of the stream (see module doc)."""

    def __init__(self, dim: int, capacity: int = 4096, horizon: int = 16384, buckets: int = 32, seed: int = 0):
        dim, capacity, horizon, buckets = int(dim), int(capacity), int(horizon), int(buckets)
        if dim < 1:
            raise ValueError(f"signature dimension must be >= 1, got {dim}")
        if buckets < 2:
            raise ValueError(f"buckets must be >= 2 (one is filling while the others are full), got {buckets}")
        if capacity < buckets:
            raise ValueError(f"capacity ({capacity}) must be at least the number of buckets ({buckets})")
        if horizon < capacity:
            raise ValueError(f"horizon ({horizon}) must be at least the capacity ({capacity}); "
                             "a shorter horizon is a ring buffer -- use horizon == capacity")
        self.dim = dim
        self.buckets = buckets
        self.per_bucket = capacity // buckets
        self.capacity = self.per_bucket * buckets
        self.span = horizon // buckets
        self.horizon = self.span * buckets
        self._data = np.zeros((buckets, self.per_bucket, dim), dtype=np.float32)
        self._seen = np.zeros(buckets, dtype=np.int64)  # observations offered to each bucket
        self._first = np.zeros(buckets, dtype=np.int64)  # stream index of each bucket's first observation
        self._cur = 0
        self._total = 0
        self._rng = random.Random(int(seed))
        self._lock = threading.Lock()
        self._pending: tuple[int, int] | None = None  # (stream index, slot) drawn by will_store_next

    # ------------------------------------------------------------------ writing
    def add(self, signature) -> None:
        """Offer one signature ([dim], any float dtype; a unit vector from the router)."""
        s = np.asarray(signature, dtype=np.float32).reshape(-1)
        if s.shape[0] != self.dim:
            raise ValueError(f"signature has {s.shape[0]} dims, the reservoir holds {self.dim}")
        self.add_lazy(lambda: s)

    def _next_slot(self) -> int:
        """Algorithm R's slot for the next observation (drawn once: will_store_next keeps it)."""
        if self._pending is not None and self._pending[0] == self._total:
            return self._pending[1]
        b = self._cur
        n = 0 if self._seen[b] >= self.span else int(self._seen[b])
        slot = n if n < self.per_bucket else self._rng.randrange(n + 1)
        self._pending = (self._total, slot)
        return slot

    def will_store_next(self) -> bool:
        """Whether the next observation offered will be stored. The router asks before it
        routes, so the route keeps its signature only then (Decision.unit_signature)."""
        with self._lock:
            return self._next_slot() < self.per_bucket

    def add_lazy(self, make_signature) -> bool:
        """Offer one observation whose signature `make_signature()` computes only if Algorithm
        R keeps it (once the buckets are full most observations are not kept, so the router
        skips computing their signatures). Returns whether it was stored."""
        with self._lock:
            slot = self._next_slot()
            self._pending = None
            b = self._cur
            if self._seen[b] >= self.span:  # start a new bucket, dropping the oldest
                b = self._cur = (b + 1) % self.buckets
                self._seen[b] = 0
                self._first[b] = self._total
            n = int(self._seen[b])
            stored = slot < self.per_bucket
            if stored:
                s = np.asarray(make_signature(), dtype=np.float32).reshape(-1)
                if s.shape[0] != self.dim:
                    raise ValueError(f"signature has {s.shape[0]} dims, the reservoir holds {self.dim}")
                self._data[b, slot] = s
            self._seen[b] = n + 1
            self._total += 1
            return stored

    def add_many(self, signatures) -> None:
        for s in np.asarray(signatures, dtype=np.float32).reshape(-1, self.dim):
            self.add(s)

    # ------------------------------------------------------------------ reading
    @property
    def total_seen(self) -> int:
        return int(self._total)

    def horizon_len(self, last: int | None = None) -> int:
        """Observations covered by `sample(last)`."""
        with self._lock:
            return int(sum(int(self._seen[b]) for b in self._chosen(last)))

    def _chosen(self, last: int | None) -> list[int]:
        lo = 0 if last is None else self._total - int(last)
        return [b for b in range(self.buckets) if self._seen[b] > 0 and self._first[b] >= lo]

    def expected_sample_size(self, last: int | None = None) -> int:
        """Rows `sample(last)` returns (without copying them)."""
        rate = self.per_bucket / self.span
        with self._lock:
            n = 0
            for b in self._chosen(last):
                seen = int(self._seen[b])
                kept = min(seen, self.per_bucket)
                n += kept if seen >= self.span else min(kept, int(round(seen * rate)))
            return n

    def sample(self, last: int | None = None, seed: int | None = None) -> np.ndarray:
        """[n, dim] float32 copy: a sample in which every observation of the horizon (or of
        the whole buckets within the latest `last` observations) has inclusion probability
        per_bucket / span. Oldest bucket first."""
        rng = np.random.default_rng(seed)
        rate = self.per_bucket / self.span
        with self._lock:
            chosen = sorted(((int(self._first[b]), b) for b in self._chosen(last)))
        parts = []
        for first, b in chosen:  # one bucket per lock hold: writers wait for one bucket's copy at most
            with self._lock:
                if int(self._first[b]) != first:  # recycled meanwhile (the stream moved a whole span on)
                    continue
                n = int(self._seen[b])
                kept = min(n, self.per_bucket)
                rows = self._data[b, :kept].copy()
            if n < self.span:  # the filling bucket: thin it to the common rate
                want = min(kept, int(round(n * rate)))
                if want < kept:
                    rows = rows[np.sort(rng.choice(kept, want, replace=False))]
            parts.append(rows)
        if not parts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.concatenate(parts)

    def stats(self) -> dict:
        with self._lock:
            return {
                "total_seen": int(self._total),
                "capacity": self.capacity,
                "horizon": self.horizon,
                "buckets": self.buckets,
                "stored": int(np.minimum(self._seen, self.per_bucket).sum()),
                "covered": int(self._seen.sum()),
                "bytes": int(self._data.nbytes),
            }
