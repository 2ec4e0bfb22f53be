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
//! address order while one is multiplied: memory sees one sequential stream. Every pass of up to
//! [`ROWS_PER_PASS`] rows runs over a block while it is cached, so the weight is read from memory
//! once per call; each thread takes a contiguous range of the weight's rows and the partial sums are
//! added. The tied head (`x · Wᵀ`, W as stored) has its own kernel: dot products of a few input rows
//! with two weight rows at a time.
//!
//! Chosen at run time: the AVX-512 kernels where the CPU has `avx512f`, the GEMM crate's transposed
//! products otherwise. [`reference`] and [`reference_nt`] are the plain loops all are tested against.

/// Rows one pass of the kernel carries in registers (`ROWS_PER_PASS × 3` accumulators of 16 lanes).
pub const ROWS_PER_PASS: usize = 8;

/// Columns of one stripe: three 16-lane vectors.
const STRIPE: usize = 48;

/// `y (+)= x · w` with x `[m, k]`, w `[k, n]`, y `[m, n]`, all row-major; `accumulate` adds to y's
/// contents instead of overwriting them.
///
/// # Panics
/// If a slice is shorter than its shape (the callers' shape checks make this unreachable from input).
pub fn product(y: &mut [f32], accumulate: bool, x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
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
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        avx512::product(y, accumulate, x, w, (m, k, n));
        return;
    }
    transposed_gemm(y, accumulate, x, w, (m, k, n));
}

/// `y = x · wᵀ` with x `[m, k]`, w `[n, k]` (a tied head: the embedding table as stored), y `[m, n]`.
///
/// # Panics
/// If a slice is shorter than its shape (the callers' shape checks make this unreachable from input).
pub fn product_nt(y: &mut [f32], x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
    assert!(y.len() == m * n && x.len() >= m * k && w.len() >= k * n, "few_rows: slices shorter than their shapes");
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if k > 0 && std::is_x86_feature_detected!("avx512f") {
        avx512::product_nt(y, x, w, (m, k, n));
        return;
    }
    transposed_gemm_nt(y, x, w, (m, k, n));
}

