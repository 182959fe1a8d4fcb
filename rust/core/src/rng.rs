//! A tiny lock-free PRNG (SplitMix64 over an atomic counter) for the random policies.
//! Shared by many threads without a lock; seeded so simulations are reproducible.

use std::sync::atomic::{AtomicU64, Ordering};

pub struct AtomicRng(AtomicU64);

impl AtomicRng {
    pub fn new(seed: u64) -> Self {
        AtomicRng(AtomicU64::new(seed))
    }

    pub fn next_u64(&self) -> u64 {
        // SplitMix64 (Steele, Lea, Flood 2014): each fetch_add claims a distinct state.
        let mut z = self.0.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (n > 0), via Lemire's multiply-shift (bias < 2^-32 for small n).
    pub fn below(&self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }
}
