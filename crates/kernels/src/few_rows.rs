//! `y (+)= x · w` and `y = x · wᵀ` for a handful of rows (decoding several sequences at once),
//! reading the weight once for all rows.
//!
//! A decode step multiplies a few rows by every weight of the model, so it is bound by reading the
//! weights, and the rows should share that read. General GEMM kernels vectorise along the rows of
//! the output (dozens at a time), which are mostly padding here; run transposed they pack the weight
//! first. The AVX-512 kernel below keeps a block of `rows × 48` outputs in registers, walks down the
//! weight's rows reading 48 contiguous columns of each (three cache lines), and multiplies each by
//! every input row's broadcast element. Walking down columns defeats the hardware prefetchers, so
//! the weight goes in blocks of 16 rows, the next block prefetched into L2 in
//! address order while one is multiplied: memory sees one sequential stream. Every pass of up to 8
//! rows runs over a block while it is cached, so the weight is read from memory
//! once per call; each thread takes a contiguous range of the weight's rows and the partial sums are
//! added. The tied head (`x · Wᵀ`, W as stored) has its own kernel: dot products of a few input rows
//! with two weight rows at a time.
//!
//! The AVX2 + FMA kernels are the same with half the width: stripes of 24 columns (three 8-lane
//! vectors) and up to 4 input rows a pass (12 accumulators of the 16 registers). The threads,
//! blocks, prefetching and passes are shared (`wide`); only the innermost loops differ
//! (`wide::Isa`).
//!
//! Chosen at run time by the caller's [`Cpu`]: the AVX-512 kernels, the AVX2 ones, or the GEMM
//! crate's transposed products on the baseline. [`reference`] and [`reference_nt`] are the plain
//! loops all are tested against.

use crate::compute::Cpu;
#[cfg(target_arch = "x86_64")]
use crate::simd::{self, Tier};

/// `y (+)= x · w` with x `[m, k]`, w `[k, n]`, y `[m, n]`, all row-major; `accumulate` adds to y's
/// contents instead of overwriting them.
///
/// # Panics
/// If a slice is shorter than its shape (the callers' shape checks make this unreachable from input).
pub(crate) fn product(
    cpu: Cpu,
    y: &mut [f32],
    accumulate: bool,
    x: &[f32],
    w: &[f32],
    (m, k, n): (usize, usize, usize),
) {
    assert!(y.len() == m * n && x.len() >= m * k && w.len() >= k * n, "few_rows: slices shorter than their shapes");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            y.fill(0.0);
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = cpu;
    #[cfg(target_arch = "x86_64")]
    match simd::detected().min(cpu.tier) {
        Tier::Avx512 => return wide::product::<wide::Avx512>(y, accumulate, x, w, (m, k, n)),
        Tier::Avx2 => return wide::product::<wide::Avx2>(y, accumulate, x, w, (m, k, n)),
        Tier::Baseline => {}
    }
    transposed_gemm(y, accumulate, x, w, (m, k, n));
}

/// `y = x · wᵀ` with x `[m, k]`, w `[n, k]` (a tied head: the embedding table as stored), y `[m, n]`.
///
/// # Panics
/// If a slice is shorter than its shape (the callers' shape checks make this unreachable from input).
pub(crate) fn product_nt(cpu: Cpu, y: &mut [f32], x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
    assert!(y.len() == m * n && x.len() >= m * k && w.len() >= k * n, "few_rows: slices shorter than their shapes");
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = cpu;
    #[cfg(target_arch = "x86_64")]
    match simd::detected().min(cpu.tier) {
        Tier::Avx512 if k > 0 => return wide::product_nt::<wide::Avx512>(y, x, w, (m, k, n)),
        Tier::Avx2 if k > 0 => return wide::product_nt::<wide::Avx2>(y, x, w, (m, k, n)),
        _ => {}
    }
    transposed_gemm_nt(y, x, w, (m, k, n));
}

