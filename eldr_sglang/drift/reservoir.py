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
- The keep/slot draw is not made here: it is the Rust sampler's (`_core.ReservoirSampler`,
  rust/dataplane/src/reservoir.rs), one implementation for both feeds. The router's data
  plane draws before it routes each request, so the route copies a signature only for the
  few observations that are stored, and hands the draw over with the decision (`offer`);
  a reservoir fed directly (`add`, `add_lazy`: the simulator, tests) draws from its own
  sampler. Offer `index` is observation `index % span` of bucket `index // span`; concurrent
  requests may hand their draws over out of order, so each slot keeps the offer of the
  highest index, which is what Algorithm R in stream order keeps.
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

import threading

import numpy as np

DEFAULT_CAPACITY = 4096
DEFAULT_HORIZON = 16384
DEFAULT_BUCKETS = 32


def reservoir_shape(capacity: int = DEFAULT_CAPACITY, horizon: int = DEFAULT_HORIZON,
                    buckets: int = DEFAULT_BUCKETS) -> tuple[int, int]:
    """(per_bucket, span) of a reservoir: what the keep/slot draw needs (the data plane gets
    it in its config). Raises ValueError for a shape that cannot be one."""
    capacity, horizon, buckets = int(capacity), int(horizon), int(buckets)
    if buckets < 2:
        raise ValueError(f"buckets must be >= 2 (one is filling while the others are full), got {buckets}")
    if capacity < buckets:
        raise ValueError(f"capacity ({capacity}) must be at least the number of buckets ({buckets})")
    if horizon < capacity:
        raise ValueError(f"horizon ({horizon}) must be at least the capacity ({capacity}); "
                         "a shorter horizon is a ring buffer -- use horizon == capacity")
    per_bucket, span = capacity // buckets, horizon // buckets
    from eldr_sglang import _core

    _core.ReservoirSampler(per_bucket, span)  # the draw's own bounds (ValueError)
    return per_bucket, span


class SignatureReservoir:
    """Uniform sample of the signatures of a sliding horizon of the stream (see module doc)."""

    def __init__(self, dim: int, capacity: int = DEFAULT_CAPACITY, horizon: int = DEFAULT_HORIZON,
                 buckets: int = DEFAULT_BUCKETS, seed: int = 0):
        from eldr_sglang import _core

        dim, buckets = int(dim), int(buckets)
        if dim < 1:
            raise ValueError(f"signature dimension must be >= 1, got {dim}")
        self.per_bucket, self.span = reservoir_shape(capacity, horizon, buckets)
        self.dim = dim
        self.buckets = buckets
        self.capacity = self.per_bucket * buckets
        self.horizon = self.span * buckets
        self._draw = _core.ReservoirSampler(self.per_bucket, self.span, int(seed))
        self._data = np.zeros((buckets, self.per_bucket, dim), dtype=np.float32)
        self._owner = np.full((buckets, self.per_bucket), -1, dtype=np.int64)  # offer index in each slot; -1: empty
        self._epoch = np.full(buckets, -1, dtype=np.int64)  # index // span of each bucket's offers; -1: unused
        self._seen = np.zeros(buckets, dtype=np.int64)  # observations offered to each bucket
        self._first = np.zeros(buckets, dtype=np.int64)  # stream index of each bucket's first observation
        self._total = 0  # observations offered
        self._end = 0  # one past the highest offer index
        self._lock = threading.Lock()

    @property
    def shape(self) -> tuple[int, int]:
        """(per_bucket, span): what a data plane feeding this reservoir must draw for."""
        return self.per_bucket, self.span

    # ------------------------------------------------------------------ writing
    def add(self, signature) -> None:
        """Offer one signature ([dim], any float dtype; a unit vector from the router)."""
        s = np.asarray(signature, dtype=np.float32).reshape(-1)
        if s.shape[0] != self.dim:
            raise ValueError(f"signature has {s.shape[0]} dims, the reservoir holds {self.dim}")
        self.add_lazy(lambda: s)

    def add_lazy(self, make_signature) -> bool:
        """Offer one observation whose signature `make_signature()` computes only if Algorithm
        R keeps it (once the buckets are full most observations are not kept, so the caller
        skips computing their signatures). Draws from this reservoir's own sampler; never
        mix it with `offer` (a data plane's draws) on one reservoir. Returns whether it was stored."""
        index, slot = self._draw.draw()
        return self.offer(index, slot, make_signature)

    def offer(self, index: int, slot: int | None, make_signature) -> bool:
        """Take in one observation with the draw made for it (by the data plane, or `add_lazy`):
        offer `index`, stored at `slot` of its bucket (None: not stored, and `make_signature`
        is not called). Returns whether it was stored."""
        index = int(index)
        epoch = index // self.span
        b = epoch % self.buckets
        with self._lock:
            if self._epoch[b] != epoch:
                if self._epoch[b] > epoch:  # its bucket was recycled while this draw was held
                    return False
                self._epoch[b] = epoch  # start a new bucket, dropping the oldest
                self._seen[b] = 0
                self._first[b] = epoch * self.span
                self._owner[b] = -1
            self._seen[b] += 1
            self._total += 1
            self._end = max(self._end, index + 1)
            if slot is None:
                return False
            slot = int(slot)
            if not 0 <= slot < self.per_bucket:
                raise ValueError(f"slot {slot} out of range 0..{self.per_bucket}")
            if self._owner[b, slot] > index:  # a later offer already holds the slot (out-of-order hand-over)
                return False
            s = make_signature()
            if s is None:
                raise ValueError("the reservoir stores this observation but no signature came with it")
            s = np.asarray(s, dtype=np.float32).reshape(-1)
            if s.shape[0] != self.dim:
                raise ValueError(f"signature has {s.shape[0]} dims, the reservoir holds {self.dim}")
            self._data[b, slot] = s
            self._owner[b, slot] = index
            return True

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
        lo = 0 if last is None else self._end - int(last)
        return [b for b in range(self.buckets) if self._seen[b] > 0 and self._first[b] >= lo]

    def expected_sample_size(self, last: int | None = None) -> int:
        """Rows `sample(last)` returns (without copying them)."""
        rate = self.per_bucket / self.span
        with self._lock:
            n = 0
            for b in self._chosen(last):
                seen = int(self._seen[b])
                kept = int((self._owner[b] >= 0).sum())
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
                filled = self._owner[b] >= 0
                kept = int(filled.sum())
                rows = self._data[b, filled]  # a copy (boolean indexing)
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
                "stored": int((self._owner >= 0).sum()),
                "covered": int(self._seen.sum()),
                "bytes": int(self._data.nbytes),
            }
