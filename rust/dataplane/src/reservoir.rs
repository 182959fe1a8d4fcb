//! The refit reservoir's keep/slot draw: bucketed Algorithm R (Vitter 1985), decided before
//! a request is routed so the route copies its unit signature only when the reservoir will
//! store it (most requests, once the buckets are full, are not stored).
//!
//! The stored signatures stay in Python (`eldr_sglang.drift.reservoir.SignatureReservoir`,
//! which documents the scheme); this is the one implementation of the draw, used by the data
//! plane per request and, through the extension (`_core.ReservoirSampler`), by a reservoir fed
//! without a data plane.
//!
//! The stream of offers is cut into buckets of `span` offers; offer `index` belongs to bucket
//! `index / span` (modulo the bucket count, which only Python needs) and is the
//! `n = index % span`-th offer of it. It is stored at slot `n` while `n < per_bucket`, else at
//! a uniform `j` in `0..=n` when `j < per_bucket`, else not at all.
//!
//! A request draws before it routes ([`KeepSampler::begin`]) and commits the draw only if the
//! route produced a signature ([`Ticket::commit`]); a route that falls back gives its draw back
//! (dropping the ticket), and the next request takes that same draw, so an offer index is
//! never skipped. Concurrent requests may commit indices out of order; the reservoir keeps,
//! per slot, the offer with the highest index, which is what sequential Algorithm R keeps.

use std::sync::Mutex;

use eldr_core::rng::AtomicRng;

/// The longest bucket: the slot draw is [`AtomicRng::below`] (32-bit multiply-shift), whose
/// bias stays under 2^-8 up to here.
pub const MAX_SPAN: u64 = 1 << 24;

/// The reservoir's decision for one offer: its stream index and its slot in its bucket
/// (None: not stored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Draw {
    pub index: u64,
    pub slot: Option<u32>,
}

impl Draw {
    pub fn keeps(&self) -> bool {
        self.slot.is_some()
    }
}

pub struct KeepSampler {
    per_bucket: u64,
    span: u64,
    rng: AtomicRng,
    /// The next fresh index, and draws given back by routes that produced no signature.
    state: Mutex<(u64, Vec<Draw>)>,
}

impl KeepSampler {
    /// `per_bucket` stored signatures out of each bucket of `span` offers
    /// (1 <= per_bucket <= span <= [`MAX_SPAN`]).
    pub fn new(per_bucket: u64, span: u64, seed: u64) -> Result<KeepSampler, String> {
        if per_bucket == 0 {
            return Err("per_bucket must be at least 1".into());
        }
        if span < per_bucket || span > MAX_SPAN {
            return Err(format!("span (horizon / buckets) must be at least per_bucket ({per_bucket}) and at most {MAX_SPAN}, got {span}"));
        }
        Ok(KeepSampler { per_bucket, span, rng: AtomicRng::new(seed), state: Mutex::new((0, Vec::new())) })
    }

    pub fn per_bucket(&self) -> u64 {
        self.per_bucket
    }

    pub fn span(&self) -> u64 {
        self.span
    }

    /// The draw for the next offer: one given back earlier (the lowest index first), else a
    /// fresh index. The lock covers only that choice; the random slot is drawn outside it.
    pub fn draw(&self) -> Draw {
        let index = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if st.1.is_empty() {
                st.0 += 1;
                st.0 - 1
            } else {
                let (i, _) = st.1.iter().enumerate().min_by_key(|(_, d)| d.index).expect("not empty");
                return st.1.swap_remove(i);
            }
        };
        let n = index % self.span;
        let slot = if n < self.per_bucket {
            Some(n as u32)
        } else {
            let j = self.rng.below((n + 1) as usize) as u64;
            (j < self.per_bucket).then_some(j as u32)
        };
        Draw { index, slot }
    }

    /// Give back a draw whose request made no offer (its route fell back): the next one takes it.
    pub fn undo(&self, d: Draw) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1.push(d);
    }

    /// A draw that goes back by itself unless committed.
    pub fn begin(&self) -> Ticket<'_> {
        Ticket { sampler: self, draw: Some(self.draw()) }
    }
}

/// A draw held while a request routes.
pub struct Ticket<'a> {
    sampler: &'a KeepSampler,
    draw: Option<Draw>,
}

