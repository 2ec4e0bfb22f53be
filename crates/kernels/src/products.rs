//! The one front of the `gemm` crate: every f32 product of the CPU kernels goes through these,
//! each operand given with its (row, column) strides and the extents the strides reach checked
//! against the slices' lengths (three comparisons a product, in release builds too).

use crate::bf16_gemm::Strided;

/// Whether a GEMM is worth splitting across threads: below about 50 MFLOP the split costs more than
/// it saves (measured on 2 cores: 768×128×128 runs at 110 GFLOP/s on one thread, 59 on two).
pub(crate) fn gemm_parallelism(m: usize, n: usize, k: usize) -> gemm::Parallelism {
    if 2 * m * n * k >= 50_000_000 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// `dst (+)= beta · lhs · rhs`, every operand (the output too) with (row, column) strides, on the
/// threads `parallelism` allows.
pub(crate) fn gemm_strided(
    mnk: (usize, usize, usize),
    (dst, dst_strides): (&mut [f32], (usize, usize)),
    accumulate: bool,
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    beta: f32,
    parallelism: gemm::Parallelism,
) {
    let dst = (dst.as_mut_ptr(), dst.len(), dst_strides);
    // SAFETY: `dst` is a live, exclusively borrowed slice of `dst.len()` elements.
    unsafe { gemm_raw(mnk, dst, accumulate, lhs, rhs, beta, parallelism) }
}

/// `a · b` into a new `[m, n]` row-major vector, which is not zero-filled first: with `read_dst`
/// false the GEMM writes every output element without reading it (its kernels store `β·sum`, and
/// for `k = 0` it stores zeros), and the memset of every GEMM's output was 2–5 % of a training step.
pub(crate) fn gemm_new(
    (m, n, k): (usize, usize, usize),
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    parallelism: gemm::Parallelism,
) -> Vec<f32> {
    gemm_new_scaled((m, n, k), lhs, rhs, 1.0, parallelism)
}

/// [`gemm_new`] of `beta · a · b`.
pub(crate) fn gemm_new_scaled(
    (m, n, k): (usize, usize, usize),
    lhs: Strided<'_>,
    rhs: Strided<'_>,
    beta: f32,
    parallelism: gemm::Parallelism,
) -> Vec<f32> {
    let mut out = Box::<[f32]>::new_uninit_slice(m * n);
    let dst = (out.as_mut_ptr().cast::<f32>(), m * n, (n, 1));
    // SAFETY: `dst` is the `m·n` elements just allocated, owned here; writing through the pointer
    // needs no initialised value.
    unsafe { gemm_raw((m, n, k), dst, false, lhs, rhs, beta, parallelism) };
    // SAFETY: the GEMM above wrote all `m·n` elements (see the doc comment), each row `n` apart.
    unsafe { out.assume_init() }.into_vec()
}

/// `dst (+)= beta · lhs · rhs` through the `gemm` crate, `dst` given as (pointer, elements, (row,
/// column) strides): the extents the strides reach are checked against the lengths.
///
/// # Safety
/// `dst.0` must be valid for writes (and, with `accumulate`, reads) of `dst.1` f32 elements, and
/// alias nothing else in use during the call.
pub(crate) unsafe fn gemm_raw(
    (m, n, k): (usize, usize, usize),
    (dst, dst_len, (dst_rs, dst_cs)): (*mut f32, usize, (usize, usize)),
    accumulate: bool,
    (lhs, (lhs_rs, lhs_cs)): Strided<'_>,
    (rhs, (rhs_rs, rhs_cs)): Strided<'_>,
    beta: f32,
    parallelism: gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Three comparisons a GEMM, in release builds too: a wrong shape from a caller is a panic, never
    // memory outside the slices.
    assert!((m - 1) * dst_rs + (n - 1) * dst_cs < dst_len, "GEMM output slice too short");
    assert!(k == 0 || (m - 1) * lhs_rs + (k - 1) * lhs_cs < lhs.len(), "GEMM left operand slice too short");
    assert!(k == 0 || (k - 1) * rhs_rs + (n - 1) * rhs_cs < rhs.len(), "GEMM right operand slice too short");
    // SAFETY: the assertions above check the extents the strides reach against the slices; the
    // caller vouches for `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
}
