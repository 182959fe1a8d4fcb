//! Counting helpers over top-k expert ids `[T, L, k]` (row-major, any integer type).

/// An integer expert id type read from numpy.
pub trait ExpertId: Copy + Send + Sync {
    /// The id as i64 (negative ids are reported as out of range by callers).
    fn as_i64(self) -> i64;
}

macro_rules! impl_expert_id {
    ($($t:ty),*) => {$(impl ExpertId for $t { #[inline] fn as_i64(self) -> i64 { self as i64 } })*};
}
impl_expert_id!(u8, u16, u32, u64, i8, i16, i32, i64);

/// The first id outside `0..num_experts`, if any.
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[error("expert id {id} at layer {layer} is out of range 0..{num_experts}")]
pub struct OutOfRange {
    pub id: i64,
    pub layer: usize,
    pub num_experts: usize,
}

/// Per-(layer, expert) counts `[L * E]` of top-k ids `[T, L, k]` given as a flat slice.
pub fn count_topk<T: ExpertId>(ids: &[T], layers: usize, k: usize, num_experts: usize, out: &mut [u32]) -> Result<(), OutOfRange> {
    debug_assert_eq!(out.len(), layers * num_experts);
    let row = layers * k;
    if row == 0 {
        return Ok(());
    }
    for token in ids.chunks_exact(row) {
        for (l, picks) in token.chunks_exact(k).enumerate() {
            for &id in picks {
                let e = id.as_i64();
                if e < 0 || e as usize >= num_experts {
                    return Err(OutOfRange { id: e, layer: l, num_experts });
                }
                out[l * num_experts + e as usize] += 1;
            }
        }
    }
    Ok(())
}

/// Distinct experts per layer `[L]` touched by the tokens `[N, L, k]` of one decode step.
/// `scratch` must hold `L * E` bools and is left cleared.
pub fn distinct_per_layer<T: ExpertId>(
    ids: &[T],
    layers: usize,
    k: usize,
    num_experts: usize,
    scratch: &mut [bool],
    out: &mut [u32],
) -> Result<(), OutOfRange> {
    debug_assert_eq!(scratch.len(), layers * num_experts);
    out.iter_mut().for_each(|v| *v = 0);
    let row = layers * k;
    let mut result = Ok(());
    if row > 0 {
        'outer: for token in ids.chunks_exact(row) {
            for (l, picks) in token.chunks_exact(k).enumerate() {
                for &id in picks {
                    let e = id.as_i64();
                    if e < 0 || e as usize >= num_experts {
                        result = Err(OutOfRange { id: e, layer: l, num_experts });
                        break 'outer;
                    }
                    // branch-free: a data-dependent branch here mispredicts on fresh batches
                    let cell = &mut scratch[l * num_experts + e as usize];
                    out[l] += (!*cell) as u32;
                    *cell = true;
                }
            }
        }
    }
    scratch.iter_mut().for_each(|v| *v = false);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_distinct() {
        // T=2, L=2, k=2
        let ids: [i32; 8] = [0, 1, 2, 3, 1, 0, 2, 2];
        let mut c = vec![0u32; 2 * 4];
        count_topk(&ids, 2, 2, 4, &mut c).unwrap();
        assert_eq!(c, vec![2, 2, 0, 0, 0, 0, 3, 1]);
        let mut s = vec![false; 8];
        let mut d = vec![0u32; 2];
        distinct_per_layer(&ids, 2, 2, 4, &mut s, &mut d).unwrap();
        assert_eq!(d, vec![2, 2]);
        assert!(s.iter().all(|v| !v));
        assert_eq!(count_topk(&[0i32, 9], 1, 2, 4, &mut [0u32; 4]), Err(OutOfRange { id: 9, layer: 0, num_experts: 4 }));
    }
}
