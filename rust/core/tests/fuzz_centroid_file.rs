//! Fuzzing the centroid file reader: mutated files must give an error or a valid set, never a
//! panic. Mutations start from valid files (so they reach deep into validation) and, half the
//! time, re-seal the CRC so the field checks behind it are exercised too.
//!
//! Cases: ELDR_FUZZ_CASES (default 1,000,000: 40-50 s in a debug build on 2 cores; set it
//! lower for a quick local run). Memory safety of the unsafe reads was also checked under
//! valgrind memcheck (see docs/centroid-format.md).

use eldr_core::centroid_file::{CentroidSet, CentroidWriter, HEADER_LEN, TRAILER_LEN};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn valid_file(rng: &mut Rng) -> Vec<u8> {
    let k = 1 + rng.below(5);
    let l = 1 + rng.below(4);
    let e = 1 + rng.below(6);
    let mut weights: Vec<f32> = (0..l).map(|_| if rng.below(3) == 0 { 0.0 } else { 0.5 }).collect();
    weights[0] = 1.0;
    let sel = weights.iter().filter(|w| **w > 0.0).count();
    let idf: Vec<f32> = (0..l * e).map(|_| rng.below(100) as f32 / 10.0).collect();
    let cents: Vec<f32> = (0..k * sel * e).map(|_| 0.1 + rng.below(100) as f32).collect();
    CentroidWriter { centroids: &cents, k, layer_weights: &weights, idf: &idf, tau: 0.1, worker_names: (0..k).map(|i| format!("w{i}")).collect(), provenance: "{\"a\":1}" }
        .to_bytes()
        .unwrap()
}

const INTERESTING: [u64; 10] = [0, 1, 7, 63, 64, 127, 128, u32::MAX as u64, u64::MAX, 1 << 40];

fn mutate(rng: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(3) {
        match rng.below(6) {
            0 => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 => {
                let n = rng.below(b.len() + 1);
                b.truncate(n);
            }
            2 if b.len() >= HEADER_LEN => {
                // overwrite a header word (count, offset or length) with an interesting value
                let at = 8 + 4 * rng.below((HEADER_LEN - 16) / 4);
                let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                let w = if at >= 40 && at % 8 == 0 { 8 } else { 4 };
                b[at..at + w].copy_from_slice(&v[..w]);
            }
            3 => {
                let i = rng.below(b.len());
                let n = rng.below(16);
                b.splice(i..i, std::iter::repeat_n(rng.next() as u8, n));
            }
            4 if b.len() > HEADER_LEN + 4 => {
                // a float in a section becomes NaN, inf or negative
                let i = HEADER_LEN + 4 * rng.below((b.len() - HEADER_LEN) / 4 - 1);
                let v = [f32::NAN, f32::INFINITY, -1.0, 0.0][rng.below(4)];
                b[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                let i = rng.below(b.len());
                b[i] = rng.next() as u8;
            }
        }
        if b.is_empty() {
            break;
        }
    }
    if rng.below(2) == 0 && b.len() >= TRAILER_LEN + HEADER_LEN {
        // re-seal: fix the length field and the CRC so the checks behind them run
        let n = b.len() as u64;
        b[96..104].copy_from_slice(&n.to_le_bytes());
        let body = b.len() - TRAILER_LEN;
        let crc = crc32fast::hash(&b[..body]);
        b[body..body + 4].copy_from_slice(&crc.to_le_bytes());
        b[body + 4..].copy_from_slice(b"ELDR");
    }
    b
}

#[test]
fn mutated_files_never_panic() {
    let cases: usize = std::env::var("ELDR_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let mut rng = Rng(0x5EED);
    let (mut accepted, mut rejected) = (0usize, 0usize);
    let mut base = valid_file(&mut rng);
    for i in 0..cases {
        if i % 64 == 0 {
            base = valid_file(&mut rng);
        }
        let bytes = mutate(&mut rng, base.clone());
        match CentroidSet::from_bytes(&bytes) {
            Ok(set) => {
                // whatever was accepted is internally consistent
                assert_eq!(set.centroids_t().len(), set.dim() * set.num_workers());
                assert_eq!(set.worker_names().len(), set.num_workers());
                assert!(set.centroids_t().iter().all(|v| v.is_finite()));
                accepted += 1;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                rejected += 1;
            }
        }
    }
    eprintln!("fuzz: {cases} cases, {accepted} accepted, {rejected} rejected");
    assert!(rejected > cases / 2, "mutations should mostly be caught");
}