/// `y = x · wᵀ` as the plain loop, in f64: what [`product_nt`] is tested against.
pub fn reference_nt(y: &mut [f32], x: &[f32], w: &[f32], (_, k, n): (usize, usize, usize)) {
    for (y, x) in y.chunks_mut(n.max(1)).zip(x.chunks(k.max(1))) {
        for (j, out) in y.iter_mut().enumerate() {
            let row = &w[j * k..(j + 1) * k];
            *out = row.iter().zip(x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>() as f32;
        }
    }
}

/// The plain triple loop, in f64: what the kernels are tested against.
pub fn reference(y: &mut [f32], accumulate: bool, x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
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
pub fn transposed_gemm(y: &mut [f32], accumulate: bool, x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
    assert!(y.len() == m * n && x.len() >= m * k && w.len() >= k * n, "few_rows: slices shorter than their shapes");
    // SAFETY: with the assertion above, every index the strides reach is inside its slice: dst
    // (n_i, m_i) at m_i·n + n_i < m·n; lhs = wᵀ (n_i, k_i) at k_i·n + n_i < k·n; rhs = xᵀ (k_i, m_i)
    // at m_i·k + k_i < m·k.
    unsafe { strided_gemm((n, m, k), (y, (1, n)), accumulate, (w, (1, n)), (x, (1, k))) }
}

/// The portable path of [`product_nt`]: `yᵀ = w · xᵀ` through the GEMM crate's strides (its kernels
/// vectorise along w's many rows; w is read where it is).
pub fn transposed_gemm_nt(y: &mut [f32], x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
    assert!(y.len() == m * n && x.len() >= m * k && w.len() >= k * n, "few_rows: slices shorter than their shapes");
    // SAFETY: with the assertion above, every index the strides reach is inside its slice: dst
    // (j, i) at i·n + j < m·n; lhs = w (j, kk) at j·k + kk < n·k; rhs = xᵀ (kk, i) at i·k + kk < m·k.
    unsafe { strided_gemm((n, m, k), (y, (1, n)), false, (w, (k, 1)), (x, (1, k))) }
}

/// An operand and its (row, column) strides.
type Strided<T> = (T, (usize, usize));

/// `dst (+)= lhs · rhs` (`[rows, cols]`, inner dimension `inner`) through the GEMM crate, each
/// operand given with its (row, column) strides; on all threads when the weight is large.
///
/// # Safety
/// Every element the strides reach must lie inside its slice.
unsafe fn strided_gemm(
    (rows, cols, inner): (usize, usize, usize),
    (dst, (dst_rs, dst_cs)): Strided<&mut [f32]>,
    accumulate: bool,
    (lhs, (lhs_rs, lhs_cs)): Strided<&[f32]>,
    (rhs, (rhs_rs, rhs_cs)): Strided<&[f32]>,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    let parallelism = if rows * inner >= 1 << 18 { gemm::Parallelism::Rayon(0) } else { gemm::Parallelism::None };
    unsafe {
        gemm::gemm(
            rows,
            cols,
            inner,
            dst.as_mut_ptr(),
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
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use crate::ops::SharedOut;
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    pub(super) fn product(y: &mut [f32], accumulate: bool, x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
        // The inputs transposed, one pass of rows at a time: `xt[kk·rows + r] = x[r0 + r][kk]`, so
        // that one step down the weight reads its multipliers from one place.
        let passes: Vec<(usize, Vec<f32>)> = (0..m)
            .step_by(ROWS_PER_PASS)
            .map(|r0| {
                let rows = ROWS_PER_PASS.min(m - r0);
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
            // SAFETY: avx512f was detected by the caller; every pass's rows of dst (m·n, y or this
            // task's own buffer), weight rows ranges[t] (inside k) and every column lie inside
            // their slices by product's assertion; only task 0 writes y.
            unsafe { block_passes(dst, &passes, w, (k, n), ranges[t], first_accumulates) }
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
    struct Prefetch {
        next: *const i8,
        lines: usize,
        done: usize,
    }

    impl Prefetch {
        #[inline(always)]
        unsafe fn step(&mut self) {
            for _ in 0..LINES_PER_STEP {
                if self.done < self.lines {
                    _mm_prefetch::<_MM_HINT_T1>(self.next.wrapping_add(64 * self.done));
                    self.done += 1;
                }
            }
        }
    }

    /// Lines prefetched per weight row of a stripe: a stripe's row is three lines, so the next
    /// block is fetched as fast as the current one is consumed.
    const LINES_PER_STEP: usize = 3;

    /// Every pass of rows (`(r0, xt)`: rows `r0 ..`, as many as `xt` holds) of `x · w` over the
    /// weight rows `[k0, k1)`, every column, block by block: all passes of a block run while it is
    /// in cache, so the weight is read from memory once whatever the rows. `accumulate` adds the
    /// first block's sums to y.
    #[target_feature(enable = "avx512f")]
    unsafe fn block_passes(
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
            };
            let add = accumulate || kb > k0;
            for (r0, xt) in passes {
                let rows = xt.len() / k.max(1);
                let xt = &xt[kb * rows..(kb + block) * rows];
                block_pass(y.0.add(r0 * n), rows, xt, w.as_ptr().add(kb * n), (block, n), add, &mut prefetch);
            }
            kb += block;
        }
    }

    /// `rows` rows of y (`ldy = n`) (+)= their inputs `xt` (`[block, rows]`) times one block of the
    /// weight (`[block, n]`), stripe by stripe.
    #[target_feature(enable = "avx512f")]
    unsafe fn block_pass(
        y: *mut f32,
        rows: usize,
        xt: &[f32],
        w: *const f32,
        (block, n): (usize, usize),
        add: bool,
        pf: &mut Prefetch,
    ) {
        let mut c = 0;
        while c < n {
            let width = (n - c).min(STRIPE);
            let (w, y) = (w.add(c), y.add(c));
            match rows {
                1 => stripe::<1>(y, n, xt, w, n, block, width, add, pf),
                2 => stripe::<2>(y, n, xt, w, n, block, width, add, pf),
                3 => stripe::<3>(y, n, xt, w, n, block, width, add, pf),
                4 => stripe::<4>(y, n, xt, w, n, block, width, add, pf),
                5 => stripe::<5>(y, n, xt, w, n, block, width, add, pf),
                6 => stripe::<6>(y, n, xt, w, n, block, width, add, pf),
                7 => stripe::<7>(y, n, xt, w, n, block, width, add, pf),
                _ => stripe::<8>(y, n, xt, w, n, block, width, add, pf),
            }
            c += width;
        }
    }

    pub(super) fn product_nt(y: &mut [f32], x: &[f32], w: &[f32], (m, k, n): (usize, usize, usize)) {
        let out = SharedOut(y.as_mut_ptr());
        // Whole groups of weight rows per task, ~256 KiB of weight each.
        let per_task = ((1 << 16) / k.max(1)).max(WEIGHT_ROWS) / WEIGHT_ROWS * WEIGHT_ROWS;
        let tasks: Vec<(usize, usize)> = (0..n).step_by(per_task).map(|j| (j, (j + per_task).min(n))).collect();
        let run = |&(j0, j1): &(usize, usize)| {
            for r0 in (0..m).step_by(ROWS_PER_PASS) {
                let rows = ROWS_PER_PASS.min(m - r0);
                // SAFETY: avx512f was detected by the caller; rows [r0, r0 + rows) of x and y and
                // weight rows [j0, j1) lie inside their slices by product_nt's assertion; tasks
                // write disjoint column ranges [j0, j1) of y.
                unsafe { pass_nt(out, r0, rows, x, w, (k, n), (j0, j1)) }
            }
        };
        if k * n >= 1 << 18 {
            tasks.par_iter().for_each(run);
        } else {
            tasks.iter().for_each(run);
        }
    }

    /// How many groups of weight rows ahead [`dots`] prefetches.
    const PREFETCH_GROUPS: usize = 2;

    /// Weight rows one step of [`dots`] reads together.
    const WEIGHT_ROWS: usize = 2;

    /// Columns `[j0, j1)` of rows `r0 .. r0 + rows` of `x · wᵀ`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pass_nt(
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
            match rows {
                1 => group_dots::<1>(y, n, x, w, k, group),
                2 => group_dots::<2>(y, n, x, w, k, group),
                3 => group_dots::<3>(y, n, x, w, k, group),
                4 => group_dots::<4>(y, n, x, w, k, group),
                5 => group_dots::<5>(y, n, x, w, k, group),
                6 => group_dots::<6>(y, n, x, w, k, group),
                7 => group_dots::<7>(y, n, x, w, k, group),
                _ => group_dots::<8>(y, n, x, w, k, group),
            }
            j += group;
        }
    }

    /// [`dots`] of R rows of x with `group` (≤ [`WEIGHT_ROWS`]) rows of w.
    #[target_feature(enable = "avx512f")]
    unsafe fn group_dots<const R: usize>(
        y: *mut f32,
        ldy: usize,
        x: *const f32,
        w: *const f32,
        k: usize,
        group: usize,
    ) {
        if group == WEIGHT_ROWS {
            dots::<R, WEIGHT_ROWS>(y, ldy, x, w, k);
        } else {
            for g in 0..group {
                dots::<R, 1>(y.add(g), ldy, x, w.add(g * k), k);
            }
        }
    }

    /// `y[r·ldy + j] = x[r] · w[j]` for R rows of x and J rows of w, each of length k: R×J
    /// accumulators of 16 lanes along k, summed across lanes at the end.
    #[target_feature(enable = "avx512f")]
    unsafe fn dots<const R: usize, const J: usize>(y: *mut f32, ldy: usize, x: *const f32, w: *const f32, k: usize) {
        let mut acc = [[_mm512_setzero_ps(); J]; R];
        let full = k / 16 * 16;
        let mut c = 0;
        while c < full {
            // The next group's rows, the same distance ahead: the streaming prefetcher alone lets
            // the loads wait behind the multiplications.
            for j in 0..J {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((PREFETCH_GROUPS * J + j) * k + c) as *const i8);
            }
            let b: [__m512; J] = std::array::from_fn(|j| _mm512_loadu_ps(w.add(j * k + c)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = _mm512_loadu_ps(x.add(r * k + c));
                for j in 0..J {
                    acc[j] = _mm512_fmadd_ps(a, b[j], acc[j]);
                }
            }
            c += 16;
        }
        if full < k {
            let mask: __mmask16 = ((1u32 << (k - full)) - 1) as u16;
            let b: [__m512; J] = std::array::from_fn(|j| _mm512_maskz_loadu_ps(mask, w.add(j * k + full)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = _mm512_maskz_loadu_ps(mask, x.add(r * k + full));
                for j in 0..J {
                    acc[j] = _mm512_fmadd_ps(a, b[j], acc[j]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, a) in acc.iter().enumerate() {
                *y.add(r * ldy + j) = _mm512_reduce_add_ps(*a);
            }
        }
    }

    /// Lane masks of the three vectors of a stripe `width` columns wide (≤ 48).
    fn masks(width: usize) -> [__mmask16; 3] {
        let lanes = |v: usize| {
            let live = width.saturating_sub(16 * v).min(16);
            if live == 16 {
                0xFFFF
            } else {
                ((1u32 << live) - 1) as u16
            }
        };
        [lanes(0), lanes(1), lanes(2)]
    }

    /// `y[r][0..width] (+)= Σ_kk xt[kk·R + r] · w[kk·ldw + 0..width]` for R rows, the R×48 sums
    /// held in registers while the weight's rows stream past.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn stripe<const R: usize>(
        y: *mut f32,
        ldy: usize,
        xt: &[f32],
        w: *const f32,
        ldw: usize,
        k: usize,
        width: usize,
        accumulate: bool,
        prefetch: &mut Prefetch,
    ) {
        let mask = masks(width);
        let mut acc = [[_mm512_setzero_ps(); 3]; R];
        if accumulate {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (v, a) in acc.iter_mut().enumerate() {
                    if mask[v] != 0 {
                        *a = _mm512_maskz_loadu_ps(mask[v], y.add(r * ldy + 16 * v));
                    }
                }
            }
        }
        let xt = xt.as_ptr();
        if mask == [0xFFFF; 3] {
            for kk in 0..k {
                let row = w.add(kk * ldw);
                prefetch.step();
                let b = [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16)), _mm512_loadu_ps(row.add(32))];
                for (r, acc) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*xt.add(kk * R + r));
                    for v in 0..3 {
                        acc[v] = _mm512_fmadd_ps(a, b[v], acc[v]);
                    }
                }
            }
        } else {
            for kk in 0..k {
                let row = w.add(kk * ldw);
                prefetch.step();
                let b = [
                    _mm512_maskz_loadu_ps(mask[0], row),
                    // A cut stripe's later vectors may start past the slice: masked loads of no
                    // lane never touch memory, and their addresses are only wrapped, not offset.
                    _mm512_maskz_loadu_ps(mask[1], row.wrapping_add(16)),
                    _mm512_maskz_loadu_ps(mask[2], row.wrapping_add(32)),
                ];
                for (r, acc) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*xt.add(kk * R + r));
                    for v in 0..3 {
                        acc[v] = _mm512_fmadd_ps(a, b[v], acc[v]);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, a) in acc.iter().enumerate() {
                if mask[v] != 0 {
                    _mm512_mask_storeu_ps(y.add(r * ldy + 16 * v), mask[v], *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::values;

    /// A few-rows product: `(y, accumulate, x, w, (m, k, n))`.
    type Product = fn(&mut [f32], bool, &[f32], &[f32], (usize, usize, usize));

    fn check(path: Product, (m, k, n): (usize, usize, usize)) {
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

    /// Every row count of a pass and past it, stripes whole and cut (widths not multiples of 16 or
    /// 48), one thread and two (the threaded split starts at k·n = 2^18), blocks whole and cut.
    const SHAPES: [(usize, usize, usize); 12] = [
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
    ];

    #[test]
    fn kernel_matches_the_reference() {
        for shape in SHAPES {
            check(product, shape);
        }
    }

    #[test]
    fn portable_path_matches_the_reference() {
        for shape in SHAPES {
            check(transposed_gemm, shape);
        }
    }

    #[test]
    fn transposed_kernel_matches_the_reference() {
        for (m, k, n) in SHAPES.into_iter().chain([(8, 576, 4099), (2, 16, 7), (3, 40, 1)]) {
            let (x, w) = (values(m * k, 1), values(k * n, 2));
            let (mut got, mut want) = (values(m * n, 3), vec![0.0; m * n]);
            product_nt(&mut got, &x, &w, (m, k, n));
            reference_nt(&mut want, &x, &w, (m, k, n));
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "nt {m}x{k}x{n} [{i}]: {g} vs {e}");
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
        product(&mut y, false, &[], &[], (0, 4, 0));
        let mut y = vec![1.0; 6];
        product(&mut y, false, &[], &[], (2, 0, 3));
        assert_eq!(y, vec![0.0; 6], "k = 0 is a product of empty sums");
    }
}
