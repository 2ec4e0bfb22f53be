//! `y (+)= x · w` for a handful of f32 rows and a weight kept in bf16: the decode step of a model
//! imported with `--dtype bf16`, reading half the bytes of its f32 weights.
//!
//! A decode step is bound by reading the weights ([`crate::few_rows`]), so a bf16 weight should
//! cost half as much, but only if its values are never written out as f32 first. Here the weight
//! is widened in registers (a bf16 is the top half of an f32) and multiplied into f32 sums by FMA,
//! so the result is the f32 product of the bf16 values up to the order of the sums. A vector of 2N
//! bf16 values is widened in place, two operations for 2N values: the odd positions' values are
//! already f32 in the top halves of the 32-bit lanes (the even ones masked off), the even ones
//! shifted up 16 bits; the sums of even and odd columns are kept apart and put back in order once
//! a block is done. The layout of the work is [`crate::few_rows`]' f32 kernel's: each thread takes
//! a contiguous range of the weight's rows, walks it in blocks (the next prefetched in address
//! order while one is multiplied), and keeps `rows × 4` vectors of sums in registers while the
//! block's rows stream past; every pass of up to 6 (AVX2: 2) input rows runs over a block while it
//! is cached, so the weight is read from memory once per call.
//!
//! Chosen at run time by the caller's [`Cpu`]: AVX-512 F (16 lanes), AVX2 + FMA (8 lanes), or a
//! plain loop on the baseline. [`reference`] is the plain f64 loop all are tested against.

use burn::tensor::bf16;

use crate::compute::Cpu;
#[cfg(target_arch = "x86_64")]
use crate::simd::{self, Tier};

/// The f32 value of a bf16 (exact: its bits are the f32's top half).
#[inline(always)]
fn widen(v: bf16) -> f32 {
    f32::from_bits(u32::from(v.to_bits()) << 16)
}

