//! The one summation order of a route's dot products `sum_j x_j * mu[j][k]` and of the
//! signature's squared norm `sum_j x_j^2`, over its positions j in the D-dim signature space.
//! Every path (sparse, dense and wire counts; portable and SIMD) sums in it, so they agree
//! to the bit:
//!
//! * positions in groups of [`GROUP`] (64); within a group, eight f32 lane sums by `j % 8`,
//!   each adding `x_j * mu[j][k]` (a rounded multiply, then a rounded add; no FMA, so
//!   machines with and without it agree) and `x_j * x_j` in ascending j;
//! * at the end of a group, its lanes are added in f32 as `((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))`
//!   ([`lane_tree`]) and that sum goes into an f64 total.
//!
//! A zero `x_j` adds exactly nothing (`mu` is finite: the centroid file refuses NaN and
//! infinity; a lane sum starts at +0 and never becomes -0), and neither does a group of zeros,
//! so a sparse signature (nonzeros only) and the same values laid out dense (the wire path,
//! eight positions at a time) give the same bits. The f32 sums are short (8 terms a lane, then
//! a tree of 8), which keeps the error near f64's: the parity tests hold distances to 1e-6.
//!
//! A leaf: the signature's norm ([`norm2_sparse`]) and the distances' dot products
//! ([`crate::distance`]) both read it.

/// Positions summed in f32 before the f64 total.
pub const GROUP: usize = 64;

/// The eight lane sums of a group, added pairwise.
#[inline(always)]
pub fn lane_tree(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `sum_j x_j^2` of a sparse signature (ascending positions), in the order of this module.
pub(crate) fn norm2_sparse(index: &[u32], value: &[f32]) -> f64 {
    let (mut n2, mut lanes, mut group) = (0f64, [0f32; 8], usize::MAX);
    for (&j, &x) in index.iter().zip(value) {
        let j = j as usize;
        if j / GROUP != group {
            n2 += lane_tree(lanes) as f64;
            lanes = [0.0; 8];
            group = j / GROUP;
        }
        lanes[j % 8] += x * x;
    }
    n2 + lane_tree(lanes) as f64
}
