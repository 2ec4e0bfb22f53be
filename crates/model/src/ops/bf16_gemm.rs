//! `c (+)= a · b` with the operands rounded to bf16 and products summed in f32, on the CPU's bf16
//! dot-product instruction (AVX512_BF16's `vdpbf16ps`: 32 multiply-adds a vector instruction,
//! twice an f32 FMA's 16).
//!
//! Both operands are packed first, converting to bf16 with round-to-nearest-even: `b` into panels
//! of [`PANEL`] columns in which each `k`-pair of a column is two adjacent bf16 (the instruction's
//! operand layout), `a` into rows of `k`-pairs. The microkernel keeps a block of 8 rows × 48 columns
//! (24 vectors of 16 f32 sums) in registers while it walks the pairs: per pair it loads three
//! vectors of `b`, broadcasts each row's pair of `a`, and issues 24 dot products. Threads take
//! column panels. Chosen at run time (`avx512bf16` and `avx512f`); [`reference`] is the plain loop
//! over the same rounded values that it is tested against.

#[cfg(target_arch = "x86_64")]
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::SharedOut;

/// Columns of a packed panel of `b`: three vectors of 16.
pub const PANEL: usize = 48;

/// Rows of `a` per microkernel call.
const ROWS: usize = 8;

/// `x` rounded to bf16 (nearest, ties to even; NaN stays NaN), as its bits.
pub fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1));
    (rounded >> 16) as u16
}

/// The f32 a bf16 stands for.
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Whether this CPU runs [`gemm`]'s kernel.
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// An operand with its (row, column) strides.
pub type Strided<'a> = (&'a [f32], (usize, usize));

/// Whether a strided operand's `rows × cols` elements lie inside its slice.
fn reaches((s, (rs, cs)): Strided<'_>, rows: usize, cols: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < s.len()
}

/// `c (+)= a · b`, `a` `[m, k]`, `b` `[k, n]` given with strides (so that transposed operands are
/// read where they are), `c` `[m, n]` row-major; the operands rounded to bf16, the sums in f32.
/// Returns `false` (and leaves `c` alone) where the CPU lacks the instructions: the caller then
/// runs its f32 path.
///
/// # Panics
/// If a slice is shorter than its shape and strides reach.
pub fn gemm(c: &mut [f32], accumulate: bool, a: Strided<'_>, b: Strided<'_>, (m, k, n): (usize, usize, usize)) -> bool {
    assert!(c.len() >= m * n, "bf16 GEMM: output slice too short");
    assert!(reaches(a, m, k) && reaches(b, k, n), "bf16 GEMM: operand slice too short");
    if !supported() {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let packed_a = pack_a(a, m, k);
        // Each thread packs and multiplies its own panels: the packed panel stays in its cache.
        let out = SharedOut(c.as_mut_ptr());
        (0..n.div_ceil(PANEL)).into_par_iter().for_each(|p| {
            let panel = pack_panel(b, k, p * PANEL, PANEL.min(n - p * PANEL));
            // SAFETY: the features were checked by `supported`, the shapes against the slices above;
            // the panel is panel `p` of b, and no two tasks write the same columns.
            unsafe { panel_product(out, accumulate, &packed_a, &panel, p, (m, k, n)) };
        });
    }
    true
}

/// `b` (`[k, n]`) packed into bf16 panels once, for several products with it ([`gemm_packed`]):
/// the LM head's weight, multiplied by every block of rows.
pub struct PackedB {
    k: usize,
    n: usize,
    #[cfg(target_arch = "x86_64")]
    panels: Vec<Vec<u32>>,
}