/// `y = x · wᵀ` as the plain loop, in f64: what [`product_nt`] is tested against.
#[cfg(test)]
pub(crate) fn reference_nt(y: &mut [f32], x: &[f32], w: &[f32], (_, k, n): (usize, usize, usize)) {
    for (y, x) in y.chunks_mut(n.max(1)).zip(x.chunks(k.max(1))) {
        for (j, out) in y.iter_mut().enumerate() {
            let row = &w[j * k..(j + 1) * k];
            *out = row.iter().zip(x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() as f32;
        }
    }
}

/// The plain triple loop, in f64: what the kernels are tested against.
#[cfg(test)]
pub(crate) fn reference(y: &mut [f32], accumulate: bool, x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
    for i in 0..m {
        for j in 0..n {
            let mut sum = if accumulate { f64::from(y[i * n + j]) } else { 0.0 };
            for p in 0..k {
                sum += f64::from(x[i * k + p]) * f64::from(w[p * n + j]);
            }
            y[i * n + j] = sum as f32;
        }
    }
}

/// The portable path: `yᵀ = wᵀ · xᵀ` through the GEMM crate's strides, so that its kernels vectorise
/// along the layer's outputs instead of the few rows.
pub(crate) fn transposed_gemm(y: &mut [f32], accumulate: bool, x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
    assert!(y.len() == m * n && x.len() >= m * k && w.len() >= k * n, "few_rows: slices shorter than their shapes");
    transposed_product((n, m, k), (y, (1, n)), accumulate, (w, (1, n)), (x, (1, k)));
}

/// The portable path of [`product_nt`]: `yᵀ = w · xᵀ` through the GEMM crate's strides (its kernels
/// vectorise along w's many rows; w is read where it is).
pub(crate) fn transposed_gemm_nt(y: &mut [f32], x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
    assert!(y.len() == m * n && x.len() >= m * k && w.len() >= k * n, "few_rows: slices shorter than their shapes");
    transposed_product((n, m, k), (y, (1, n)), false, (w, (k, 1)), (x, (1, k)));
}

/// `dst (+)= lhs · rhs` (`[rows, cols]`, inner dimension `inner`) through the GEMM front, each
/// operand given with its (row, column) strides; on all threads when the weight is large.
fn transposed_product(
    (rows, cols, inner): (usize, usize, usize),
    dst: (&mut [f32], (usize, usize)),
    accumulate: bool,
    lhs: crate::bf16_gemm::Strided<'_>,
    rhs: crate::bf16_gemm::Strided<'_>,
) {
    let parallelism = if rows * inner >= 1 << 18 { gemm::Parallelism::Rayon(0) } else { gemm::Parallelism::None };
    crate::products::gemm_strided((rows, cols, inner), dst, accumulate, lhs, rhs, 1.0, parallelism);
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use crate::SharedOut;
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    /// The innermost loops of one instruction set; the rest of the kernels is shared.
    ///
    /// # Safety
    /// Implementors' kernels may only be called where the CPU has their set (`simd::detected()` is it or a wider one).
    pub(super) unsafe trait Isa {
        /// Input rows one pass carries in registers.
        const ROWS: usize;
        /// Columns of one stripe: three vectors.
        const STRIPE: usize;

        /// The [`Stripe`] `s` for R rows, the R × [`Isa::STRIPE`] sums held in registers while the
        /// weight's rows stream past.
        ///
        /// # Safety
        /// The CPU must have the features; `s.xt` must hold `s.k·R` values, `s.w` `s.k` rows of
        /// `s.width` at stride `s.ldw`, `s.y` R rows of `s.width` at stride `s.ldy`;
        /// `s.width ≤ STRIPE`, `R ≤ ROWS`.
        unsafe fn stripe<const R: usize>(s: Stripe<'_>, prefetch: &mut Prefetch);

        /// `y[r·ldy + j] = x[r] · w[j]` for R rows of x and J rows of w, each of length k: R × J
        /// accumulators along k, summed across lanes at the end.
        ///
        /// # Safety
        /// The CPU must have the features; `x` must hold R rows of k, `w` J rows of k (both
        /// contiguous), `y` R rows at stride `ldy` with J columns; `R ≤ ROWS`.
        unsafe fn dots<const R: usize, const J: usize>(y: *mut f32, ldy: usize, x: *const f32, w: *const f32, k: usize);
    }

    /// AVX-512 F: 16 lanes, 8 rows a pass (24 accumulators of the 32 registers).
    pub(super) struct Avx512;

    /// AVX2 and FMA: 8 lanes, 4 rows a pass (12 accumulators of the 16 registers).
    pub(super) struct Avx2;

    /// One stripe of a pass: `y[r][0..width] (+)= Σ_kk xt[kk·R + r] · w[kk·ldw + 0..width]` for the
    /// pass's R rows, over `k` rows of the weight.
    #[derive(Clone, Copy)]
    pub(super) struct Stripe<'a> {
        y: *mut f32,
        ldy: usize,
        /// The pass's rows transposed: `xt[kk·R + r]` is row r's multiplier of weight row kk.
        xt: &'a [f32],
        w: *const f32,
        ldw: usize,
        k: usize,
        width: usize,
        /// Add to y's contents instead of overwriting them.
        accumulate: bool,
    }

    /// The stripe kernel for `rows` (≤ `I::ROWS`) rows.
    ///
    /// # Safety
    /// As for [`Isa::stripe`].
    unsafe fn stripe_of<I: Isa>(rows: usize, s: Stripe<'_>, pf: &mut Prefetch) {
        debug_assert!(rows <= I::ROWS, "a pass of {rows} rows for kernels of {}", I::ROWS);
        match rows {
            1 => I::stripe::<1>(s, pf),
            2 => I::stripe::<2>(s, pf),
            3 => I::stripe::<3>(s, pf),
            4 => I::stripe::<4>(s, pf),
            5 => I::stripe::<5>(s, pf),
            6 => I::stripe::<6>(s, pf),
            7 => I::stripe::<7>(s, pf),
            _ => I::stripe::<8>(s, pf),
        }
    }

    pub(super) fn product<I: Isa>(
        y: &mut [f32],
        accumulate: bool,
        x: &[f32],
        w: &[f32],
        (m, k, n): (usize, usize, usize),
    ) {
        // The inputs transposed, one pass of rows at a time: `xt[kk·rows + r] = x[r0 + r][kk]`, so
        // that one step down the weight reads its multipliers from one place.
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
        // share of every output; the first writes into y, the others into buffers added after.
        let blocks = k.div_ceil(BLOCK_ROWS);
        let threads = if k * n >= 1 << 18 { rayon::current_num_threads().clamp(1, blocks) } else { 1 };
        let ranges: Vec<(usize, usize)> = (0..threads)
            .map(|t| (blocks * t / threads * BLOCK_ROWS, (blocks * (t + 1) / threads * BLOCK_ROWS).min(k)))
            .collect();
        let out = SharedOut(y.as_mut_ptr());
        let run = |t: usize| -> Option<Vec<f32>> {
            let mut own = if t == 0 { None } else { Some(vec![0.0f32; m * n]) };
            let (dst, first_accumulates) = match own.as_mut() {
                Some(buffer) => (SharedOut(buffer.as_mut_ptr()), false),
                None => (out, accumulate),
            };
            // SAFETY: the caller chose `I` by the CPU's tier; every pass's rows of dst (m·n, y or
            // this task's own buffer), weight rows ranges[t] (inside k) and every column lie inside
            // their slices by product's assertion; only task 0 writes y.
            unsafe { block_passes::<I>(dst, &passes, w, (k, n), ranges[t], first_accumulates) }
            own
        };
        let partials: Vec<Vec<f32>> = if threads > 1 {
            (0..threads).into_par_iter().filter_map(run).collect()
        } else {
            (0..threads).filter_map(run).collect()
        };
        for partial in partials {
            y.iter_mut().zip(&partial).for_each(|(a, b)| *a += b);
        }
    }

    /// Weight rows of a block of [`block_passes`]: one block is multiplied while the next is prefetched.
    const BLOCK_ROWS: usize = 16;

    /// Lines of the next block to prefetch, in address order, a few at each step of the current one:
    /// the weight is then read from memory as one sequential stream, though the kernel walks it down
    /// its columns.
    pub(super) struct Prefetch {
        next: *const i8,
        lines: usize,
        done: usize,
        /// Lines a step: as many as a stripe's row spans, so that the next block is fetched as fast
        /// as the current one is consumed.
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

    /// Every pass of rows (`(r0, xt)`: rows `r0 ..`, as many as `xt` holds) of `x · w` over the
    /// weight rows `[k0, k1)`, every column, block by block: all passes of a block run while it is
    /// in cache, so the weight is read from memory once whatever the rows. `accumulate` adds the
    /// first block's sums to y.
    ///
    /// # Safety
    /// The CPU must have `I`'s features; the passes, weight rows and columns must lie inside y and w.
    unsafe fn block_passes<I: Isa>(
        y: SharedOut,
        passes: &[(usize, Vec<f32>)],
        w: &[f32],
        (k, n): (usize, usize),
        (k0, k1): (usize, usize),
        accumulate: bool,
    ) {
        let mut kb = k0;
        while kb < k1 {
            let block = (k1 - kb).min(BLOCK_ROWS);
            let next_rows = (k1 - kb - block).min(BLOCK_ROWS);
            let mut prefetch = Prefetch {
                next: w.as_ptr().wrapping_add((kb + block) * n) as *const i8,
                lines: (next_rows * n).div_ceil(16),
                done: 0,
                per_step: I::STRIPE.div_ceil(16),
            };
            let add = accumulate || kb > k0;
            for (r0, xt) in passes {
                let rows = xt.len() / k.max(1);
                let xt = &xt[kb * rows..(kb + block) * rows];
                let (mut c, y, w) = (0, y.0.add(r0 * n), w.as_ptr().add(kb * n));
                // The block's rows of y, stripe by stripe.
                while c < n {
                    let width = (n - c).min(I::STRIPE);
                    let s = Stripe { y: y.add(c), ldy: n, xt, w: w.add(c), ldw: n, k: block, width, accumulate: add };
                    stripe_of::<I>(rows, s, &mut prefetch);
                    c += width;
                }
            }
            kb += block;
        }
    }

    pub(super) fn product_nt<I: Isa>(y: &mut [f32], x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
        let out = SharedOut(y.as_mut_ptr());
        // Whole groups of weight rows per task, ~256 KiB of weight each.
        let per_task = ((1 << 16) / k.max(1)).max(WEIGHT_ROWS) / WEIGHT_ROWS * WEIGHT_ROWS;
        let tasks: Vec<(usize, usize)> = (0..n).step_by(per_task).map(|j| (j, (j + per_task).min(n))).collect();
        let run = |&(j0, j1): &(usize, usize)| {
            for r0 in (0..m).step_by(I::ROWS) {
                let rows = I::ROWS.min(m - r0);
                // SAFETY: the caller chose `I` by the CPU's tier; rows [r0, r0 + rows) of x and y and
                // weight rows [j0, j1) lie inside their slices by product_nt's assertion; tasks
                // write disjoint column ranges [j0, j1) of y.
                unsafe { pass_nt::<I>(out, r0, rows, x, w, (k, n), (j0, j1)) }
            }
        };
        if k * n >= 1 << 18 {
            tasks.par_iter().for_each(run);
        } else {
            tasks.iter().for_each(run);
        }
    }

    /// How many groups of weight rows ahead [`Isa::dots`] prefetches.
    const PREFETCH_GROUPS: usize = 2;

    /// Weight rows one step of [`Isa::dots`] reads together.
    const WEIGHT_ROWS: usize = 2;

    /// Columns `[j0, j1)` of rows `r0 .. r0 + rows` of `x · wᵀ`.
    ///
    /// # Safety
    /// The CPU must have `I`'s features; the rows and columns must lie inside x, w and y.
    #[allow(clippy::too_many_arguments)]
    unsafe fn pass_nt<I: Isa>(
        y: SharedOut,
        r0: usize,
        rows: usize,
        x: &[f32],
        w: &[f32],
        (k, n): (usize, usize),
        (j0, j1): (usize, usize),
    ) {
        let (x, y) = (x.as_ptr().add(r0 * k), y.0.add(r0 * n));
        let mut j = j0;
        while j < j1 {
            let group = (j1 - j).min(WEIGHT_ROWS);
            let (w, y) = (w.as_ptr().add(j * k), y.add(j));
            debug_assert!(rows <= I::ROWS, "a pass of {rows} rows for kernels of {}", I::ROWS);
            match rows {
                1 => group_dots::<I, 1>(y, n, x, w, k, group),
                2 => group_dots::<I, 2>(y, n, x, w, k, group),
                3 => group_dots::<I, 3>(y, n, x, w, k, group),
                4 => group_dots::<I, 4>(y, n, x, w, k, group),
                5 => group_dots::<I, 5>(y, n, x, w, k, group),
                6 => group_dots::<I, 6>(y, n, x, w, k, group),
                7 => group_dots::<I, 7>(y, n, x, w, k, group),
                _ => group_dots::<I, 8>(y, n, x, w, k, group),
            }
            j += group;
        }
    }

    /// [`Isa::dots`] of R rows of x with `group` (≤ [`WEIGHT_ROWS`]) rows of w.
    ///
    /// # Safety
    /// As for [`Isa::dots`].
    unsafe fn group_dots<I: Isa, const R: usize>(
        y: *mut f32,
        ldy: usize,
        x: *const f32,
        w: *const f32,
        k: usize,
        group: usize,
    ) {
        if group == WEIGHT_ROWS {
            I::dots::<R, WEIGHT_ROWS>(y, ldy, x, w, k);
        } else {
            for g in 0..group {
                I::dots::<R, 1>(y.add(g), ldy, x, w.add(g * k), k);
            }
        }
    }

    /// One instruction set's vectors, which the kernels below are written in: the kernels are
    /// compiled once per set, inside `isa!`'s functions that enable its features.
    ///
    /// # Safety
    /// The methods may only run where the CPU has the set, inlined into a function that enables it.
    unsafe trait Lanes {
        type V: Copy;
        /// Which lanes a partial load or store touches.
        type Mask: Copy;
        /// Lanes of a vector.
        const N: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn load(p: *const f32) -> Self::V;
        /// The value at `p` in every lane.
        unsafe fn splat(p: *const f32) -> Self::V;
        /// `a · b + c`, fused.
        unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
        /// The lanes below `live` (0 ..= N).
        unsafe fn mask(live: usize) -> Self::Mask;
        /// The masked lanes from `p`, zeros in the others, whose memory is not touched.
        unsafe fn load_masked(p: *const f32, mask: Self::Mask) -> Self::V;
        unsafe fn store_masked(p: *mut f32, mask: Self::Mask, v: Self::V);
        /// The sum of the lanes.
        unsafe fn sum(v: Self::V) -> f32;
    }

    /// Implements [`Lanes`] for an instruction set from its types, its lanes and each method's body
    /// (its intrinsics), every method `#[inline(always)]`.
    macro_rules! lanes {
        (
            $set:ty { V = $v:ty, Mask = $m:ty, N = $n:literal }
            zero() $zero:block
            load($load_p:ident) $load:block
            splat($splat_p:ident) $splat:block
            fmadd($a:ident, $b:ident, $c:ident) $fmadd:block
            mask($live:ident) $mask:block
            load_masked($lm_p:ident, $lm_mask:ident) $load_masked:block
            store_masked($sm_p:ident, $sm_mask:ident, $sm_v:ident) $store_masked:block
            sum($sum_v:ident) $sum:block
        ) => {
            // SAFETY: each invocation's bodies use its set's intrinsics only, and `isa!` inlines
            // them into the functions that enable that set.
            unsafe impl Lanes for $set {
                type V = $v;
                type Mask = $m;
                const N: usize = $n;
                #[inline(always)]
                unsafe fn zero() -> $v $zero
                #[inline(always)]
                unsafe fn load($load_p: *const f32) -> $v $load
                #[inline(always)]
                unsafe fn splat($splat_p: *const f32) -> $v $splat
                #[inline(always)]
                unsafe fn fmadd($a: $v, $b: $v, $c: $v) -> $v $fmadd
                #[inline(always)]
                unsafe fn mask($live: usize) -> $m $mask
                #[inline(always)]
                unsafe fn load_masked($lm_p: *const f32, $lm_mask: $m) -> $v $load_masked
                #[inline(always)]
                unsafe fn store_masked($sm_p: *mut f32, $sm_mask: $m, $sm_v: $v) $store_masked
                #[inline(always)]
                unsafe fn sum($sum_v: $v) -> f32 $sum
            }
        };
    }

    // AVX-512 F intrinsics only (`isa!` enables `avx512f`).
    lanes! {
        Avx512 { V = __m512, Mask = __mmask16, N = 16 }
        zero() { _mm512_setzero_ps() }
        load(p) { _mm512_loadu_ps(p) }
        splat(p) { _mm512_set1_ps(*p) }
        fmadd(a, b, c) { _mm512_fmadd_ps(a, b, c) }
        mask(live) { ((1u32 << live.min(16)) - 1) as u16 }
        load_masked(p, mask) { _mm512_maskz_loadu_ps(mask, p) }
        store_masked(p, mask, v) { _mm512_mask_storeu_ps(p, mask, v) }
        sum(v) { _mm512_reduce_add_ps(v) }
    }

    // SSE3, AVX, AVX2 and FMA intrinsics only (`isa!` enables `avx2,fma`, which imply the older
    // sets).
    lanes! {
        Avx2 { V = __m256, Mask = __m256i, N = 8 }
        zero() { _mm256_setzero_ps() }
        load(p) { _mm256_loadu_ps(p) }
        splat(p) { _mm256_broadcast_ss(&*p) }
        fmadd(a, b, c) { _mm256_fmadd_ps(a, b, c) }
        // All ones in the lanes below `live`: `maskload` and `maskstore` read a lane's top bit.
        mask(live) {
            _mm256_cmpgt_epi32(_mm256_set1_epi32(live.min(8) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
        }
        load_masked(p, mask) { _mm256_maskload_ps(p, mask) }
        store_masked(p, mask, v) { _mm256_maskstore_ps(p, mask, v) }
        sum(v) {
            let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
            _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
        }
    }

    /// [`Isa::stripe`] in `L`'s vectors: three a stripe.
    ///
    /// # Safety
    /// As for [`Isa::stripe`], inlined into a function that enables `L`'s features.
    #[inline(always)]
    unsafe fn stripe<L: Lanes, const R: usize>(s: Stripe<'_>, prefetch: &mut Prefetch) {
        let Stripe { y, ldy, xt, w, ldw, k, width, accumulate } = s;
        let live: [usize; 3] = std::array::from_fn(|v| width.saturating_sub(v * L::N).min(L::N));
        let mask: [L::Mask; 3] = std::array::from_fn(|v| L::mask(live[v]));
        let mut acc = [[L::zero(); 3]; R];
        if accumulate {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (v, a) in acc.iter_mut().enumerate() {
                    if live[v] > 0 {
                        *a = L::load_masked(y.add(r * ldy + v * L::N), mask[v]);
                    }
                }
            }
        }
        let xt = xt.as_ptr();
        if width == 3 * L::N {
            for kk in 0..k {
                let row = w.add(kk * ldw);
                prefetch.step();
                let b = [L::load(row), L::load(row.add(L::N)), L::load(row.add(2 * L::N))];
                for (r, acc) in acc.iter_mut().enumerate() {
                    let a = L::splat(xt.add(kk * R + r));
                    for v in 0..3 {
                        acc[v] = L::fmadd(a, b[v], acc[v]);
                    }
                }
            }
        } else {
            for kk in 0..k {
                let row = w.add(kk * ldw);
                prefetch.step();
                // A cut stripe's later vectors may start past the slice: masked loads of no lane
                // never touch memory, and their addresses are only wrapped, not offset.
                let b: [L::V; 3] = std::array::from_fn(|v| L::load_masked(row.wrapping_add(v * L::N), mask[v]));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let a = L::splat(xt.add(kk * R + r));
                    for v in 0..3 {
                        acc[v] = L::fmadd(a, b[v], acc[v]);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, a) in acc.iter().enumerate() {
                if live[v] > 0 {
                    L::store_masked(y.add(r * ldy + v * L::N), mask[v], *a);
                }
            }
        }
    }

    /// [`Isa::dots`] in `L`'s vectors.
    ///
    /// # Safety
    /// As for [`Isa::dots`], inlined into a function that enables `L`'s features.
    #[inline(always)]
    unsafe fn dots<L: Lanes, const R: usize, const J: usize>(
        y: *mut f32,
        ldy: usize,
        x: *const f32,
        w: *const f32,
        k: usize,
    ) {
        let mut acc = [[L::zero(); J]; R];
        let full = k / L::N * L::N;
        let mut c = 0;
        while c < full {
            // The next group's rows, the same distance ahead, a line (16 values) at a time: the
            // streaming prefetcher alone lets the loads wait behind the multiplications.
            if c % 16 == 0 {
                for j in 0..J {
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((PREFETCH_GROUPS * J + j) * k + c) as *const i8);
                }
            }
            let b: [L::V; J] = std::array::from_fn(|j| L::load(w.add(j * k + c)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = L::load(x.add(r * k + c));
                for j in 0..J {
                    acc[j] = L::fmadd(a, b[j], acc[j]);
                }
            }
            c += L::N;
        }
        if full < k {
            let mask = L::mask(k - full);
            let b: [L::V; J] = std::array::from_fn(|j| L::load_masked(w.add(j * k + full), mask));
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = L::load_masked(x.add(r * k + full), mask);
                for j in 0..J {
                    acc[j] = L::fmadd(a, b[j], acc[j]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, a) in acc.iter().enumerate() {
                *y.add(r * ldy + j) = L::sum(*a);
            }
        }
    }

    /// Implements [`Isa`] for an instruction set: the generic kernels compiled inside functions
    /// that enable its features.
    macro_rules! isa {
        ($set:ty, $features:literal, rows $rows:literal) => {
            // SAFETY: the kernels enable the features `simd::detected()` vouches for with this set.
            unsafe impl Isa for $set {
                const ROWS: usize = $rows;
                const STRIPE: usize = 3 * <$set as Lanes>::N;

                #[target_feature(enable = $features)]
                unsafe fn stripe<const R: usize>(s: Stripe<'_>, prefetch: &mut Prefetch) {
                    stripe::<$set, R>(s, prefetch)
                }

                #[target_feature(enable = $features)]
                unsafe fn dots<const R: usize, const J: usize>(
                    y: *mut f32,
                    ldy: usize,
                    x: *const f32,
                    w: *const f32,
                    k: usize,
                ) {
                    dots::<$set, R, J>(y, ldy, x, w, k)
                }
            }
        };
    }

    isa!(Avx512, "avx512f", rows 8);
    isa!(Avx2, "avx2,fma", rows 4);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{self, Tier};
    use crate::testing::values;

    /// A few-rows product: `(y, accumulate, x, w, (m, k, n))`.
    type Product<'a> = &'a dyn Fn(&mut [f32], bool, &[f32], &[f32], (usize, usize, usize));

    fn check(path: Product<'_>, (m, k, n): (usize, usize, usize)) {
        let (x, w) = (values(m * k, 1), values(k * n, 2));
        for accumulate in [false, true] {
            let start = values(m * n, 3);
            let (mut got, mut want) = (start.clone(), start);
            path(&mut got, accumulate, &x, &w, (m, k, n));
            reference(&mut want, accumulate, &x, &w, (m, k, n));
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{m}x{k}x{n} acc={accumulate} [{i}]: {g} vs {e}");
            }
        }
    }

    /// Every row count of a pass (1–8 for AVX-512, 1–4 for AVX2) and past it, stripes whole and cut
    /// (widths not multiples of the lanes or of a stripe: 16 and 48, 8 and 24), one thread and two
    /// (the threaded split starts at k·n = 2^18), blocks whole and cut, k not a multiple of the
    /// lanes (the dot products' tails).
    const SHAPES: [(usize, usize, usize); 13] = [
        (1, 7, 5),
        (5, 1000, 300), // threaded, the weight's rows not a whole number of blocks
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
        (6, 100, 70),
    ];

    /// The tiers this CPU reaches, narrowest first: each runs its own kernels (the baseline the GEMM
    /// crate's path).
    fn reachable() -> impl Iterator<Item = Tier> {
        Tier::ALL.into_iter().filter(|&t| t <= simd::detected())
    }

    #[test]
    fn kernel_matches_the_reference() {
        for tier in reachable() {
            eprintln!("few-rows kernels: {tier:?}");
            let cpu = Cpu::detect().capped(tier);
            for shape in SHAPES {
                check(&|y, acc, x, w, shape| product(cpu, y, acc, x, w, shape), shape);
            }
        }
    }

    #[test]
    fn portable_path_matches_the_reference() {
        for shape in SHAPES {
            check(&transposed_gemm, shape);
        }
    }

    #[test]
    fn transposed_kernel_matches_the_reference() {
        for tier in reachable() {
            for (m, k, n) in SHAPES.into_iter().chain([(8, 576, 4099), (2, 16, 7), (3, 40, 1), (6, 9, 5)]) {
                let (x, w) = (values(m * k, 1), values(k * n, 2));
                let (mut got, mut want) = (values(m * n, 3), vec![0.0; m * n]);
                product_nt(Cpu::detect().capped(tier), &mut got, &x, &w, (m, k, n));
                reference_nt(&mut want, &x, &w, (m, k, n));
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "nt {tier:?} {m}x{k}x{n} [{i}]: {g} vs {e}");
                }
            }
        }
    }

    #[test]
    fn portable_transposed_path_matches_the_reference() {
        for (m, k, n) in SHAPES.into_iter().chain([(8, 576, 4099), (3, 40, 1)]) {
            let (x, w) = (values(m * k, 1), values(k * n, 2));
            let (mut got, mut want) = (values(m * n, 3), vec![0.0; m * n]);
            transposed_gemm_nt(&mut got, &x, &w, (m, k, n));
            reference_nt(&mut want, &x, &w, (m, k, n));
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "gemm nt {m}x{k}x{n} [{i}]: {g} vs {e}");
            }
        }
    }

    #[test]
    fn empty_shapes_do_nothing() {
        let mut y = vec![];
        product(Cpu::detect(), &mut y, false, &[], &[], (0, 4, 0));
        let mut y = vec![1.0; 6];
        product(Cpu::detect(), &mut y, false, &[], &[], (2, 0, 3));
        assert_eq!(y, vec![0.0; 6], "k = 0 is a product of empty sums");
    }
}