impl Ticket<'_> {
    /// Whether the route should keep the request's signature (the reservoir will store it).
    pub fn keeps(&self) -> bool {
        self.draw.is_some_and(|d| d.keeps())
    }

    /// The route produced a signature: the offer counts.
    pub fn commit(mut self) -> Draw {
        self.draw.take().expect("a ticket is committed once")
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if let Some(d) = self.draw.take() {
            self.sampler.undo(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequential Algorithm R over one bucket with the sampler's draws, returning which offer
    /// each slot ends with.
    fn run_bucket(s: &KeepSampler, span: u64, per: usize) -> Vec<u64> {
        let mut slots = vec![u64::MAX; per];
        for _ in 0..span {
            let d = s.draw();
            if let Some(j) = d.slot {
                slots[j as usize] = d.index % span;
            }
        }
        slots
    }

    #[test]
    fn each_offer_of_a_bucket_is_kept_with_probability_per_bucket_over_span() {
        // 4 slots out of 32 offers, over 4000 buckets: each offer ends in the sample 500 times
        // in expectation (sd ~ 21); a chi-square over the 32 offers (31 d.o.f.) must stay
        // under its 0.1% critical value 61.1. A draw biased to early or late offers (e.g.
        // j in 0..n instead of 0..=n) fails it.
        let (span, per, buckets) = (32u64, 4usize, 4000);
        let s = KeepSampler::new(per as u64, span, 7).unwrap();
        let mut hits = vec![0f64; span as usize];
        for _ in 0..buckets {
            for n in run_bucket(&s, span, per) {
                hits[n as usize] += 1.0;
            }
        }
        let expect = buckets as f64 * per as f64 / span as f64;
        let chi2: f64 = hits.iter().map(|h| (h - expect).powi(2) / expect).sum();
        assert!(chi2 < 61.1, "not uniform: chi2 {chi2:.1}, hits {hits:?}");
        assert_eq!(hits.iter().sum::<f64>(), (buckets * per) as f64); // a full bucket fills every slot
    }

    #[test]
    fn the_first_per_bucket_offers_fill_the_slots_then_most_are_not_kept() {
        let s = KeepSampler::new(8, 512, 1).unwrap();
        let first: Vec<Draw> = (0..8).map(|_| s.draw()).collect();
        assert!(first.iter().enumerate().all(|(i, d)| d.index == i as u64 && d.slot == Some(i as u32)));
        let kept = (8..512).filter(|_| s.draw().keeps()).count();
        // sum over n of 8/(n+1), n = 8..511: about 8 ln(512/8.5) ~ 32.8
        assert!((15..60).contains(&kept), "{kept} kept");
        let d = s.draw();
        assert_eq!((d.index, d.slot), (512, Some(0))); // a new bucket starts filling
    }

    #[test]
    fn a_draw_given_back_is_the_next_one_taken_so_no_index_is_skipped() {
        let s = KeepSampler::new(2, 8, 3).unwrap();
        let a = s.begin();
        let b = s.begin();
        let (ka, kb) = (a.keeps(), b.keeps());
        drop(a); // its route fell back
        let c = s.begin();
        assert_eq!(c.keeps(), ka);
        assert_eq!(c.commit().index, 0);
        assert_eq!(b.commit().index, 1);
        assert!(kb);
        assert_eq!(s.draw().index, 2);
    }

    #[test]
    fn concurrent_routes_commit_every_index_once_however_many_fall_back() {
        // 4 threads, every third route falls back: no index is committed twice or lost
        let s = KeepSampler::new(4, 64, 5).unwrap();
        let per_thread = 3000;
        let mut all: Vec<u64> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..4)
                .map(|t| {
                    let s = &s;
                    sc.spawn(move || {
                        let mut got = Vec::new();
                        for i in 0..per_thread {
                            let ticket = s.begin();
                            if (i + t) % 3 != 0 {
                                got.push(ticket.commit().index);
                            }
                        }
                        got
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(all.len(), 4 * 2000);
        // the draws given back last wait for the next requests (at most one per thread)
        all.extend((0..8).map(|_| s.draw().index));
        all.sort_unstable();
        assert_eq!(all, (0..all.len() as u64).collect::<Vec<_>>());
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(KeepSampler::new(0, 8, 0).is_err());
        assert!(KeepSampler::new(9, 8, 0).is_err());
        assert!(KeepSampler::new(8, 8, 0).is_ok());
        assert!(KeepSampler::new(8, MAX_SPAN + 1, 0).is_err());
    }
}