/// `b` packed for [`gemm_packed`], or `None` where the CPU lacks the instructions.
///
/// # Panics
/// If the slice is shorter than the shape and strides reach.
pub fn pack_b(b: Strided<'_>, (k, n): (usize, usize)) -> Option<PackedB> {
    assert!(reaches(b, k, n), "bf16 GEMM: operand slice too short");
    if !supported() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let panels =
            (0..n.div_ceil(PANEL)).into_par_iter().map(|p| pack_panel(b, k, p * PANEL, PANEL.min(n - p * PANEL)));
        Some(PackedB { k, n, panels: panels.collect() })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// [`gemm`] with `b` packed beforehand: `c (+)= a · b`, `a` `[m, k]` strided, `c` `[m, n]`.
///
/// # Panics
/// If a slice is shorter than its shape and strides reach.
pub fn gemm_packed(c: &mut [f32], accumulate: bool, a: Strided<'_>, b: &PackedB, m: usize) {
    let (k, n) = (b.k, b.n);
    assert!(c.len() >= m * n, "bf16 GEMM: output slice too short");
    assert!(reaches(a, m, k), "bf16 GEMM: operand slice too short");
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (accumulate, a); // no `PackedB` exists there: `pack_b` answers `None`
    #[cfg(target_arch = "x86_64")]
    {
        let packed_a = pack_a(a, m, k);
        let out = SharedOut(c.as_mut_ptr());
        b.panels.par_iter().enumerate().for_each(|(p, panel)| {
            // SAFETY: a `PackedB` exists only where `supported` held; the shapes were checked above and
            // when b was packed; no two tasks write the same columns.
            unsafe { panel_product(out, accumulate, &packed_a, panel, p, (m, k, n)) };
        });
    }
}

/// Pairs of `k` per pass over a panel: 1,024 pairs of 48 columns (192 KiB) stay in the L2 cache
/// while every block of rows is multiplied by them.
#[cfg(target_arch = "x86_64")]
const PAIRS_PER_PASS: usize = 1024;

/// Columns of panel `p` of `c` `(+)=` the packed rows of a times the panel, in passes over
/// [`PAIRS_PER_PASS`] pairs of `k`.
///
/// # Safety
/// The CPU must have AVX-512F and AVX512_BF16; `c` must be an `[m, n]` output, `packed_a` come
/// from [`pack_a`] of an `[m, k]` operand and `panel` from [`pack_panel`] of panel `p` of a
/// `[k, n]` one, and no other task may write these columns meanwhile.
#[cfg(target_arch = "x86_64")]
unsafe fn panel_product(
    c: SharedOut,
    accumulate: bool,
    packed_a: &[u32],
    panel: &[u32],
    p: usize,
    (m, k, n): (usize, usize, usize),
) {
    let pairs = k.div_ceil(2);
    let cols = PANEL.min(n - p * PANEL);
    debug_assert!(packed_a.len() >= m.next_multiple_of(ROWS) * pairs && panel.len() >= pairs * PANEL);
    for p0 in (0..pairs.max(1)).step_by(PAIRS_PER_PASS) {
        let pass = PAIRS_PER_PASS.min(pairs - p0);
        for r0 in (0..m).step_by(ROWS) {
            avx512::block(
                c.at(r0 * n + p * PANEL),
                n,
                (ROWS.min(m - r0), cols),
                accumulate || p0 > 0,
                packed_a.as_ptr().add(r0 * pairs + p0),
                (pass, pairs),
                panel.as_ptr().add(p0 * PANEL),
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// `a`'s rows as pairs of bf16 along k (a zero pads an odd k), rows padded with zeros to a
/// multiple of [`ROWS`]: `[m', k/2]` of `u32`, the lower half the even k.
fn pack_a((a, (rs, cs)): Strided<'_>, m: usize, k: usize) -> Vec<u32> {
    let pairs = k.div_ceil(2);
    let mut packed = vec![0u32; m.next_multiple_of(ROWS) * pairs];
    packed.par_chunks_mut(pairs.max(1)).take(m).enumerate().for_each(|(i, row)| {
        #[cfg(target_arch = "x86_64")]
        if cs == 1 {
            // SAFETY: `gemm` runs this only after `supported`; the row's k elements are inside `a`
            // (checked by `gemm`), and `row` holds k.div_ceil(2) pairs.
            unsafe { avx512::convert_row(row, &a[i * rs..i * rs + k]) };
            return;
        }
        for (p, out) in row.iter_mut().enumerate() {
            let lo = to_bf16(a[i * rs + 2 * p * cs]);
            let hi = if 2 * p + 1 < k { to_bf16(a[i * rs + (2 * p + 1) * cs]) } else { 0 };
            *out = u32::from(lo) | (u32::from(hi) << 16);
        }
    });
    packed
}

#[cfg(target_arch = "x86_64")]
/// Columns `c0 .. c0 + cols` of `b` as a panel: for each k-pair, [`PANEL`] columns of two bf16 (even
/// k first), zeros past `cols` and past k.
fn pack_panel((b, (rs, cs)): Strided<'_>, k: usize, c0: usize, cols: usize) -> Vec<u32> {
    let pairs = k.div_ceil(2);
    let mut panel = vec![0u32; pairs * PANEL];
    #[cfg(target_arch = "x86_64")]
    if rs == 1 && cs != 1 {
        // A transposed operand (W read as Wᵀ): each column's k values are contiguous, so each is
        // converted as a row and its pairs written down the panel.
        let mut pairs_of = vec![0u32; pairs];
        for j in 0..cols {
            let col = (c0 + j) * cs;
            // SAFETY: `gemm` runs this only after `supported`; the column is inside `b` (checked by
            // `gemm`) and `pairs_of` holds its pairs.
            unsafe { avx512::convert_row(&mut pairs_of, &b[col..col + k]) };
            for (p, &v) in pairs_of.iter().enumerate() {
                panel[p * PANEL + j] = v;
            }
        }
        return panel;
    }
    for (p, out) in panel.chunks_exact_mut(PANEL).enumerate() {
        let (k0, k1) = (2 * p, 2 * p + 1);
        #[cfg(target_arch = "x86_64")]
        if cs == 1 {
            let lo = &b[k0 * rs + c0..k0 * rs + c0 + cols];
            let hi = (k1 < k).then(|| &b[k1 * rs + c0..k1 * rs + c0 + cols]);
            // SAFETY: `gemm` runs this only after `supported`; the slices are checked above.
            unsafe { avx512::interleave_rows(out, lo, hi) };
            continue;
        }
        for (j, o) in out.iter_mut().take(cols).enumerate() {
            let col = c0 + j;
            let lo = to_bf16(b[k0 * rs + col * cs]);
            let hi = if k1 < k { to_bf16(b[k1 * rs + col * cs]) } else { 0 };
            *o = u32::from(lo) | (u32::from(hi) << 16);
        }
    }
    panel
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PANEL, ROWS};
    use std::arch::x86_64::*;

    /// [`super::to_bf16`] of 16 lanes, each result in the low half of its 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn round_lanes(x: __m512) -> __m512i {
        let bits = _mm512_castps_si512(x);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
        _mm512_mask_blend_epi32(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), rounded, quiet)
    }

    /// The mask of the first `n` (≤ 16) lanes.
    fn lanes(n: usize) -> __mmask16 {
        ((1u32 << n.min(16)) - 1) as u16
    }

    /// `out` = `x` in bf16, two to a `u32` (even element in the low half; a zero pads an odd
    /// length).
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `out` must hold `x.len().div_ceil(2)` values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn convert_row(out: &mut [u32], x: &[f32]) {
        assert!(out.len() >= x.len().div_ceil(2));
        let dst = out.as_mut_ptr().cast::<u16>();
        for c in (0..x.len()).step_by(16) {
            let mask = lanes(x.len() - c);
            let v = round_lanes(_mm512_maskz_loadu_ps(mask, x.as_ptr().add(c)));
            // Narrowed to 16 bits a lane, in order: exactly the pairs' layout in memory.
            _mm512_mask_cvtepi32_storeu_epi16(dst.add(c).cast(), mask, v);
        }
        if x.len() % 2 == 1 {
            *dst.add(x.len()) = 0;
        }
    }

    /// `out[j] = bf16(lo[j]) | bf16(hi[j]) << 16` (`hi` absent: zeros) for the columns of `lo`;
    /// `out` past them is left as it is.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `out` must hold `lo.len()` values and `hi` be as long as `lo`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn interleave_rows(out: &mut [u32], lo: &[f32], hi: Option<&[f32]>) {
        let n = lo.len();
        assert!(out.len() >= n && hi.is_none_or(|h| h.len() == n));
        for c in (0..n).step_by(16) {
            let mask = lanes(n - c);
            let low = round_lanes(_mm512_maskz_loadu_ps(mask, lo.as_ptr().add(c)));
            let high = match hi {
                Some(h) => _mm512_slli_epi32::<16>(round_lanes(_mm512_maskz_loadu_ps(mask, h.as_ptr().add(c)))),
                None => _mm512_setzero_si512(),
            };
            _mm512_mask_storeu_epi32(out.as_mut_ptr().add(c).cast(), mask, _mm512_or_si512(low, high));
        }
    }

    /// One block: `rows` (≤ 8) rows × `cols` (≤ 48) columns of c (row stride `ldc`) `(+)=` the
    /// packed rows of a (`pairs` pairs each, `stride` apart) times the packed panel.
    ///
    /// # Safety
    /// The CPU must have AVX-512F and AVX512_BF16; `a` must hold [`ROWS`] rows of `pairs` values
    /// `stride` apart, `panel` `pairs · PANEL` values, and c `rows` rows of `cols` at stride `ldc`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn block(
        c: *mut f32,
        ldc: usize,
        (rows, cols): (usize, usize),
        accumulate: bool,
        a: *const u32,
        (pairs, stride): (usize, usize),
        panel: *const u32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 3]; ROWS];
        for p in 0..pairs {
            let b = panel.add(p * PANEL);
            let bv: [__m512bh; 3] = [
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(16).cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(32).cast())),
            ];
            for (r, row) in acc.iter_mut().enumerate() {
                let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*a.add(r * stride + p) as i32));
                for (sum, &bj) in row.iter_mut().zip(&bv) {
                    *sum = _mm512_dpbf16_ps(*sum, av, bj);
                }
            }
        }
        let mask = |j: usize| -> __mmask16 { ((1u32 << cols.saturating_sub(16 * j).min(16)) - 1) as u16 };
        let masks = [mask(0), mask(1), mask(2)];
        for (r, row) in acc.iter().enumerate().take(rows) {
            let out = c.add(r * ldc);
            for (j, &sum) in row.iter().enumerate() {
                // Columns past `cols` are masked off: their addresses are only computed.
                let at = out.wrapping_add(16 * j);
                let value = if accumulate { _mm512_add_ps(_mm512_maskz_loadu_ps(masks[j], at), sum) } else { sum };
                _mm512_mask_storeu_ps(at, masks[j], value);
            }
        }
    }
}

