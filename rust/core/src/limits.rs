//! Bounds on sizes that come from callers (Python arguments, file headers), checked before
//! anything is allocated: an out-of-range size is an error, never an aborting allocation.

use thiserror::Error;

/// Decode workers, layers, experts per layer: at most 2^20 each (the centroid file's bound on
/// K, L and E, docs/centroid-format.md). Real models have at most a few hundred of each.
pub const MAX_DIM: usize = 1 << 20;
/// Experts per MoE layer: [`MAX_DIM`] (the centroid file's bound on E; the trace format, the
/// CLI and `--eldr-paged-experts` read it as `_core.MAX_EXPERTS`).
pub const MAX_EXPERTS: usize = MAX_DIM;
/// Elements of one caller-sized buffer (an `[L, E]` count table, a batch of signatures):
/// 2^28, i.e. 1 GiB of u32 or f32.
pub const MAX_ELEMENTS: usize = 1 << 28;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SizeError {
    #[error("{what} = {value} is out of range 1..={max}")]
    OutOfRange { what: &'static str, value: u128, max: usize },
    #[error("{what}: {elements} elements exceed the limit of {max} per buffer")]
    TooLarge { what: &'static str, elements: u128, max: usize },
    #[error("{what}: cannot allocate {elements} elements: {msg}")]
    Alloc { what: &'static str, elements: usize, msg: String },
}

/// `value` if it lies in `1..=MAX_DIM`.
pub fn check_dim(what: &'static str, value: usize) -> Result<usize, SizeError> {
    if value == 0 || value > MAX_DIM {
        return Err(SizeError::OutOfRange { what, value: value as u128, max: MAX_DIM });
    }
    Ok(value)
}

/// A zero-filled buffer of `a * b` elements, refused (not aborted) when the product exceeds
/// [`MAX_ELEMENTS`] or the allocator says no.
pub fn zeroed<T: Clone + Default>(what: &'static str, a: usize, b: usize) -> Result<Vec<T>, SizeError> {
    let elements = a as u128 * b as u128;
    if elements > MAX_ELEMENTS as u128 {
        return Err(SizeError::TooLarge { what, elements, max: MAX_ELEMENTS });
    }
    let n = elements as usize;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| SizeError::Alloc { what, elements: n, msg: e.to_string() })?;
    v.resize(n, T::default());
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_bounded() {
        assert_eq!(check_dim("E", 256), Ok(256));
        assert!(matches!(check_dim("E", 0), Err(SizeError::OutOfRange { .. })));
        assert!(check_dim("E", 1 << 40).unwrap_err().to_string().contains("E = 1099511627776 is out of range"));
        assert_eq!(zeroed::<u32>("counts", 3, 4).unwrap(), vec![0; 12]);
        assert!(matches!(zeroed::<u32>("counts", 1 << 40, 1 << 40), Err(SizeError::TooLarge { .. })));
        assert!(matches!(zeroed::<u32>("counts", usize::MAX, 2), Err(SizeError::TooLarge { .. })));
    }
}