/// `y (+)= x · w` with x `[m, k]` f32, w `[k, n]` bf16, y `[m, n]`, all row-major; `accumulate`
/// adds to y's contents instead of overwriting them.
///
/// # Panics
/// If a slice is shorter than its shape (the callers' shape checks make this unreachable from input).
pub(crate) fn product(
    cpu: Cpu,
    y: &mut [f32],
    accumulate: bool,
    x: &[f32],
    w: &[bf16],
    (m, k, n): (usize, usize, usize),
) {
    assert!(y.len() == m * n && x.len() >= m * k && w.len() >= k * n, "bf16_rows: slices shorter than their shapes");
    if m == 0 || n == 0 {
        return;
    }
    if !accumulate {
        y.fill(0.0);
    }
    if k == 0 {
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = cpu;
    #[cfg(target_arch = "x86_64")]
    match simd::detected().min(cpu.tier) {
        Tier::Avx512 => return wide::product::<wide::Avx512>(y, x, w, (m, k, n)),
        Tier::Avx2 => return wide::product::<wide::Avx2>(y, x, w, (m, k, n)),
        Tier::Baseline => {}
    }
    plain(y, x, w, (m, k, n));
}

/// The baseline: `y[i] += x[i][kk] · w[kk]` row after row, a loop the compiler vectorises.
fn plain(y: &mut [f32], x: &[f32], w: &[bf16], (_, k, n): (usize, usize, usize)) {
    let mut row = vec![0.0f32; n];
    for kk in 0..k {
        row.iter_mut().zip(&w[kk * n..(kk + 1) * n]).for_each(|(r, &v)| *r = widen(v));
        for (y, x) in y.chunks_exact_mut(n).zip(x.chunks(k)) {
            let a = x[kk];
            y.iter_mut().zip(&row).for_each(|(y, &b)| *y += a * b);
        }
    }
}

/// The plain triple loop on the widened weight, in f64: what the kernels are tested against.
#[cfg(test)]
pub(crate) fn reference(y: &mut [f32], accumulate: bool, x: &[f32], w: &[bf16], (m, k, n): (usize, usize, usize)) {
    for i in 0..m {
        for j in 0..n {
            let mut sum = if accumulate { f64::from(y[i * n + j]) } else { 0.0 };
            for p in 0..k {
                sum += f64::from(x[i * k + p]) * f64::from(widen(w[p * n + j]));
            }
            y[i * n + j] = sum as f32;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use super::bf16;
    use crate::SharedOut;
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    /// One instruction set's kernel; the threads, blocks and passes around it are shared.
    ///
    /// # Safety
    /// [`Isa::stripe`] may only be called where the CPU has the set.
    pub(super) unsafe trait Isa {
        /// Input rows one pass carries in registers.
        const ROWS: usize;
        /// Columns of one stripe: four vectors.
        const STRIPE: usize;

        /// The [`Stripe`] for R rows.
        ///
        /// # Safety
        /// The CPU must have the features; as for [`stripe`].
        unsafe fn stripe<const R: usize>(s: Stripe<'_>, prefetch: &mut Prefetch);
    }

    /// AVX-512 F: 16 lanes, 6 rows a pass (24 accumulators of the 32 registers).
    pub(super) struct Avx512;

    /// AVX2 and FMA: 8 lanes, 2 rows a pass (8 accumulators of the 16 registers).
    pub(super) struct Avx2;

    /// One stripe of a pass: `y[r][0..width] += Σ_kk xt[kk·R + r] · w[kk·ldw + 0..width]` for the
    /// pass's R rows, over `k` rows of the weight.
    #[derive(Clone, Copy)]
    pub(super) struct Stripe<'a> {
        y: *mut f32,
        ldy: usize,
        /// The pass's rows transposed: `xt[kk·R + r]` is row r's multiplier of weight row kk.
        xt: &'a [f32],
        w: *const bf16,
        ldw: usize,
        k: usize,
        width: usize,
    }

    /// Lines of the next block to prefetch, in address order, a few at each step of the current
    /// one, so that memory sees one sequential stream though the kernel walks down columns.
    pub(super) struct Prefetch {
        next: *const i8,
        lines: usize,
        done: usize,
        /// Lines a step: as many as a stripe's row spans.
        per_step: usize,
    }

    impl Prefetch {
        #[inline(always)]
        unsafe fn step(&mut self) {
            for _ in 0..self.per_step {
                if self.done < self.lines {
                    _mm_prefetch::<_MM_HINT_T1>(self.next.wrapping_add(64 * self.done));
                    self.done += 1;
                }
            }
        }
    }

    /// Weight rows of a block: one block is multiplied while the next is prefetched (32 bf16 rows
    /// span the bytes of the f32 kernel's 16).
    const BLOCK_ROWS: usize = 32;

    pub(super) fn product<I: Isa>(y: &mut [f32], x: &[f32], w: &[bf16], (m, k, n): (usize, usize, usize)) {
        // The inputs transposed, a pass of rows at a time: `xt[kk·rows + r] = x[r0 + r][kk]`.
        let passes: Vec<(usize, Vec<f32>)> = (0..m)
            .step_by(I::ROWS)
            .map(|r0| {
                let rows = I::ROWS.min(m - r0);
                let mut xt = vec![0.0f32; k * rows];
                for r in 0..rows {
                    for (kk, &v) in x[(r0 + r) * k..(r0 + r + 1) * k].iter().enumerate() {
                        xt[kk * rows + r] = v;
                    }
                }
                (r0, xt)
            })
            .collect();
        // Each thread takes a contiguous range of the weight's rows (whole blocks) and sums its
        // share of every output; the first adds into y, the others into buffers added after.
        let blocks = k.div_ceil(BLOCK_ROWS);
        let threads = if k * n >= 1 << 18 { rayon::current_num_threads().clamp(1, blocks) } else { 1 };
        let range = |t: usize| (blocks * t / threads * BLOCK_ROWS, (blocks * (t + 1) / threads * BLOCK_ROWS).min(k));
        let out = SharedOut(y.as_mut_ptr());
        let run = |t: usize| -> Option<Vec<f32>> {
            let mut own = (t > 0).then(|| vec![0.0f32; m * n]);
            let dst = own.as_mut().map_or(out, |buffer| SharedOut(buffer.as_mut_ptr()));
            // SAFETY: the caller chose `I` by the CPU's tier; every pass's rows of dst (m·n: y or
            // this task's own buffer), the weight rows range(t) (inside k) and every column lie
            // inside their slices by product's assertion; only task 0 writes y.
            unsafe { block_passes::<I>(dst, &passes, w, (k, n), range(t)) }
            own
        };
        let partials: Vec<Vec<f32>> = match threads {
            1 => run(0).into_iter().collect(),
            _ => (0..threads).into_par_iter().filter_map(run).collect(),
        };
        for partial in partials {
            y.iter_mut().zip(&partial).for_each(|(a, b)| *a += b);
        }
    }

    /// Every pass of rows (`(r0, xt)`) of `x · w` over the weight rows `[k0, k1)`, every column,
    /// block by block, added to y: all passes of a block run while it is in cache.
    ///
    /// # Safety
    /// The CPU must have `I`'s features; the passes, weight rows and columns must lie inside y and w.
    unsafe fn block_passes<I: Isa>(
        y: SharedOut,
        passes: &[(usize, Vec<f32>)],
        w: &[bf16],
        (k, n): (usize, usize),
        (k0, k1): (usize, usize),
    ) {
        let mut kb = k0;
        while kb < k1 {
            let block = (k1 - kb).min(BLOCK_ROWS);
            let next_rows = (k1 - kb - block).min(BLOCK_ROWS);
            let mut prefetch = Prefetch {
                next: w.as_ptr().wrapping_add((kb + block) * n) as *const i8,
                lines: (next_rows * n).div_ceil(32),
                done: 0,
                per_step: I::STRIPE.div_ceil(32),
            };
            for (r0, xt) in passes {
                let rows = xt.len() / k;
                let xt = &xt[kb * rows..(kb + block) * rows];
                let (mut c, y, w) = (0, y.at(r0 * n), w.as_ptr().add(kb * n));
                while c < n {
                    let width = (n - c).min(I::STRIPE);
                    let s = Stripe { y: y.add(c), ldy: n, xt, w: w.add(c), ldw: n, k: block, width };
                    match rows {
                        1 => I::stripe::<1>(s, &mut prefetch),
                        2 => I::stripe::<2>(s, &mut prefetch),
                        3 => I::stripe::<3>(s, &mut prefetch),
                        4 => I::stripe::<4>(s, &mut prefetch),
                        5 => I::stripe::<5>(s, &mut prefetch),
                        _ => I::stripe::<6>(s, &mut prefetch),
                    }
                    c += width;
                }
            }
            kb += block;
        }
    }

    /// One instruction set's vectors, in which [`stripe`] is written once for both sets.
    ///
    /// # Safety
    /// The methods may only run where the CPU has the set, inlined into a function that enables it.
    unsafe trait Lanes {
        type V: Copy;
        /// Lanes of a vector.
        const N: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn load(p: *const f32) -> Self::V;
        unsafe fn store(p: *mut f32, v: Self::V);
        unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
        /// 2N bf16 values from `p` (one integer vector) widened to f32 without reordering lanes:
        /// `[even, odd]`, the values at even and at odd positions. A bf16 at an odd position is
        /// already its f32 in the top half of a 32-bit lane (its neighbour masked off), one at an
        /// even position shifted there: two operations for 2N values.
        unsafe fn load_pair(p: *const bf16) -> [Self::V; 2];
        /// `[even, odd]` back in order: the first N and the next N values.
        unsafe fn interleave(even: Self::V, odd: Self::V) -> [Self::V; 2];
        /// The value at `p` in every lane.
        unsafe fn splat(p: *const f32) -> Self::V;
        /// `a · b + c`, fused.
        unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    }

    // SAFETY: AVX-512 F intrinsics only, inlined into `Avx512::stripe`, which enables `avx512f`.
    unsafe impl Lanes for Avx512 {
        type V = __m512;
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn load_pair(p: *const bf16) -> [__m512; 2] {
            let v = _mm512_loadu_si512(p as *const __m512i);
            let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000_u32 as i32));
            [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)), _mm512_castsi512_ps(odd)]
        }
        #[inline(always)]
        unsafe fn interleave(even: __m512, odd: __m512) -> [__m512; 2] {
            // Lane i of the result: even[i/2] or, for odd i, odd[i/2] (index bit 4 picks `odd`).
            let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            [_mm512_permutex2var_ps(even, lo, odd), _mm512_permutex2var_ps(even, hi, odd)]
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m512 {
            _mm512_set1_ps(*p)
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
    }

    // SAFETY: AVX, AVX2 and FMA intrinsics only, inlined into `Avx2::stripe`, which enables them.
    unsafe impl Lanes for Avx2 {
        type V = __m256;
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn load_pair(p: *const bf16) -> [__m256; 2] {
            let v = _mm256_loadu_si256(p as *const __m256i);
            let odd = _mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000_u32 as i32));
            [_mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)), _mm256_castsi256_ps(odd)]
        }
        #[inline(always)]
        unsafe fn interleave(even: __m256, odd: __m256) -> [__m256; 2] {
            // Within each 128-bit half: [e0 o0 e1 o1 | e4 o4 e5 o5] and [e2 o2 e3 o3 | e6 o6 e7 o7].
            let (low, high) = (_mm256_unpacklo_ps(even, odd), _mm256_unpackhi_ps(even, odd));
            [_mm256_permute2f128_ps::<0x20>(low, high), _mm256_permute2f128_ps::<0x31>(low, high)]
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m256 {
            _mm256_broadcast_ss(&*p)
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
    }

    /// Columns of the widest stripe (AVX-512's four vectors): the size of a cut stripe's buffers.
    const MAX_STRIPE: usize = 64;

    /// [`Isa::stripe`] in `L`'s vectors: two pairs (4N columns) a stripe, the sums of even and odd
    /// columns apart, put in order and added to y at the end.
    ///
    /// # Safety
    /// The CPU must have `L`'s features (inlined into a function that enables them); `s.xt` must
    /// hold `s.k·R` values, `s.w` `s.k` rows of `s.width` at stride `s.ldw`, `s.y` R rows of
    /// `s.width` at stride `s.ldy`; `s.width ≤ 4·L::N ≤ MAX_STRIPE`, `s.k ≤ BLOCK_ROWS`.
    #[inline(always)]
    unsafe fn stripe<L: Lanes, const R: usize>(s: Stripe<'_>, prefetch: &mut Prefetch) {
        if s.width < 4 * L::N {
            return cut_stripe::<L, R>(s, prefetch);
        }
        let Stripe { y, ldy, xt, w, ldw, k, .. } = s;
        // acc[r]: [even, odd] of the first 2N columns, then of the next 2N.
        let mut acc = [[L::zero(); 4]; R];
        let xt = xt.as_ptr();
        for kk in 0..k {
            let row = w.add(kk * ldw);
            prefetch.step();
            let ([e0, o0], [e1, o1]) = (L::load_pair(row), L::load_pair(row.add(2 * L::N)));
            let b = [e0, o0, e1, o1];
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = L::splat(xt.add(kk * R + r));
                for v in 0..4 {
                    acc[v] = L::fmadd(a, b[v], acc[v]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for pair in 0..2 {
                let ordered = L::interleave(acc[2 * pair], acc[2 * pair + 1]);
                for (half, sums) in ordered.into_iter().enumerate() {
                    let at = y.add(r * ldy + (2 * pair + half) * L::N);
                    L::store(at, L::add(L::load(at), sums));
                }
            }
        }
    }

    /// A stripe cut short by the end of the columns: the whole stripe on zero-padded copies of
    /// its weight rows and outputs, so that no load or store leaves the slices.
    ///
    /// # Safety
    /// As for [`stripe`].
    #[inline(never)]
    unsafe fn cut_stripe<L: Lanes, const R: usize>(s: Stripe<'_>, prefetch: &mut Prefetch) {
        let (width, k) = (s.width, s.k);
        let mut w = [bf16::ZERO; BLOCK_ROWS * MAX_STRIPE];
        for kk in 0..k {
            std::ptr::copy_nonoverlapping(s.w.add(kk * s.ldw), w.as_mut_ptr().add(kk * MAX_STRIPE), width);
        }
        let mut y = [[0.0f32; MAX_STRIPE]; R];
        for (r, row) in y.iter_mut().enumerate() {
            std::ptr::copy_nonoverlapping(s.y.add(r * s.ldy), row.as_mut_ptr(), width);
        }
        let padded =
            Stripe { y: y[0].as_mut_ptr(), ldy: MAX_STRIPE, w: w.as_ptr(), ldw: MAX_STRIPE, width: 4 * L::N, ..s };
        stripe::<L, R>(padded, prefetch);
        for (r, row) in y.iter().enumerate() {
            std::ptr::copy_nonoverlapping(row.as_ptr(), s.y.add(r * s.ldy), width);
        }
    }

    // SAFETY: the kernels enable the features `simd::detected()` vouches for with each set.
    unsafe impl Isa for Avx512 {
        const ROWS: usize = 6;
        const STRIPE: usize = 64;

        #[target_feature(enable = "avx512f")]
        unsafe fn stripe<const R: usize>(s: Stripe<'_>, prefetch: &mut Prefetch) {
            stripe::<Avx512, R>(s, prefetch)
        }
    }

    // SAFETY: as above.
    unsafe impl Isa for Avx2 {
        const ROWS: usize = 2;
        const STRIPE: usize = 32;

        #[target_feature(enable = "avx2,fma")]
        unsafe fn stripe<const R: usize>(s: Stripe<'_>, prefetch: &mut Prefetch) {
            stripe::<Avx2, R>(s, prefetch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{self, Tier};
    use crate::testing::values;

    /// Row counts of a pass and past it (AVX-512 carries 8, AVX2 4), stripes whole and cut (widths
    /// not multiples of the lanes or of a stripe: 48 and 16, 24 and 8), one thread and two (the
    /// split starts at k·n = 2^18), blocks whole and cut, SmolLM2's projections.
    const SHAPES: [(usize, usize, usize); 14] = [
        (1, 7, 5),
        (1, 576, 1536),
        (1, 1536, 576),
        (5, 1000, 300),
        (2, 3000, 90),
        (2, 64, 48),
        (3, 33, 100),
        (5, 17, 16),
        (7, 64, 49),
        (8, 576, 192),
        (9, 40, 97),
        (16, 576, 576),
        (13, 512, 1030),
        (4, 1, 3),
    ];

    #[test]
    fn every_tier_matches_the_reference() {
        for tier in Tier::ALL.into_iter().filter(|&t| t <= simd::detected()) {
            eprintln!("bf16 few-rows kernels: {tier:?}");
            let cpu = Cpu::detect().capped(tier);
            for (m, k, n) in SHAPES {
                let x = values(m * k, 1);
                let w: Vec<bf16> = values(k * n, 2).into_iter().map(bf16::from_f32).collect();
                for accumulate in [false, true] {
                    let (mut got, mut want) = (values(m * n, 3), values(m * n, 3));
                    product(cpu, &mut got, accumulate, &x, &w, (m, k, n));
                    reference(&mut want, accumulate, &x, &w, (m, k, n));
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        let what = format!("{tier:?} {m}x{k}x{n} acc={accumulate} [{i}]");
                        assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{what}: {g} vs {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_product_is_the_f32_kernels_on_the_widened_weight() {
        // The same products as the f32 few-rows kernel of the weight widened (only the order of
        // the sums may differ), and an empty inner dimension zeroes y.
        let (m, k, n) = (3, 576, 200);
        let (x, w) = (values(m * k, 4), values(k * n, 5));
        let w16: Vec<bf16> = w.iter().copied().map(bf16::from_f32).collect();
        let widened: Vec<f32> = w16.iter().map(|&v| v.to_f32()).collect();
        let (mut got, mut want) = (vec![0.0; m * n], vec![0.0; m * n]);
        product(Cpu::detect(), &mut got, false, &x, &w16, (m, k, n));
        crate::few_rows::product(Cpu::detect(), &mut want, false, &x, &widened, (m, k, n));
        for (g, e) in got.iter().zip(&want) {
            assert!((g - e).abs() <= 1e-5 * (1.0 + e.abs()), "{g} vs {e}");
        }
        let mut y = vec![1.0; 6];
        product(Cpu::detect(), &mut y, false, &[], &[], (2, 0, 3));
        assert_eq!(y, vec![0.0; 6], "k = 0 is a product of empty sums");
    }

    /// The projections of a SmolLM2-135M decode step (30 layers of q, k, v, o, gate, up, down;
    /// 425 MB in f32), f32 weights on the f32 few-rows kernel against bf16 weights here, alternating:
    /// `cargo test --release -p ember-kernels --lib bf16_rows::tests::time_ -- --ignored --nocapture`.
    #[test]
    #[ignore = "a timing, not a test"]
    fn time_a_decode_steps_projections() {
        let shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)];
        let layers: Vec<(usize, usize, Vec<f32>, Vec<bf16>)> = (0..30)
            .flat_map(|l| shapes.map(|(k, n)| (l, k, n)))
            .map(|(l, k, n)| {
                let w = values(k * n, l as u32);
                let w16 = w.iter().copied().map(bf16::from_f32).collect();
                (k, n, w, w16)
            })
            .collect();
        let cpu = Cpu::detect();
        for m in [1, 4, 16] {
            let x = values(m * 1536, 9);
            let mut best = [f64::INFINITY; 2];
            for _ in 0..10 {
                for (i, best) in best.iter_mut().enumerate() {
                    let start = std::time::Instant::now();
                    for (k, n, w, w16) in &layers {
                        let mut y = vec![0.0f32; m * n];
                        match i {
                            0 => crate::few_rows::product(cpu, &mut y, false, &x, w, (m, *k, *n)),
                            _ => product(cpu, &mut y, false, &x, w16, (m, *k, *n)),
                        }
                        std::hint::black_box(&y);
                    }
                    *best = best.min(start.elapsed().as_secs_f64() * 1e3);
                }
            }
            eprintln!("{m} rows: f32 weights {:.2} ms, bf16 weights {:.2} ms (best of 10)", best[0], best[1]);
        }
    }
}