/// The plain loop over the bf16-rounded operands, in f64: what [`gemm`] is tested against.
pub fn reference(
    c: &mut [f32],
    accumulate: bool,
    (a, (ars, acs)): Strided<'_>,
    (b, (brs, bcs)): Strided<'_>,
    (m, k, n): (usize, usize, usize),
) {
    for i in 0..m {
        for j in 0..n {
            let mut sum = if accumulate { f64::from(c[i * n + j]) } else { 0.0 };
            for p in 0..k {
                let x = from_bf16(to_bf16(a[i * ars + p * acs]));
                let y = from_bf16(to_bf16(b[p * brs + j * bcs]));
                sum += f64::from(x) * f64::from(y);
            }
            c[i * n + j] = sum as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::values;

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is halfway between two bf16: ties go to the even one (1.0).
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
        // 1 + 3·2^-8 is halfway too: up to the even 1 + 2^-6.
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3F82);
        assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
        assert_eq!(from_bf16(to_bf16(f32::INFINITY)), f32::INFINITY);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_vector_conversions_round_as_the_scalar_one() {
        if !supported() {
            eprintln!("no AVX512_BF16 on this CPU: the vector conversions are not reachable here");
            return;
        }
        let specials = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::NAN, f32::INFINITY, -0.0, 1e-40, f32::MAX];
        let x: Vec<f32> = specials.iter().copied().chain(values(30, 9).into_iter().map(|v| v * 3.7)).collect();
        let want: Vec<u16> = x.iter().map(|&v| to_bf16(v)).collect();
        let pair = |lo: u16, hi: u16| u32::from(lo) | (u32::from(hi) << 16);
        let mut row = vec![u32::MAX; x.len().div_ceil(2)];
        // SAFETY: the features were checked; `row` holds the pairs.
        unsafe { avx512::convert_row(&mut row, &x) };
        let expect: Vec<u32> = want.chunks(2).map(|c| pair(c[0], c.get(1).copied().unwrap_or(0))).collect();
        assert_eq!(row, expect);
        let (lo, hi) = x.split_at(x.len() / 2);
        let hi = &hi[..lo.len()];
        let mut out = vec![u32::MAX; lo.len()];
        // SAFETY: as above; `out` holds a value per column.
        unsafe { avx512::interleave_rows(&mut out, lo, Some(hi)) };
        let expect: Vec<u32> = lo.iter().zip(hi).map(|(&a, &b)| pair(to_bf16(a), to_bf16(b))).collect();
        assert_eq!(out, expect);
    }

    #[test]
    fn kernel_matches_the_reference() {
        if !supported() {
            eprintln!("no AVX512_BF16 on this CPU: the bf16 GEMM kernel is not reachable here");
            return;
        }
        // Shapes with row and column tails, odd k, and one bigger than a panel in every way.
        // k = 2,100: 1,050 pairs, two passes over a panel (1,024 pairs a pass, then 26).
        for &(m, k, n) in
            &[(1, 1, 1), (3, 5, 7), (8, 64, 48), (9, 33, 50), (17, 130, 100), (40, 576, 200), (9, 2100, 50)]
        {
            for accumulate in [false, true] {
                for transposed in [false, true] {
                    let a = values(m * k, 1);
                    let b = values(k * n, 2);
                    // b as stored, or as the transpose of an [n, k] matrix (strides (1, k)); and
                    let (b, bs) = if transposed {
                        let mut t = vec![0.0; k * n];
                        for p in 0..k {
                            for j in 0..n {
                                t[j * k + p] = b[p * n + j];
                            }
                        }
                        (t, (1, k))
                    } else {
                        (b, (n, 1))
                    };
                    // a likewise: as stored, or as the transpose of a [k, m] matrix (strides (1, m)).
                    let (a, a_strides) = if transposed {
                        let mut t = vec![0.0; m * k];
                        for i in 0..m {
                            for p in 0..k {
                                t[p * m + i] = a[i * k + p];
                            }
                        }
                        (t, (1, m))
                    } else {
                        (a, (k, 1))
                    };
                    let start = values(m * n, 3);
                    let mut want = start.clone();
                    reference(&mut want, accumulate, (&a, a_strides), (&b, bs), (m, k, n));
                    let mut got = start.clone();
                    assert!(gemm(&mut got, accumulate, (&a, a_strides), (&b, bs), (m, k, n)));
                    let mut got_packed = start.clone();
                    let packed = pack_b((&b, bs), (k, n)).expect("supported");
                    gemm_packed(&mut got_packed, accumulate, (&a, a_strides), &packed, m);
                    for (got, how) in [(got, "packed per call"), (got_packed, "packed once")] {
                        let err = got.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                        // f32 sums of k products of bf16 values ≤ 1: within k · 2^-24 · k of the f64 sum.
                        let tolerance = 1e-6 * (k as f32).max(1.0);
                        assert!(
                            err <= tolerance,
                            "({m}, {k}, {n}), accumulate {accumulate}, transposed {transposed}, {how}: {err}"
                        );
                    }
                }
            }
        }
    }
}
