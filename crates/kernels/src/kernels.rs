//! CPU kernels of the fused ops, on f32 slices: RMSNorm, the gated units (SwiGLU, GeGLU), linear
//! layers and RoPE + causal grouped-query attention, each with its backward pass, and AdamW. Rows
//! are split across threads with rayon; the GEMMs run through the `gemm` crate with strides, so the
//! attention reads queries, keys and values where the packed q/k/v projection put them
//! (`[B·T, (H + 2K)·Dh]` rows) and no transposed copy is ever made. The kernels of LayerNorm, GELU
//! and the q/k norm live in their ops' files.
//!
//! The element-wise kernels here (norms, the gated units, RoPE, the attention's softmax rows, AdamW,
//! the sum of squares), like the loss's rows in `cross_entropy`, are compiled three times by
//! [`crate::simd::multiversion!`], for the baseline x86-64, with AVX2 and FMA, and with AVX-512,
//! the copy chosen at run time by the [`Cpu`] the caller passes (the run's [`crate::Compute`]).
//!
//! The kernels here are tested against direct transcriptions of their formulas or finite differences
//! (`mod tests`); the Burn-level ops built on them are tested against the plain tensor compositions
//! (values and gradients) in each op's file (`rms_norm`, `swiglu`, `linear`, `attention`, `adamw`).

use rayon::prelude::*;

use crate::activation::{exp, gelu_tanh, gelu_tanh_grad, sigmoid, Gate};
use crate::bf16_gemm::{self, Strided};
use crate::compute::Cpu;
use crate::products::{gemm_new, gemm_new_scaled, gemm_parallelism, gemm_raw, gemm_strided};
use crate::rope::RopeLayout;
use crate::simd::multiversion;

/// Rows per rayon task in the row-wise kernels: enough work per task to outweigh scheduling.
pub(crate) fn rows_per_task(d: usize) -> usize {
    (16_384 / d.max(1)).max(1)
}

multiversion! {
    /// `y = x / sqrt(mean(x²) + eps) · w`, row by row.
    ///
    /// # Shapes
    /// - x: `[N, D]`, w: `[D]` -> `[N, D]`
    pub(crate) fn rms_norm(cpu: Cpu, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let d = w.len();
        assert!(d > 0 && x.len().is_multiple_of(d), "rms_norm: {} values in rows of {d}", x.len());
        let mut y = Box::<[f32]>::new_uninit_slice(x.len());
        let chunk = rows_per_task(d) * d;
        y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).for_each(|(y, x)| {
            for (yr, xr) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                let ms = lanes_dot(xr, xr) / d as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                    o.write(v * inv * g);
                }
            }
        });
        // SAFETY: x is whole rows of d (asserted), so the chunks above cover y and write every element.
        unsafe { y.assume_init() }.into_vec()
    }
}

multiversion! {
    /// Gradients of [`rms_norm`]: with `x̂ = x·r`, `r = 1/sqrt(mean(x²)+eps)` and `g = dy·w`,
    /// `dx = r·(g − x̂·mean(g·x̂))` and `dw = Σ_rows dy·x̂`.
    pub(crate) fn rms_norm_backward(cpu: Cpu, x: &[f32], w: &[f32], dy: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
        let d = w.len();
        assert!(
            d > 0 && x.len().is_multiple_of(d) && dy.len() == x.len(),
            "rms_norm_backward: {} values and {} gradients in rows of {d}",
            x.len(),
            dy.len()
        );
        let mut dx = Box::<[f32]>::new_uninit_slice(x.len());
        let chunk = rows_per_task(d) * d;
        let dw = dx
            .par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk).zip(dy.par_chunks(chunk)))
            .map(|(dx, (x, dy))| {
                let mut dw = vec![0.0f32; d];
                for ((dxr, xr), dyr) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(dy.chunks_exact(d)) {
                    let ms = lanes_dot(xr, xr) / d as f32;
                    let r = 1.0 / (ms + eps).sqrt();
                    // Σ g·x̂ = r · Σ dy·w·x, in eight lanes like `lanes_dot`.
                    let mut lanes = [0.0f32; 8];
                    let (mut tail, mut j) = (0.0f32, 0);
                    while j + 8 <= d {
                        for (l, lane) in lanes.iter_mut().enumerate() {
                            *lane += dyr[j + l] * w[j + l] * xr[j + l];
                        }
                        j += 8;
                    }
                    for j in j..d {
                        tail += dyr[j] * w[j] * xr[j];
                    }
                    let dot = r * (lanes.iter().sum::<f32>() + tail);
                    for j in 0..d {
                        dw[j] += dyr[j] * (xr[j] * r);
                    }
                    let mean = dot / d as f32;
                    for j in 0..d {
                        dxr[j].write(r * (dyr[j] * w[j] - xr[j] * r * mean));
                    }
                }
                dw
            })
            .collect::<Vec<Vec<f32>>>()
            // Summed in chunk order, on one thread: the result does not depend on scheduling, so that
            // training is reproducible bit for bit.
            .into_iter()
            .fold(vec![0.0f32; d], |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                a
            });
        // SAFETY: x and dy are whole rows of d (asserted): every row of dx was written above.
        (unsafe { dx.assume_init() }.into_vec(), dw)
    }
}

/// Whether a GEMM is large enough for bf16 to win: below about 50 MFLOP packing and conversion cost
/// more than the faster products save (the nano model's GEMMs stay f32).
pub(super) fn bf16_worth_it(m: usize, n: usize, k: usize) -> bool {
    m > FEW_ROWS && 2 * m * n * k >= 50_000_000
}

/// `y = x · w (+ b)`, the GEMM's operands in bf16 where `cpu` has a bf16 kernel and the GEMM is
/// large ([`bf16_worth_it`]), else f32.
///
/// # Shapes
/// - x: `[M, K]`, w: `[K, N]`, b: `[N]` -> `[M, N]`
pub(crate) fn linear(cpu: Cpu, x: &[f32], w: &[f32], b: Option<&[f32]>, (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    if b.is_none() && m > FEW_ROWS {
        // Neither GEMM zero-fills its new output first.
        let bf16 = large_bf16(cpu, (m, n, k))
            .and_then(|kernel| bf16_gemm::gemm_new(kernel, (x, (k, 1)), (w, (n, 1)), (m, k, n)));
        return match bf16 {
            Some(y) => y,
            None => gemm_new((m, n, k), (x, (k, 1)), (w, (n, 1)), gemm_parallelism(m, n, k)),
        };
    }
    let mut y = match b {
        Some(b) => b.repeat(m),
        None => vec![0.0f32; m * n],
    };
    if (1..=FEW_ROWS).contains(&m) {
        crate::few_rows::product(cpu, &mut y, b.is_some(), x, w, (m, k, n));
    } else {
        product(cpu, &mut y, b.is_some(), (x, (k, 1)), (w, (n, 1)), (m, k, n));
    }
    y
}

/// The bf16 kernel an `m×k·k×n` product of `cpu` runs on: `cpu`'s, when it has one and the product
/// is large enough to gain.
pub(crate) fn large_bf16(cpu: Cpu, (m, n, k): (usize, usize, usize)) -> Option<bf16_gemm::Kernel> {
    cpu.bf16.filter(|_| bf16_worth_it(m, n, k))
}

/// `c (+)= a · b`, `a` `[m, k]` and `b` `[k, n]` read through their (row, column) strides, `c`
/// `[m, n]` row-major, on all threads when large: bf16 operands with f32 sums (where `cpu` has a
/// bf16 kernel and the product is large enough to gain), else f32.
pub(crate) fn product(
    cpu: Cpu,
    c: &mut [f32],
    accumulate: bool,
    (a, a_strides): Strided<'_>,
    (b, b_strides): Strided<'_>,
    (m, k, n): (usize, usize, usize),
) {
    let bf16 = large_bf16(cpu, (m, n, k));
    if !bf16.is_some_and(|kernel| bf16_gemm::gemm(kernel, c, accumulate, (a, a_strides), (b, b_strides), (m, k, n))) {
        gemm_strided(
            (m, n, k),
            (c, (n, 1)),
            accumulate,
            (a, a_strides),
            (b, b_strides),
            1.0,
            gemm_parallelism(m, n, k),
        );
    }
}

/// Rows up to which [`linear`] runs the few-rows product ([`crate::few_rows`]), one row (a decode
/// step's matrix-vector product) included: on AVX2-only CPUs its one-row pass was 10 % faster than
/// the GEMM crate's (46 against 51 ms a decode step of the 135M model, experiments/serve.md), and
/// on an Intel Xeon with AVX-512 (Emerald Rapids) 60 % faster (SmolLM2-135M f32: 22.5 against
/// 35.5 ms a step, experiments/quantized-decode.md).
pub(crate) const FEW_ROWS: usize = 16;

/// Which gradients a linear layer's backward pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearGrads {
    pub x: bool,
    pub w: bool,
    pub b: bool,
}

/// Gradients of [`linear`]: `dX = dY·Wᵀ`, `dW = Xᵀ·dY`, `db = Σ_rows dY`, each only when asked for,
/// the GEMMs' operands in bf16 where `cpu` has a bf16 kernel and a GEMM is large, else f32. Small
/// products run side by side on one thread each; large ones one after the other on all threads.
#[allow(clippy::type_complexity)]
pub(crate) fn linear_backward(
    cpu: Cpu,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    (m, k, n): (usize, usize, usize),
    need: LinearGrads,
) -> (Option<Vec<f32>>, Option<Vec<f32>>, Option<Vec<f32>>) {
    let bf16 = large_bf16(cpu, (m, n, k));
    // dX = dY · Wᵀ: Wᵀ read where W is (strides (1, n)). Neither GEMM zero-fills its output first.
    let grad_x = |par| match bf16.and_then(|kernel| bf16_gemm::gemm_new(kernel, (dy, (n, 1)), (w, (1, n)), (m, n, k))) {
        Some(dx) => dx,
        None => gemm_new((m, k, n), (dy, (n, 1)), (w, (1, n)), par),
    };
    // dW = Xᵀ · dY: Xᵀ read where X is (strides (1, k)).
    let grad_w = |par| match bf16.and_then(|kernel| bf16_gemm::gemm_new(kernel, (x, (1, k)), (dy, (n, 1)), (k, m, n))) {
        Some(dw) => dw,
        None => gemm_new((k, n, m), (x, (1, k)), (dy, (n, 1)), par),
    };
    let (dx, dw) = match (need.x, need.w) {
        (true, true) if 2 * m * n * k < 400_000_000 => {
            let (dx, dw) = rayon::join(|| grad_x(gemm::Parallelism::None), || grad_w(gemm::Parallelism::None));
            (Some(dx), Some(dw))
        }
        (need_x, need_w) => {
            (need_x.then(|| grad_x(gemm_parallelism(m, k, n))), need_w.then(|| grad_w(gemm_parallelism(k, n, m))))
        }
    };
    let db = need.b.then(|| column_sums(dy, n, (0, n)));
    (dx, dw, db)
}

/// Where each of blocks `ns` wide starts when they sit side by side: `[0, n_1, n_1 + n_2, …]`.
pub(crate) fn column_offsets(ns: &[usize]) -> Vec<usize> {
    ns.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect()
}

/// Columns `at..at + n` of a row-major matrix `total` wide, as a contiguous `[rows, n]`.
pub(crate) fn column_block(matrix: &[f32], total: usize, (at, n): (usize, usize), rows: usize) -> Vec<f32> {
    (0..rows).flat_map(|r| &matrix[r * total + at..r * total + at + n]).copied().collect()
}

/// The sums of columns `at..at + n` of a row-major matrix `total` wide (a bias's gradient).
pub(crate) fn column_sums(matrix: &[f32], total: usize, (at, n): (usize, usize)) -> Vec<f32> {
    let mut sums = vec![0.0f32; n];
    for row in matrix.chunks_exact(total.max(1)) {
        sums.iter_mut().zip(&row[at..at + n]).for_each(|(s, v)| *s += v);
    }
    sums
}

/// The columns `[M, Σ N_i]` of several row-major `[M, N_i]` (or `[K, N_i]`) blocks side by side.
pub(crate) fn concat_columns(parts: &[&[f32]], ns: &[usize], rows: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * ns.iter().sum::<usize>());
    for r in 0..rows {
        for (part, &n) in parts.iter().zip(ns) {
            out.extend_from_slice(&part[r * n..(r + 1) * n]);
        }
    }
    out
}

/// `y = x · [w_1 | … | w_p] (+ b)`: several linear layers of one input (q/k/v, gate/up) with their
/// outputs side by side in one `[M, Σ N_i]`, each product writing its own columns, so that the
/// weights are read where they are instead of being concatenated at every call. `b`: the parts'
/// biases concatenated, `[Σ N_i]`. f32 GEMMs (the bf16 path multiplies a concatenated weight).
///
/// # Panics
/// If the parts' count differs from the widths' or a slice is shorter than its shape.
///
/// # Shapes
/// - x: `[M, K]`, w_i: `[K, N_i]`, b: `[Σ N_i]` -> `[M, Σ N_i]`
pub(crate) fn linear_multi(
    x: &[f32],
    ws: &[&[f32]],
    ns: &[usize],
    b: Option<&[f32]>,
    (m, k): (usize, usize),
) -> Vec<f32> {
    assert_eq!(ws.len(), ns.len(), "linear_multi: one width a weight");
    let total: usize = ns.iter().sum();
    if m == 0 {
        return Vec::new();
    }
    let offsets = column_offsets(ns);
    if let Some(b) = b {
        let mut y = b[..total].repeat(m);
        for ((w, &n), &off) in ws.iter().zip(ns).zip(&offsets) {
            gemm_strided(
                (m, n, k),
                (&mut y[off..], (total, 1)),
                true,
                (x, (k, 1)),
                (w, (n, 1)),
                1.0,
                gemm_parallelism(m, n, k),
            );
        }
        return y;
    }
    let mut y = Box::<[f32]>::new_uninit_slice(m * total);
    for ((w, &n), &off) in ws.iter().zip(ns).zip(&offsets) {
        let dst = y[off..].as_mut_ptr().cast::<f32>();
        let dst = (dst, m * total - off, (total, 1));
        // SAFETY: `dst` is the rest of the buffer allocated above, owned here; writing needs no
        // initialised value.
        unsafe { gemm_raw((m, n, k), dst, false, (x, (k, 1)), (w, (n, 1)), 1.0, gemm_parallelism(m, n, k)) };
    }
    // SAFETY: the parts' columns tile `0..total`, and each GEMM wrote all of its `m × n` block
    // (see [`gemm_new`]): every element is written.
    unsafe { y.assume_init() }.into_vec()
}

/// Gradients of [`linear_multi`] without a bias (the caller sums `dy`'s columns for one): `dX = Σ
/// dY_i · W_iᵀ` and `dW_i = Xᵀ · dY_i` where `need_w[i]`, `dY_i` the columns of part `i` of `dy`
/// read where they are; each `dW_i` comes out contiguous. Small products run as two tasks of one
/// thread (`dX`, the `dW`s), large ones one after the other on all threads.
///
/// # Shapes
/// - x: `[M, K]`, w_i: `[K, N_i]`, dy: `[M, Σ N_i]` -> (`[M, K]`, `[K, N_i]` each)
pub(crate) fn linear_multi_backward(
    x: &[f32],
    ws: &[&[f32]],
    ns: &[usize],
    dy: &[f32],
    (m, k): (usize, usize),
    (need_x, need_w): (bool, &[bool]),
) -> (Option<Vec<f32>>, Vec<Option<Vec<f32>>>) {
    assert!(ws.len() == ns.len() && need_w.len() == ns.len(), "linear_multi_backward: one width and need a weight");
    let total: usize = ns.iter().sum();
    if m == 0 {
        // No rows: zero gradients (and no slice of the empty `dy` to take).
        let dws = ns.iter().zip(need_w).map(|(&n, &need)| need.then(|| vec![0.0; k * n])).collect();
        return (need_x.then(Vec::new), dws);
    }
    let offsets = column_offsets(ns);
    let grad_x = |par: fn(usize, usize, usize) -> gemm::Parallelism| {
        let mut dx: Option<Vec<f32>> = None;
        for ((w, &n), &off) in ws.iter().zip(ns).zip(&offsets) {
            let (dy_i, w_t) = ((&dy[off..], (total, 1)), (*w, (1, n)));
            match &mut dx {
                None => dx = Some(gemm_new((m, k, n), dy_i, w_t, par(m, k, n))),
                Some(dx) => {
                    gemm_strided((m, k, n), (dx, (k, 1)), true, (dy_i.0, dy_i.1), (w_t.0, w_t.1), 1.0, par(m, k, n))
                }
            }
        }
        dx.unwrap_or_else(|| vec![0.0; m * k])
    };
    let grad_w = |par: fn(usize, usize, usize) -> gemm::Parallelism| -> Vec<Option<Vec<f32>>> {
        ns.iter()
            .zip(&offsets)
            .zip(need_w)
            .map(|((&n, &off), &need)| {
                need.then(|| gemm_new((k, n, m), (x, (1, k)), (&dy[off..], (total, 1)), par(k, n, m)))
            })
            .collect()
    };
    let one_thread: fn(usize, usize, usize) -> gemm::Parallelism = |_, _, _| gemm::Parallelism::None;
    if need_x && need_w.iter().any(|&w| w) && 2 * m * total * k < 400_000_000 {
        let (dx, dw) = rayon::join(|| grad_x(one_thread), || grad_w(one_thread));
        (Some(dx), dw)
    } else {
        (need_x.then(|| grad_x(gemm_parallelism)), grad_w(gemm_parallelism))
    }
}

/// One part's low-rank update in [`add_low_rank`]: `scale · (x · a) · b` (a LoRA adapter).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LowRank<'a> {
    /// `[K, rank]`.
    pub a: &'a [f32],
    /// `[rank, N_i]`.
    pub b: &'a [f32],
    pub rank: usize,
    pub scale: f32,
}

/// A part of a side-by-side product that has an update.
struct Adapted<'p, 'a> {
    /// Where its columns start in the product, and how many.
    off: usize,
    n: usize,
    /// Where its `r` columns start in `u = x · [a_1 | a_2 | …]`.
    at: usize,
    lr: &'p LowRank<'a>,
}

/// The parts that have an update, and `Σ r` (the width of `u`).
///
/// # Panics
/// If an update's rank is 0.
fn adapted<'p, 'a>(ns: &[usize], parts: &'p [Option<LowRank<'a>>]) -> (Vec<Adapted<'p, 'a>>, usize) {
    assert!(parts.iter().flatten().all(|lr| lr.rank > 0), "a low-rank update of rank 0");
    let (mut adapted, mut ranks) = (Vec::new(), 0);
    for ((part, &n), off) in parts.iter().zip(ns).zip(column_offsets(ns)) {
        if let Some(lr) = part {
            adapted.push(Adapted { off, n, at: ranks, lr });
            ranks += lr.rank;
        }
    }
    (adapted, ranks)
}

/// Rows of each task of the low-rank products: their GEMMs are too small (`r` of 8 or 16) to
/// split inside, so the rows are split across the threads instead.
fn low_rank_rows(m: usize) -> usize {
    m.div_ceil(rayon::current_num_threads()).max(64)
}

/// The adapted parts' down-projections side by side, `[a_1 | a_2 | …]` (`[K, Σ r]`): one GEMM makes
/// every part's `u`, and one pass adds every `dU_i · a_iᵀ` to `dX`, instead of one a part.
fn side_by_side_a((adapted, ranks): (&[Adapted], usize), k: usize) -> Vec<f32> {
    let mut a = vec![0.0f32; k * ranks];
    for &Adapted { at, lr, .. } in adapted {
        assert!(lr.a.len() >= k * lr.rank, "low-rank update: a holds {} values, not [{k}, {}]", lr.a.len(), lr.rank);
        for (row, part) in a.chunks_exact_mut(ranks).zip(lr.a.chunks_exact(lr.rank)).take(k) {
            row[at..at + lr.rank].copy_from_slice(part);
        }
    }
    a
}

/// `u = x · [a_1 | a_2 | …]` for a block of rows: `u` `[rows, Σ rank]`, `x` `[rows, K]`, `a` from
/// [`side_by_side_a`].
fn low_rank_inputs(u: &mut [f32], x: &[f32], a: &[f32], ranks: usize, k: usize) {
    let rows = u.len() / ranks.max(1);
    gemm_strided((rows, ranks, k), (u, (ranks, 1)), false, (x, (k, 1)), (a, (ranks, 1)), 1.0, gemm::Parallelism::None);
}

/// Adds the low-rank updates `scale_i · (x · a_i) · b_i` of the parts that have one to their
/// columns of `y` `[M, Σ N_i]` (the side-by-side product [`linear_multi`] made): LoRA inside the
/// linear layer, no `[M, N]` update tensor and no separate addition. Each block of rows makes its
/// `u = x · [a_1 | …]` once for all the adapters and accumulates each `u_i · b_i` into its columns,
/// the scale folded into the GEMM; the blocks run on all threads.
///
/// # Panics
/// If the parts' count differs from the widths', an update's rank is 0, or a slice is shorter than
/// its shape.
///
/// # Shapes
/// - y: `[M, Σ N_i]`, x: `[M, K]`, a_i: `[K, r_i]`, b_i: `[r_i, N_i]`
pub(crate) fn add_low_rank(y: &mut [f32], x: &[f32], ns: &[usize], parts: &[Option<LowRank>], (m, k): (usize, usize)) {
    assert_eq!(parts.len(), ns.len(), "add_low_rank: one part a width");
    let (adapted, ranks) = adapted(ns, parts);
    let total: usize = ns.iter().sum();
    if m == 0 || k == 0 || total == 0 || adapted.is_empty() {
        // Nothing to add (with K = 0 every update is zero).
        return;
    }
    let block = low_rank_rows(m);
    let a = side_by_side_a((&adapted, ranks), k);
    y[..m * total].par_chunks_mut(block * total).zip(x[..m * k].par_chunks(block * k)).for_each(|(y, x)| {
        let rows = y.len() / total;
        let mut u = vec![0.0f32; rows * ranks];
        low_rank_inputs(&mut u, x, &a, ranks, k);
        for &Adapted { off, n, at, lr } in &adapted {
            let none = gemm::Parallelism::None;
            gemm_strided(
                (rows, n, lr.rank),
                (&mut y[off..], (total, 1)),
                true,
                (&u[at..], (ranks, 1)),
                (lr.b, (n, 1)),
                lr.scale,
                none,
            );
        }
    });
}

/// The gradients `(dA_i, dB_i)` of one adapted part, each `None` where not asked for.
pub(crate) type LowRankGrads = (Option<Vec<f32>>, Option<Vec<f32>>);

/// Gradients of [`add_low_rank`] given `dy` `[M, Σ N_i]`: with `dU_i = scale_i · dY_i · b_iᵀ`,
/// adds `Σ dU_i · a_iᵀ` to `dx` (the base product's input gradient) where given, and returns each
/// adapted part's `dA_i = xᵀ · dU_i` and `dB_i = scale_i · u_iᵀ · dY_i` where `need` (one pair an
/// adapted part) asks; `u` is made again from `x` (`M × Σ r`, cheaper than keeping it). `dU`, `u`
/// and the `dX` term run in blocks of rows on all threads, the `dA`s and `dB`s (sums over the rows)
/// as one task each; `dY_i`, the `a`s and the `b`s are read where they are.
///
/// # Panics
/// If the parts' count differs from the widths' or from `need`'s, an update's rank is 0, or a
/// slice is shorter than its shape.
///
/// # Shapes
/// - x: `[M, K]`, a_i: `[K, r_i]`, b_i: `[r_i, N_i]`, dy: `[M, Σ N_i]`, dx: `[M, K]` ->
///   (`[K, r_i]`, `[r_i, N_i]`) each
pub(crate) fn low_rank_backward(
    x: &[f32],
    ns: &[usize],
    parts: &[Option<LowRank>],
    dy: &[f32],
    (m, k): (usize, usize),
    dx: Option<&mut [f32]>,
    need: &[(bool, bool)],
) -> Vec<LowRankGrads> {
    assert_eq!(parts.len(), ns.len(), "low_rank_backward: one part a width");
    let (adapted, ranks) = adapted(ns, parts);
    assert_eq!(adapted.len(), need.len(), "low_rank_backward: one need an adapted part");
    let total: usize = ns.iter().sum();
    if m == 0 || k == 0 || total == 0 || adapted.is_empty() {
        // No rows, no inputs (u = 0), no outputs (dU = 0) or no updates: zero gradients, and dX
        // unchanged.
        let zeros = |want: bool, len: usize| want.then(|| vec![0.0; len]);
        let grads = adapted.iter().zip(need);
        return grads.map(|(p, &(a, b))| (zeros(a, k * p.lr.rank), zeros(b, p.lr.rank * p.n))).collect();
    }
    let (need_du, need_u) = (dx.is_some() || need.iter().any(|&(a, _)| a), need.iter().any(|&(_, b)| b));
    if !need_du && !need_u {
        return vec![(None, None); adapted.len()];
    }
    let (mut du, mut u) = (vec![0.0f32; m * ranks], vec![0.0f32; m * ranks]);
    let a = side_by_side_a((&adapted, ranks), k);
    // One block of rows: its dU (and dX += dU · aᵀ), its u.
    let block = |du: &mut [f32], u: &mut [f32], dx: Option<&mut [f32]>, x: &[f32], dy: &[f32]| {
        let (rows, none) = (du.len() / ranks.max(1), gemm::Parallelism::None);
        if need_u {
            low_rank_inputs(u, x, &a, ranks, k);
        }
        for &Adapted { off, n, at, lr } in adapted.iter().filter(|_| need_du) {
            // dU_i = scale · dY_i · b_iᵀ: b_iᵀ read where b_i is (strides (1, n)).
            let (dy_i, b_t) = ((&dy[off..], (total, 1)), (lr.b, (1, n)));
            gemm_strided(
                (rows, lr.rank, n),
                (&mut du[at..], (ranks, 1)),
                false,
                (dy_i.0, dy_i.1),
                (b_t.0, b_t.1),
                lr.scale,
                none,
            );
        }
        if let Some(dx) = dx {
            // dX += Σ dU_i · a_iᵀ = dU · [a_1 | a_2 | …]ᵀ: one pass over dX.
            gemm_strided((rows, k, ranks), (dx, (k, 1)), true, (du, (ranks, 1)), (&a, (1, ranks)), 1.0, none);
        }
    };
    let rows = low_rank_rows(m);
    let blocks = du.par_chunks_mut(rows * ranks).zip(u.par_chunks_mut(rows * ranks));
    let inputs = x[..m * k].par_chunks(rows * k).zip(dy[..m * total].par_chunks(rows * total));
    match dx {
        Some(dx) => {
            blocks.zip(dx[..m * k].par_chunks_mut(rows * k)).zip(inputs).for_each(|(((du, u), dx), (x, dy))| {
                block(du, u, Some(dx), x, dy);
            })
        }
        None => blocks.zip(inputs).for_each(|((du, u), (x, dy))| block(du, u, None, x, dy)),
    }
    // dA = xᵀ · dU for every part at once (`[K, Σ r]`, each part's columns its dA_i), on all threads;
    // then dB_i = scale · u_iᵀ · dY_i, one task each.
    let (du, u) = (&du, &u);
    let da = need
        .iter()
        .any(|&(a, _)| a)
        .then(|| gemm_new((k, ranks, m), (x, (1, k)), (du, (ranks, 1)), gemm_parallelism(k, ranks, m)));
    let da_of = |at: usize, r: usize| -> Vec<f32> {
        da.as_deref()
            .map_or_else(Vec::new, |da| da.chunks_exact(ranks).flat_map(|row| &row[at..at + r]).copied().collect())
    };
    let tasks = adapted.iter().zip(need).flat_map(|(&Adapted { off, n, at, lr }, &(need_a, need_b))| {
        [(need_a, false, off, n, lr, at), (need_b, true, off, n, lr, at)]
    });
    let products: Vec<Option<Vec<f32>>> = tasks
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|(want, is_b, off, n, lr, at)| {
            // A large product (long sequences) splits across the threads too.
            let r = lr.rank;
            want.then(|| match is_b {
                false => da_of(at, r),
                true => {
                    let (u_t, dy_i) = ((&u[at..], (1, ranks)), (&dy[off..], (total, 1)));
                    gemm_new_scaled((r, n, m), u_t, dy_i, lr.scale, gemm_parallelism(r, n, m))
                }
            })
        })
        .collect();
    let mut products = products.into_iter();
    adapted.iter().map(|_| (products.next().flatten(), products.next().flatten())).collect()
}

multiversion! {
    /// One AdamW update in place (see [`crate::AdamWStep`]), in f32 like torch's, one pass over memory.
    pub(crate) fn adamw(cpu: Cpu, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &crate::AdamWStep) {
        let (b1, b2, scale) = (h.beta1 as f32, h.beta2 as f32, h.grad_scale as f32);
        let (lr, eps, keep) = (h.lr as f32, h.eps as f32, (1.0 - h.decay) as f32);
        let (inv_bias1, inv_bias2) = ((1.0 / h.bias1) as f32, (1.0 / h.bias2) as f32);
        const CHUNK: usize = 1 << 14;
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
            .for_each(|((p, g), (m, v))| {
                for i in 0..p.len() {
                    let g = g[i] * scale;
                    m[i] = b1 * m[i] + (1.0 - b1) * g;
                    v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                    p[i] = p[i] * keep - lr * (m[i] * inv_bias1) / ((v[i] * inv_bias2).sqrt() + eps);
                }
            });
    }
}

multiversion! {
    /// `Σ x²`, accumulated in f64.
    pub(crate) fn sum_squares(cpu: Cpu, x: &[f32]) -> f64 {
        // Eight f64 lanes a chunk (one AVX-512 vector), each summed in order, then added in order:
        // plain loops over arrays, so that nothing of it is left to a generic iterator that LLVM
        // may not inline into the wider copies.
        let chunk = |c: &[f32]| {
            let mut lanes = [0.0f64; 8];
            let (blocks, rest) = c.as_chunks::<8>();
            for block in blocks {
                for (lane, &v) in lanes.iter_mut().zip(block) {
                    *lane += f64::from(v) * f64::from(v);
                }
            }
            for (lane, &v) in lanes.iter_mut().zip(rest) {
                *lane += f64::from(v) * f64::from(v);
            }
            let mut sum = 0.0;
            for lane in lanes {
                sum += lane;
            }
            sum
        };
        // The chunks' sums added in order on one thread: rayon's own `sum` combines them in an order
        // that depends on work stealing, and the gradient norm would change from run to run.
        x.par_chunks(1 << 14).map(chunk).collect::<Vec<f64>>().into_iter().sum()
    }
}

/// `dst[m×n] (row stride dst_rs) = dst + beta·lhs[m×k]·rhs[k×n]` (or without the `dst` term when
/// not `accumulate`), all strided, on one thread: the attention callers run many in parallel.
#[allow(clippy::too_many_arguments)]
fn matmul(
    mnk: (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[f32],
    lhs_strides: (usize, usize),
    rhs: &[f32],
    rhs_strides: (usize, usize),
    beta: f32,
) {
    gemm_strided(
        mnk,
        (dst, (dst_rs, 1)),
        accumulate,
        (lhs, lhs_strides),
        (rhs, rhs_strides),
        beta,
        gemm::Parallelism::None,
    )
}

/// The layout of a batch of sequences for the attention kernels. Queries, keys and values come
/// packed in one buffer, as one GEMM with the concatenated q/k/v weights makes them: each row is
/// `[q heads | k heads | v heads]`, `(H + 2K)·Dh` wide.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Absolute position of each sequence's first token.
    pub start: usize,
    pub layout: RopeLayout,
    /// False when the tables are the identity's (learned positions): the kernels skip RoPE.
    pub rotate: bool,
    pub scale: f32,
    /// Packed documents: for each of the `B·T` positions, the index in its row of its document's
    /// first position. Query `i` then sees keys `first..=i` only, and its RoPE position is
    /// `start + i - first`. `None`: one document per row (plain causal attention).
    pub docs: Option<std::sync::Arc<[u32]>>,
}

impl AttnShape {
    /// Plain causal attention from position 0, one document a row, the half-split RoPE layout and
    /// the usual `1/√Dh` scale.
    pub fn causal(batch: usize, seq: usize, heads: usize, kv_heads: usize, head_dim: usize) -> AttnShape {
        AttnShape {
            batch,
            seq,
            heads,
            kv_heads,
            head_dim,
            start: 0,
            layout: RopeLayout::HalfSplit,
            rotate: true,
            scale: 1.0 / (head_dim as f32).sqrt(),
            docs: None,
        }
    }

    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The first key position that query `i` of row `b` sees.
    fn first_key(&self, b: usize, i: usize) -> usize {
        self.docs.as_ref().map_or(0, |d| d[b * self.seq + i] as usize)
    }

    /// The RoPE position of packed row `r` (position `r % T` of sequence `r / T`).
    fn position(&self, r: usize) -> usize {
        let (b, i) = (r / self.seq, r % self.seq);
        self.start + i - self.first_key(b, i)
    }

    /// Width of a packed q/k/v row.
    pub fn packed_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Column offsets of the k and v parts in a packed row.
    fn offsets(&self) -> (usize, usize) {
        (self.heads * self.head_dim, (self.heads + self.kv_heads) * self.head_dim)
    }
}

multiversion! {
    /// Rotates the q and k heads of every packed row (the first `H + K` heads) by their position's
    /// angles and copies the v heads; `inverse` rotates back (the gradient of the rotation).
    /// `cos`, `sin`: `[T_max, Dh/2]`.
    pub(crate) fn rope_packed(cpu: Cpu, qkv: &[f32], s: &AttnShape, cos: &[f32], sin: &[f32], inverse: bool) -> Vec<f32> {
        let dh = s.head_dim;
        let half = dh / 2;
        let width = s.packed_width();
        let rotated = (s.heads + s.kv_heads) * dh;
        let mut out = vec![0.0f32; qkv.len()];
        out.par_chunks_mut(width).zip(qkv.par_chunks(width)).enumerate().for_each(|(r, (o, xr))| {
            let pos = s.position(r);
            let (c, sn) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
            // The inverse rotation by the negated sine (a product by −1 is exact).
            let sign = if inverse { -1.0f32 } else { 1.0 };
            for (o, xr) in o[..rotated].chunks_exact_mut(dh).zip(xr[..rotated].chunks_exact(dh)) {
                match s.layout {
                    // Pairs `(i, i + Dh/2)`: four plain slices, so that the loop vectorises.
                    RopeLayout::HalfSplit => {
                        let ((oa, ob), (xa, xb)) = (o.split_at_mut(half), xr.split_at(half));
                        for i in 0..half {
                            let sin = sn[i] * sign;
                            oa[i] = xa[i] * c[i] - xb[i] * sin;
                            ob[i] = xa[i] * sin + xb[i] * c[i];
                        }
                    }
                    RopeLayout::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (2 * i, 2 * i + 1);
                            let sin = sn[i] * sign;
                            o[a] = xr[a] * c[i] - xr[b] * sin;
                            o[b] = xr[a] * sin + xr[b] * c[i];
                        }
                    }
                }
            }
            o[rotated..].copy_from_slice(&xr[rotated..]);
        });
        out
    }
}

/// What the forward pass keeps for the backward pass.
pub(crate) struct AttnOut {
    /// `[B, T, H, Dh]` rows.
    pub o: Vec<f32>,
    /// Log-sum-exp of each query's scaled scores, `[B, H, T]`.
    pub lse: Vec<f32>,
}

/// The maximum of `x` (at least one element) with 8 independent lanes, so that it vectorises.
#[inline(always)]
pub(super) fn lanes_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    rest.iter().chain(&acc).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// The sum of `x` with 8 independent lanes, so that it vectorises.
#[inline(always)]
pub(super) fn lanes_sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

/// `Σ a·b` with 8 independent lanes.
#[inline(always)]
pub(super) fn lanes_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// `Σ f(j)` over `j < n` with 8 independent lanes, like [`lanes_sum`], for sums of products that
/// are not in one slice.
#[inline(always)]
pub(crate) fn lanes_sum_by(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let mut j = 0;
    while j + 8 <= n {
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane += f(j + l);
        }
        j += 8;
    }
    let mut tail = 0.0f32;
    for j in j..n {
        tail += f(j);
    }
    lanes.iter().sum::<f32>() + tail
}

/// Query rows per block of the causal attention: block `[r0, r1)` only meets keys `0..r1`, so the
/// products skip the blocks above the diagonal (at T = 256, 4 blocks: 10 of 16 tiles computed).
const CAUSAL_BLOCK: usize = 64;

/// The row blocks `[r0, r1)` of a causal attention over `t` positions.
fn causal_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(CAUSAL_BLOCK).map(move |r0| (r0, (r0 + CAUSAL_BLOCK).min(t)))
}

/// Whether the attention's products take bf16 operands (f32 sums; the softmax stays f32): where
/// `cpu` has a bf16 kernel and the sequences are longer than 256 positions. Measured (`ember bench
/// attention`, 9/3 heads of 64, 2 Zen 5 cores): forward + backward 1.0× f32 at 256 positions (0.94×
/// with 6/6 heads), 1.2× at 320, 1.23× at 512, 1.42× at 1,024, 1.49× at 2,048. The products run on
/// the AVX512_BF16 vector kernel (AMX CPUs have it too).
pub(crate) fn attention_in_bf16(cpu: Cpu, s: &AttnShape) -> bool {
    cpu.bf16.is_some() && bf16_gemm::supported() && s.seq > 4 * CAUSAL_BLOCK && s.head_dim >= 32
}

/// Where a row block's products start in bf16: the block's first key rounded down to a panel of
/// the packed keys (the keys before it have `P = 0` in every row of the block, as those before the
/// first key do).
fn first_column(k0: usize, bf16: bool) -> usize {
    if bf16 {
        k0 - k0 % bf16_gemm::PANEL
    } else {
        k0
    }
}

/// One (batch, key/value head)'s keys and values packed for the bf16 products of all its blocks:
/// `Kᵀ` (`[Dh, T]`) for the scores; for the forward `V` (`[T, Dh]`), for the backward `Vᵀ` and `K`.
struct PackedKv {
    k_t: bf16_gemm::PackedPanels,
    v: Option<bf16_gemm::PackedPanels>,
    v_t: Option<bf16_gemm::PackedPanels>,
    k: Option<bf16_gemm::PackedPanels>,
}

impl PackedKv {
    /// `None` where the CPU lacks AVX512_BF16.
    fn new(kb: &[f32], vb: &[f32], s: &AttnShape, backward: bool) -> Option<PackedKv> {
        use bf16_gemm::{pack_panels, pack_rows, transpose_rows};
        let (t, dh, w) = (s.seq, s.head_dim, s.packed_width());
        // The transposes from rows converted a key at a time (each key's values are contiguous).
        let transposed = |x: &[f32]| pack_rows((x, (w, 1)), (t, dh)).map(|rows| transpose_rows(&rows));
        let k_t = transposed(kb)?;
        let (v, v_t, k) = match backward {
            true => (None, transposed(vb), pack_panels((kb, (w, 1)), (t, dh))),
            false => (pack_panels((vb, (w, 1)), (t, dh)), None, None),
        };
        Some(PackedKv { k_t, v, v_t, k })
    }
}

/// `c (+)= a · b` of an `[m, k]` operand and packed panels, on this thread (the bf16 arm of the
/// attention's products, see [`bf16_gemm::product_on_this_thread`]).
#[allow(clippy::too_many_arguments)]
fn bf16_product(
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    a: Strided<'_>,
    (m, k): (usize, usize),
    b: &bf16_gemm::PackedPanels,
    pair0: usize,
    columns: (usize, usize),
) {
    // Packed panels exist only where the CPU has the instructions, and so then do packed rows.
    let a = bf16_gemm::pack_rows(a, (m, k)).expect("packed panels, so the CPU has AVX512_BF16");
    bf16_gemm::product_on_this_thread(c, ldc, accumulate, &a, b, pair0, columns);
}

/// The panels of a `[rows, cols]` block (row stride `rs`) for the bf16 products that take it as `b`.
fn block_panels(x: &[f32], rs: usize, shape: (usize, usize)) -> Option<bf16_gemm::PackedPanels> {
    bf16_gemm::pack_panels((x, (rs, 1)), shape)
}

/// The `[cols, rows]` transpose of a row-major `[rows, cols]` matrix.
pub(super) fn transposed(x: &[f32], (rows, cols): (usize, usize)) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    for (i, row) in x.chunks_exact(cols.max(1)).take(rows).enumerate().filter(|_| cols > 0) {
        for (j, &v) in row.iter().enumerate() {
            out[j * rows + i] = v;
        }
    }
    out
}

multiversion! {
    /// Causal attention over packed rotated q/k/v rows, for every (batch, head); query head `h` reads
    /// key/value head `h / (H/K)`. Query `i` sees keys `0..=i`, or `first..=i` within its document
    /// (block-diagonal causal, see [`AttnShape::docs`]). With `bf16` (where the CPU has AVX512_BF16)
    /// the two products of each row block take bf16 operands with f32 sums, the keys and values
    /// packed once a head; the scale, the softmax and the log-sum-exp stay f32.
    ///
    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]` -> o: `[B·T, H·Dh]`, lse: `[B·H·T]`
    pub(crate) fn attention_in(cpu: Cpu, qkv: &[f32], s: &AttnShape, bf16: bool) -> AttnOut {
        let (t, h, dh) = (s.seq, s.heads, s.head_dim);
        let (w, (k_off, v_off)) = (s.packed_width(), s.offsets());
        // bf16: each (batch, key/value head)'s keys and values packed once for the heads that share them.
        let kh = s.kv_heads;
        let packed_kv: Vec<Option<PackedKv>> = match bf16 {
            true => (0..s.batch * kh)
                .into_par_iter()
                .map(|bk| {
                    let (rows, kv) = (&qkv[(bk / kh) * t * w..], bk % kh);
                    PackedKv::new(&rows[k_off + kv * dh..], &rows[v_off + kv * dh..], s, false)
                })
                .collect(),
            false => Vec::new(),
        };
        let blocks: Vec<(Vec<f32>, Vec<f32>)> = (0..s.batch * h)
            .into_par_iter()
            .map(|bh| {
                let (b, head) = (bh / h, bh % h);
                let kv = head / s.group();
                let rows = &qkv[b * t * w..];
                let (qb, kb, vb) = (&rows[head * dh..], &rows[k_off + kv * dh..], &rows[v_off + kv * dh..]);
                let packed = packed_kv.get(b * kh + kv).and_then(Option::as_ref);
                // The bf16 products leave the scale to the softmax.
                let scale = if packed.is_some() { s.scale } else { 1.0 };
                // One row block's scores at a time: row stride t, block rows use columns 0..r1.
                let mut scores = vec![0.0f32; CAUSAL_BLOCK.min(t) * t];
                let mut lse = vec![0.0f32; t];
                let mut o = vec![0.0f32; t * dh];
                for (r0, r1) in causal_blocks(t) {
                    let m = r1 - r0;
                    // Keys before `k0` are in earlier documents for every query of the block: skipped.
                    let k0 = (r0..r1).map(|i| s.first_key(b, i)).min().unwrap_or(0);
                    let k0 = first_column(k0, packed.is_some());
                    let sc = &mut scores[..m * t];
                    match packed {
                        Some(p) => bf16_product(&mut sc[k0..], t, false, (&qb[r0 * w..], (w, 1)), (m, dh), &p.k_t, 0, (k0, r1 - k0)),
                        None => matmul(
                            (m, r1 - k0, dh),
                            &mut sc[k0..],
                            t,
                            false,
                            &qb[r0 * w..],
                            (w, 1),
                            &kb[k0 * w..],
                            (1, w),
                            s.scale,
                        ),
                    }
                    for i in r0..r1 {
                        let row = &mut sc[(i - r0) * t..(i - r0) * t + r1];
                        let lo = s.first_key(b, i);
                        let max = lanes_max(&row[lo..=i]) * scale;
                        row[lo..=i].iter_mut().for_each(|p| *p = exp(*p * scale - max));
                        let sum = lanes_sum(&row[lo..=i]);
                        let inv = 1.0 / sum;
                        row[lo..=i].iter_mut().for_each(|p| *p *= inv);
                        row[k0..lo].iter_mut().for_each(|p| *p = 0.0);
                        row[i + 1..].iter_mut().for_each(|p| *p = 0.0);
                        lse[i] = max + sum.ln();
                    }
                    let o_blk = &mut o[r0 * dh..r1 * dh];
                    match packed.and_then(|p| p.v.as_ref()) {
                        Some(v) => bf16_product(o_blk, dh, false, (&sc[k0..], (t, 1)), (m, r1 - k0), v, k0 / 2, (0, dh)),
                        None => matmul((m, dh, r1 - k0), o_blk, dh, false, &sc[k0..], (t, 1), &vb[k0 * w..], (w, 1), 1.0),
                    }
                }
                (o, lse)
            })
            .collect();
        let mut o = vec![0.0f32; s.batch * t * h * dh];
        let mut lse = vec![0.0f32; s.batch * h * t];
        for (bh, (ob, lb)) in blocks.into_iter().enumerate() {
            let (b, head) = (bh / h, bh % h);
            for i in 0..t {
                let at = ((b * t + i) * h + head) * dh;
                o[at..at + dh].copy_from_slice(&ob[i * dh..(i + 1) * dh]);
            }
            lse[bh * t..(bh + 1) * t].copy_from_slice(&lb);
        }
        AttnOut { o, lse }
    }
}

multiversion! {
    /// Gradients of [`attention_in`] with respect to the packed rotated q/k/v, given the forward's
    /// output and log-sum-exp: per query head, `P` is recomputed from the scores and `lse`,
    /// `dV += Pᵀ dO`, `dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O))`, `dQ = scale · dS K`,
    /// `dK += scale · dSᵀ Q`. Heads sharing a key/value head are done by one task, which owns that
    /// head's `dK`, `dV`. With `bf16` the five products of each block take bf16 operands with f32
    /// sums (the scale folded into `dS`), as the forward's.
    ///
    /// # Shapes
    /// - qkv: `[B·T, (H + 2K)·Dh]`, d_o: `[B·T, H·Dh]` -> `[B·T, (H + 2K)·Dh]`
    pub(crate) fn attention_backward_in(
        cpu: Cpu,
        qkv: &[f32],
        saved: (&[f32], &[f32]),
        d_o: &[f32],
        s: &AttnShape,
        bf16: bool,
    ) -> Vec<f32> {
        let (o, lse) = saved;
        let (t, h, kh, dh) = (s.seq, s.heads, s.kv_heads, s.head_dim);
        let (w, (k_off, v_off)) = (s.packed_width(), s.offsets());
        let o_rs = h * dh;
        let group = s.group();
        let blocks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..s.batch * kh)
            .into_par_iter()
            .map(|bk| {
                let (b, kv) = (bk / kh, bk % kh);
                let rows = &qkv[b * t * w..];
                let (kb, vb) = (&rows[k_off + kv * dh..], &rows[v_off + kv * dh..]);
                let packed = bf16.then(|| PackedKv::new(kb, vb, s, true)).flatten();
                // The bf16 products leave the scale to the softmax and to dS.
                let scale = if packed.is_some() { s.scale } else { 1.0 };
                let (mut dk, mut dv) = (vec![0.0f32; t * dh], vec![0.0f32; t * dh]);
                let mut dq = vec![0.0f32; group * t * dh];
                // One row block of P and dP at a time (row stride t).
                let mut p = vec![0.0f32; CAUSAL_BLOCK.min(t) * t];
                let mut dp = vec![0.0f32; CAUSAL_BLOCK.min(t) * t];
                for g in 0..group {
                    let head = kv * group + g;
                    let qb = &rows[head * dh..];
                    let off = b * t * o_rs + head * dh;
                    let (ob, dob) = (&o[off..], &d_o[off..]);
                    let lse = &lse[(b * h + head) * t..(b * h + head + 1) * t];
                    let dqg = &mut dq[g * t * dh..(g + 1) * t * dh];
                    for (r0, r1) in causal_blocks(t) {
                        let m = r1 - r0;
                        // Columns `k0..r1` only: earlier keys are in other documents for the whole block.
                        let k0 = (r0..r1).map(|i| s.first_key(b, i)).min().unwrap_or(0);
                        let k0 = first_column(k0, packed.is_some());
                        let n = r1 - k0;
                        let (p, dp) = (&mut p[..m * t], &mut dp[..m * t]);
                        let (q_blk, do_blk) = (&qb[r0 * w..], &dob[r0 * o_rs..]);
                        let (k_blk, v_blk) = (&kb[k0 * w..], &vb[k0 * w..]);
                        match &packed {
                            Some(kv) => bf16_product(&mut p[k0..], t, false, (q_blk, (w, 1)), (m, dh), &kv.k_t, 0, (k0, n)),
                            None => matmul((m, n, dh), &mut p[k0..], t, false, q_blk, (w, 1), k_blk, (1, w), s.scale),
                        }
                        for i in r0..r1 {
                            let (row, l, lo) = (&mut p[(i - r0) * t..(i - r0) * t + r1], lse[i], s.first_key(b, i));
                            row[lo..=i].iter_mut().for_each(|x| *x = exp(*x * scale - l));
                            row[k0..lo].iter_mut().for_each(|x| *x = 0.0);
                            row[i + 1..].iter_mut().for_each(|x| *x = 0.0);
                        }
                        // bf16: dVᵀ[:, k0..r1] += dO_blkᵀ · P (dV kept transposed): P's rows become panels
                        // as they lie, and the output is as wide as the keys, not the head.
                        match packed.as_ref().and_then(|_| block_panels(&p[k0..], t, (m, n))) {
                            Some(p) => bf16_product(&mut dv[k0..], t, true, (do_blk, (1, o_rs)), (dh, m), &p, 0, (0, n)),
                            None => {
                                let dv_blk = &mut dv[k0 * dh..r1 * dh];
                                matmul((n, dh, m), dv_blk, dh, true, &p[k0..], (1, t), do_blk, (o_rs, 1), 1.0)
                            }
                        }
                        match packed.as_ref().and_then(|kv| kv.v_t.as_ref()) {
                            Some(v_t) => bf16_product(&mut dp[k0..], t, false, (do_blk, (o_rs, 1)), (m, dh), v_t, 0, (k0, n)),
                            None => matmul((m, n, dh), &mut dp[k0..], t, false, do_blk, (o_rs, 1), v_blk, (1, w), 1.0),
                        }
                        for i in r0..r1 {
                            let (o_i, do_i) = (&ob[i * o_rs..i * o_rs + dh], &dob[i * o_rs..i * o_rs + dh]);
                            let delta = lanes_dot(o_i, do_i);
                            let at = (i - r0) * t;
                            let (ds, p_row) = (&mut dp[at + k0..at + r1], &p[at + k0..at + i + 1]);
                            // P is zero outside the query's keys, so dS is too.
                            ds[..=i - k0].iter_mut().zip(p_row).for_each(|(d, &p)| *d = p * (*d - delta) * scale);
                            ds[i + 1 - k0..].iter_mut().for_each(|x| *x = 0.0);
                        }
                        let dq_blk = &mut dqg[r0 * dh..r1 * dh];
                        match packed.as_ref().and_then(|kv| kv.k.as_ref()) {
                            Some(k) => bf16_product(dq_blk, dh, false, (&dp[k0..], (t, 1)), (m, n), k, k0 / 2, (0, dh)),
                            None => matmul((m, dh, n), dq_blk, dh, false, &dp[k0..], (t, 1), k_blk, (w, 1), s.scale),
                        }
                        // bf16: dKᵀ[:, k0..r1] += Q_blkᵀ · dS, as dV.
                        match packed.as_ref().and_then(|_| block_panels(&dp[k0..], t, (m, n))) {
                            Some(ds) => bf16_product(&mut dk[k0..], t, true, (q_blk, (1, w)), (dh, m), &ds, 0, (0, n)),
                            None => {
                                let dk_blk = &mut dk[k0 * dh..r1 * dh];
                                matmul((n, dh, m), dk_blk, dh, true, &dp[k0..], (1, t), q_blk, (w, 1), s.scale)
                            }
                        }
                    }
                }
                if packed.is_some() {
                    (dk, dv) = (transposed(&dk, (dh, t)), transposed(&dv, (dh, t)));
                }
                (dq, dk, dv)
            })
            .collect();
        let mut d_qkv = vec![0.0f32; qkv.len()];
        for (bk, (dqb, dkb, dvb)) in blocks.into_iter().enumerate() {
            let (b, kv) = (bk / kh, bk % kh);
            for i in 0..t {
                let row = &mut d_qkv[(b * t + i) * w..(b * t + i + 1) * w];
                row[k_off + kv * dh..k_off + (kv + 1) * dh].copy_from_slice(&dkb[i * dh..(i + 1) * dh]);
                row[v_off + kv * dh..v_off + (kv + 1) * dh].copy_from_slice(&dvb[i * dh..(i + 1) * dh]);
                for g in 0..group {
                    let head = kv * group + g;
                    row[head * dh..(head + 1) * dh].copy_from_slice(&dqb[(g * t + i) * dh..(g * t + i + 1) * dh]);
                }
            }
        }
        d_qkv
    }
}

multiversion! {
    /// `act(g) · u` of packed rows `[g | u]`, `2F` wide, `act` the gate's activation.
    ///
    /// # Shapes
    /// - gu: `[N, 2F]` -> `[N, F]`
    pub(crate) fn glu_packed(cpu: Cpu, gu: &[f32], f: usize, gate: Gate) -> Vec<f32> {
        assert!(f > 0 && gu.len().is_multiple_of(2 * f), "glu: {} values in rows of 2·{f}", gu.len());
        let rows = gu.len() / (2 * f);
        let mut y = Box::<[f32]>::new_uninit_slice(rows * f);
        let per = rows_per_task(2 * f);
        y.par_chunks_mut(per * f).zip(gu.par_chunks(per * 2 * f)).for_each(|(y, gu)| {
            for (y, gu) in y.chunks_exact_mut(f).zip(gu.chunks_exact(2 * f)) {
                let (g, u) = gu.split_at(f);
                // One loop a gate, each of which vectorises (the match stays out of the loop).
                match gate {
                    Gate::Silu => {
                        for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                            y.write(g * sigmoid(g) * u);
                        }
                    }
                    Gate::GeluTanh => {
                        for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                            y.write(gelu_tanh(g) * u);
                        }
                    }
                }
            }
        });
        // SAFETY: gu is whole rows of 2F (asserted): each of y's rows was written above.
        unsafe { y.assume_init() }.into_vec()
    }
}

multiversion! {
    /// Gradient of [`glu_packed`], packed the same way: `dg = dy·u·act'(g)`, `du = dy·act(g)`.
    pub(crate) fn glu_packed_backward(cpu: Cpu, gu: &[f32], dy: &[f32], f: usize, gate: Gate) -> Vec<f32> {
        assert!(
            f > 0 && gu.len().is_multiple_of(2 * f) && dy.len() * 2 == gu.len(),
            "glu_backward: {} values and {} gradients in rows of 2·{f}",
            gu.len(),
            dy.len()
        );
        let mut d = Box::<[f32]>::new_uninit_slice(gu.len());
        let per = rows_per_task(2 * f);
        d.par_chunks_mut(per * 2 * f).zip(gu.par_chunks(per * 2 * f).zip(dy.par_chunks(per * f))).for_each(
            |(d, (gu, dy))| {
                for ((d, gu), dy) in d.chunks_exact_mut(2 * f).zip(gu.chunks_exact(2 * f)).zip(dy.chunks_exact(f)) {
                    let (g, u) = gu.split_at(f);
                    let (dg, du) = d.split_at_mut(f);
                    match gate {
                        Gate::Silu => {
                            for i in 0..f {
                                let s = sigmoid(g[i]);
                                du[i].write(dy[i] * g[i] * s);
                                dg[i].write(dy[i] * u[i] * s * (1.0 + g[i] * (1.0 - s)));
                            }
                        }
                        Gate::GeluTanh => {
                            for i in 0..f {
                                du[i].write(dy[i] * gelu_tanh(g[i]));
                                dg[i].write(dy[i] * u[i] * gelu_tanh_grad(g[i]));
                            }
                        }
                    }
                }
            },
        );
        // SAFETY: gu is whole rows of 2F and dy one row of F for each (asserted): every row was written.
        unsafe { d.assume_init() }.into_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This CPU, every product in f32.
    fn f32_cpu() -> Cpu {
        Cpu::f32_products()
    }

    /// This CPU with its bf16 kernel (`None` where it has none).
    fn bf16_cpu() -> Cpu {
        Cpu::detect()
    }

    #[test]
    fn linear_layers_of_one_and_a_few_rows_match_the_plain_loop_on_every_tier() {
        use crate::simd::{detected, Tier};
        use crate::testing::values;
        // One row (the few-rows kernel on AVX2-only CPUs, the GEMM crate elsewhere), a few, and
        // past FEW_ROWS; with and without a bias.
        let (k, n) = (70, 53);
        for tier in Tier::ALL.into_iter().filter(|&t| t <= detected()) {
            for m in [1, 3, FEW_ROWS, FEW_ROWS + 1] {
                let (x, w, b) = (values(m * k, 1), values(k * n, 2), values(n, 3));
                for bias in [None, Some(b.as_slice())] {
                    let got = linear(f32_cpu().capped(tier), &x, &w, bias, (m, k, n));
                    let mut want = match bias {
                        Some(b) => b.repeat(m),
                        None => vec![0.0; m * n],
                    };
                    crate::few_rows::reference(&mut want, bias.is_some(), &x, &w, (m, k, n));
                    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                    let written = got.len() == m * n && got.iter().all(|v| v.is_finite());
                    assert!(written && err < 1e-4, "{tier:?}, {m} rows, bias {}: {err}", bias.is_some());
                }
            }
        }
    }

    #[test]
    fn bf16_linear_layers_equal_the_bf16_reference() {
        if !crate::bf16_gemm::supported() {
            eprintln!("no AVX512_BF16 on this CPU: the bf16 linear path is not reachable here");
            return;
        }
        use crate::bf16_gemm::reference;
        // Large enough for the bf16 path (≥ 50 MFLOP each way).
        let (m, k, n) = (256, 320, 320);
        let val = |len: usize, seed: usize| -> Vec<f32> {
            (0..len).map(|i| ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0 - 1.0).collect()
        };
        let (x, w, dy, b) = (val(m * k, 1), val(k * n, 2), val(m * n, 3), val(n, 4));
        let close = |got: &[f32], want: &[f32], what: &str| {
            let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(err < 1e-3, "{what}: {err}");
        };
        let y = linear(bf16_cpu(), &x, &w, Some(&b), (m, k, n));
        let mut want = b.repeat(m);
        reference(&mut want, true, (&x, (k, 1)), (&w, (n, 1)), (m, k, n));
        close(&y, &want, "y");
        // The bf16 path was taken: f32 differs by more than f32 rounding.
        let y32 = linear(f32_cpu(), &x, &w, Some(&b), (m, k, n));
        assert!(y.iter().zip(&y32).any(|(a, b)| (a - b).abs() > 1e-3), "bf16 equals f32: not taken");
        // Without a bias: a new output the kernel writes whole (freed NaN blocks first).
        drop(std::hint::black_box(vec![f32::NAN; m * n]));
        let y = linear(bf16_cpu(), &x, &w, None, (m, k, n));
        let mut want = vec![0.0; m * n];
        reference(&mut want, false, (&x, (k, 1)), (&w, (n, 1)), (m, k, n));
        close(&y, &want, "y without a bias");
        let y32 = linear(f32_cpu(), &x, &w, None, (m, k, n));
        assert!(y.iter().zip(&y32).any(|(a, b)| (a - b).abs() > 1e-3), "bf16 equals f32 without a bias: not taken");
        let all = LinearGrads { x: true, w: true, b: false };
        let (dx, dw, _) = linear_backward(bf16_cpu(), &x, &w, &dy, (m, k, n), all);
        let mut want_dx = vec![0.0; m * k];
        reference(&mut want_dx, false, (&dy, (n, 1)), (&w, (1, n)), (m, n, k));
        close(&dx.expect("dx"), &want_dx, "dx");
        let mut want_dw = vec![0.0; k * n];
        reference(&mut want_dw, false, (&x, (1, k)), (&dy, (n, 1)), (k, m, n));
        close(&dw.expect("dw"), &want_dw, "dw");
        assert!(!bf16_worth_it(8, n, k), "a few rows stay f32");
    }
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
    }

    fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(err <= tol * scale, "{what}: max error {err} against scale {scale}");
    }

    /// Attention for one (batch, head), written out with f64 accumulators.
    fn attention_slow(q: &[f32], k: &[f32], v: &[f32], s: &AttnShape) -> Vec<f32> {
        let (t, h, kh, dh) = (s.seq, s.heads, s.kv_heads, s.head_dim);
        let mut o = vec![0.0f32; q.len()];
        for b in 0..s.batch {
            for head in 0..h {
                let kv = head / (h / kh);
                for i in 0..t {
                    let qi = &q[((b * t + i) * h + head) * dh..][..dh];
                    let lo = s.docs.as_ref().map_or(0, |d| d[b * t + i] as usize);
                    let scores: Vec<f64> = (lo..=i)
                        .map(|j| {
                            let kj = &k[((b * t + j) * kh + kv) * dh..][..dh];
                            qi.iter().zip(kj).map(|(x, y)| (*x as f64) * (*y as f64)).sum::<f64>() * s.scale as f64
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                    for d in 0..dh {
                        let mut acc = 0.0f64;
                        for (j, sc) in (lo..=i).zip(&scores) {
                            acc += (sc - max).exp() / z * v[((b * t + j) * kh + kv) * dh + d] as f64;
                        }
                        o[((b * t + i) * h + head) * dh + d] = acc as f32;
                    }
                }
            }
        }
        o
    }

    fn shape(batch: usize, seq: usize, heads: usize, kv_heads: usize, head_dim: usize) -> AttnShape {
        AttnShape::causal(batch, seq, heads, kv_heads, head_dim)
    }

    /// Every kernel built by `multiversion!` gives the same bits from each of its copies that this
    /// CPU can run: AVX-512, AVX2 + FMA, the baseline (what a CPU without them runs).
    #[test]
    fn every_copy_of_the_kernels_gives_the_same_bits() {
        use crate::simd::{detected, Tier};
        use crate::testing::values as val;
        let reachable: Vec<Tier> = Tier::ALL.into_iter().filter(|&t| t <= detected()).collect();
        if reachable.len() < Tier::ALL.len() {
            eprintln!("this CPU reaches the copies {reachable:?} only; the others are left to a CPU that has them");
        }
        let s = AttnShape { docs: docs(&[&[40, 60], &[100]]), ..shape(2, 100, 6, 2, 16) };
        let (cos, sin) = (val(100 * 8, 9).iter().map(|x| x.cos()).collect::<Vec<_>>(), val(100 * 8, 10));
        let (d, f) = (48, 40);
        let (x, w, dy) = (val(64 * d, 1), val(d, 2), val(64 * d, 3));
        let (gu, dyf) = (val(64 * 2 * f, 4), val(64 * f, 5));
        let qkv = val(2 * 100 * s.packed_width(), 6);
        let d_o = val(2 * 100 * 6 * 16, 7);
        let step = crate::AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            decay: 1e-4,
            bias1: 0.1,
            bias2: 0.05,
            grad_scale: 0.7,
        };
        let logits = val(3000, 8);
        let run = |cpu: Cpu| {
            let rope = rope_packed(cpu, &qkv, &s, &cos, &sin, false);
            let interleaved = AttnShape { layout: RopeLayout::Interleaved, ..s.clone() };
            let unrotated = rope_packed(cpu, &rope, &interleaved, &cos, &sin, true);
            let attn = attention_in(cpu, &rope, &s, false);
            let d_qkv = attention_backward_in(cpu, &rope, (&attn.o, &attn.lse), &d_o, &s, false);
            let (mut p, mut m, mut v) =
                (val(5000, 11), val(5000, 12), val(5000, 13).iter().map(|x| x.abs()).collect::<Vec<f32>>());
            adamw(cpu, &mut p, &val(5000, 14), &mut m, &mut v, &step);
            let (dx, dw) = rms_norm_backward(cpu, &x, &w, &dy, 1e-5);
            let mut dlogits = logits.clone();
            let loss = crate::cross_entropy::row_loss(cpu, &mut dlogits, 17, Some(0.5));
            [
                rms_norm(cpu, &x, &w, 1e-5),
                dx,
                dw,
                glu_packed(cpu, &gu, f, Gate::Silu),
                glu_packed_backward(cpu, &gu, &dyf, f, Gate::Silu),
                glu_packed(cpu, &gu, f, Gate::GeluTanh),
                glu_packed_backward(cpu, &gu, &dyf, f, Gate::GeluTanh),
                rope,
                attn.o,
                attn.lse,
                d_qkv,
                p,
                m,
                v,
                dlogits,
                unrotated,
                vec![loss as f32],
                // The f64's bytes, compared exactly like the rest.
                sum_squares(cpu, &x).to_bits().to_le_bytes().map(f32::from).to_vec(),
            ]
        };
        let widest = run(f32_cpu());
        for &cap in &reachable {
            let narrower = run(f32_cpu().capped(cap));
            for (i, (a, b)) in widest.iter().zip(&narrower).enumerate() {
                assert_eq!(a.len(), b.len());
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "output {i}: the {cap:?} copy differs from the {:?} one", detected());
            }
        }
    }

    /// Packs separate q `[N, H·Dh]`, k, v `[N, K·Dh]` into rows `[q | k | v]`.
    fn pack(q: &[f32], k: &[f32], v: &[f32], s: &AttnShape) -> Vec<f32> {
        let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let n = q.len() / qw;
        (0..n)
            .flat_map(|r| [&q[r * qw..(r + 1) * qw], &k[r * kw..(r + 1) * kw], &v[r * kw..(r + 1) * kw]].concat())
            .collect()
    }

    #[test]
    fn attention_matches_the_definition() {
        for s in [
            shape(2, 7, 4, 2, 6),
            shape(1, 1, 2, 2, 4),
            shape(1, 33, 3, 1, 8),
            shape(3, 5, 2, 2, 2),
            shape(1, 150, 2, 1, 4),
        ] {
            let q = random(s.batch * s.seq * s.heads * s.head_dim, 1);
            let k = random(s.batch * s.seq * s.kv_heads * s.head_dim, 2);
            let v = random(s.batch * s.seq * s.kv_heads * s.head_dim, 3);
            let got = attention_in(bf16_cpu(), &pack(&q, &k, &v, &s), &s, false);
            assert_close(&got.o, &attention_slow(&q, &k, &v, &s), 1e-5, &format!("{s:?}"));
        }
    }

    /// Document starts of rows cut into documents of the given lengths (each row's lengths summing
    /// to `seq`).
    fn docs(rows: &[&[usize]]) -> Option<std::sync::Arc<[u32]>> {
        let mut starts = Vec::new();
        for lens in rows {
            let mut at = 0;
            for &n in *lens {
                starts.extend(std::iter::repeat_n(at as u32, n));
                at += n;
            }
        }
        Some(starts.into())
    }

    #[test]
    fn document_attention_matches_the_definition() {
        // Documents of one position, documents across the 64-row blocks, a whole row as one.
        let long: &[usize] = &[1, 70, 5, 74];
        for s in [
            AttnShape { docs: docs(&[&[3, 4], &[1, 1, 5]]), ..shape(2, 7, 4, 2, 6) },
            AttnShape { docs: docs(&[long]), ..shape(1, 150, 2, 1, 4) },
            AttnShape { docs: docs(&[&[5], &[2, 3], &[1, 1, 1, 1, 1]]), ..shape(3, 5, 2, 2, 2) },
        ] {
            let q = random(s.batch * s.seq * s.heads * s.head_dim, 1);
            let k = random(s.batch * s.seq * s.kv_heads * s.head_dim, 2);
            let v = random(s.batch * s.seq * s.kv_heads * s.head_dim, 3);
            let got = attention_in(bf16_cpu(), &pack(&q, &k, &v, &s), &s, false);
            assert_close(&got.o, &attention_slow(&q, &k, &v, &s), 1e-5, &format!("{s:?}"));
        }
    }

    #[test]
    fn bf16_attention_and_its_backward_are_within_bf16_rounding_of_f32() {
        if !crate::bf16_gemm::supported() {
            eprintln!("no AVX512_BF16 on this CPU: the bf16 attention is not reachable here");
            return;
        }
        // 200 positions: neither a whole number of 48-key panels nor of 64-row blocks; grouped
        // heads; documents that start inside a panel and inside a block; a head size of 32.
        let long: &[usize] = &[1, 70, 5, 74, 50];
        for s in [
            shape(2, 200, 4, 2, 64),
            AttnShape { docs: docs(&[long, &[100, 100]]), ..shape(2, 200, 4, 2, 64) },
            shape(1, 129, 2, 1, 32),
        ] {
            let (n, dh) = (s.batch * s.seq, s.head_dim);
            // Queries three times the keys' size: peaked attention, as trained models have.
            let q: Vec<f32> = random(n * s.heads * dh, 41).iter().map(|x| 3.0 * x).collect();
            let (k, v) = (random(n * s.kv_heads * dh, 42), random(n * s.kv_heads * dh, 43));
            let qkv = pack(&q, &k, &v, &s);
            let (exact, rounded) =
                (attention_in(bf16_cpu(), &qkv, &s, false), attention_in(bf16_cpu(), &qkv, &s, true));
            let what = format!("{s:?}");
            // bf16 operands (8 significant bits, f32 sums): outputs within 1 % of their largest.
            assert_close(&rounded.o, &exact.o, 1e-2, &format!("o, {what}"));
            assert_close(&rounded.lse, &exact.lse, 1e-2, &format!("lse, {what}"));
            let diff = rounded.o.iter().zip(&exact.o).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(diff > 1e-5, "bf16 equals f32: not taken ({what})");
            assert!(rounded.o.iter().chain(&rounded.lse).all(|x| x.is_finite()), "{what}");
            let d_o = random(n * s.heads * dh, 44);
            let grads =
                |out: &AttnOut, bf16| attention_backward_in(bf16_cpu(), &qkv, (&out.o, &out.lse), &d_o, &s, bf16);
            let (exact, rounded) = (grads(&exact, false), grads(&rounded, true));
            // Gradients within 2 % of their largest, per part (q, k, v).
            let (qw, kw) = (s.heads * dh, s.kv_heads * dh);
            for (part, (at, width)) in ["dq", "dk", "dv"].iter().zip([(0, qw), (qw, kw), (qw + kw, kw)]) {
                let cols = |g: &[f32]| -> Vec<f32> {
                    g.chunks(s.packed_width()).flat_map(|r| r[at..at + width].to_vec()).collect()
                };
                assert_close(&cols(&rounded), &cols(&exact), 2e-2, &format!("{part}, {what}"));
            }
        }
    }

    #[test]
    fn attention_backward_matches_finite_differences() {
        for s in [shape(2, 5, 4, 2, 4), AttnShape { docs: docs(&[&[2, 3], &[1, 4]]), ..shape(2, 5, 4, 2, 4) }] {
            attention_backward_case(&s);
        }
    }

    fn attention_backward_case(s: &AttnShape) {
        let s = s.clone();
        let q = random(s.batch * s.seq * 4 * 4, 4);
        let k = random(s.batch * s.seq * 2 * 4, 5);
        let v = random(s.batch * s.seq * 2 * 4, 6);
        let packed = pack(&q, &k, &v, &s);
        let w = random(q.len(), 7); // loss = Σ w ⊙ o
        let loss = |qkv: &[f32]| -> f64 {
            attention_in(bf16_cpu(), qkv, &s, false).o.iter().zip(&w).map(|(a, b)| (*a as f64) * (*b as f64)).sum()
        };
        let out = attention_in(bf16_cpu(), &packed, &s, false);
        let grad = attention_backward_in(bf16_cpu(), &packed, (&out.o, &out.lse), &w, &s, false);
        let eps = 1e-3f32;
        let width = s.packed_width();
        // A q, a k and a v entry of the first and last rows, and a few more.
        for idx in [0usize, 17, 25, 31, width, 3 * width + 20, packed.len() - 1] {
            let (mut up, mut down) = (packed.clone(), packed.clone());
            up[idx] += eps;
            down[idx] -= eps;
            let fd = ((loss(&up) - loss(&down)) / (2.0 * eps as f64)) as f32;
            assert!((fd - grad[idx]).abs() < 2e-3, "index {idx}: {fd} vs {}", grad[idx]);
        }
    }

    #[test]
    fn large_linear_products_on_all_threads_match_the_definition() {
        // Big enough that each product runs on all threads in turn (not side by side); checked on a
        // sample of entries.
        let (m, k, n) = (1024, 512, 400);
        let (x, w, dy) = (random(m * k, 30), random(k * n, 31), random(m * n, 32));
        let y = linear(f32_cpu(), &x, &w, None, (m, k, n));
        let (dx, dw, _) =
            linear_backward(f32_cpu(), &x, &w, &dy, (m, k, n), LinearGrads { x: true, w: true, b: false });
        let (dx, dw) = (dx.unwrap(), dw.unwrap());
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(33);
        for _ in 0..200 {
            let (i, p, j) = (r.random_range(0..m), r.random_range(0..k), r.random_range(0..n));
            let want_y: f32 = (0..k).map(|q| x[i * k + q] * w[q * n + j]).sum();
            let want_dx: f32 = (0..n).map(|c| dy[i * n + c] * w[p * n + c]).sum();
            let want_dw: f32 = (0..m).map(|row| x[row * k + p] * dy[row * n + j]).sum();
            assert!((y[i * n + j] - want_y).abs() < 1e-3, "y[{i},{j}]");
            assert!((dx[i * k + p] - want_dx).abs() < 1e-3, "dx[{i},{p}]");
            assert!((dw[p * n + j] - want_dw).abs() < 1e-3, "dw[{p},{j}]");
        }
    }

    #[test]
    fn products_into_unfilled_outputs_write_every_element() {
        // The outputs of `gemm_new` are not zero-filled: every element must come from the GEMM. The
        // allocator tends to hand this thread back what it just freed, so NaN-filled blocks of the
        // same sizes are freed first (best effort: outputs made on other threads, or fresh from
        // the kernel, start as zeros); an unwritten element shows as NaN, or as a zero where the
        // product is not.
        let all = LinearGrads { x: true, w: true, b: false };
        for (m, k, n) in [(40, 0, 24), (17, 1, 9), (33, 64, 70), (300, 40, 130)] {
            let (x, w, dy) = (random(m * k, 40), random(k * n, 41), random(m * n, 42));
            for len in [m * n, m * k, k * n] {
                drop(std::hint::black_box(vec![f32::NAN; len]));
            }
            let y = linear(f32_cpu(), &x, &w, None, (m, k, n));
            let (dx, dw, _) = linear_backward(f32_cpu(), &x, &w, &dy, (m, k, n), all);
            let (dx, dw) = (dx.expect("dx"), dw.expect("dw"));
            assert_eq!((y.len(), dx.len(), dw.len()), (m * n, m * k, k * n));
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum();
                    assert!((y[i * n + j] - want).abs() < 1e-4, "({m}, {k}, {n}) y[{i},{j}]: {}", y[i * n + j]);
                }
                for p in 0..k {
                    let want: f32 = (0..n).map(|j| dy[i * n + j] * w[p * n + j]).sum();
                    assert!((dx[i * k + p] - want).abs() < 1e-4, "({m}, {k}, {n}) dx[{i},{p}]");
                }
            }
            for p in 0..k {
                for j in 0..n {
                    let want: f32 = (0..m).map(|i| x[i * k + p] * dy[i * n + j]).sum();
                    assert!((dw[p * n + j] - want).abs() < 1e-4, "({m}, {k}, {n}) dw[{p},{j}]");
                }
            }
        }
    }

    /// `a · b` by the plain loop in f64, both read through their (row, column) strides.
    fn plain(
        a: &[f32],
        (ars, acs): (usize, usize),
        b: &[f32],
        (brs, bcs): (usize, usize),
        mkn: [usize; 3],
    ) -> Vec<f32> {
        let [m, k, n] = mkn;
        let at = |i: usize, j: usize| {
            (0..k).map(|p| f64::from(a[i * ars + p * acs]) * f64::from(b[p * brs + j * bcs])).sum::<f64>() as f32
        };
        (0..m).flat_map(|i| (0..n).map(move |j| (i, j))).map(|(i, j)| at(i, j)).collect()
    }

    #[test]
    fn low_rank_updates_equal_the_plain_products() {
        // q/k/v with adapters on q and v (k without one); two parts of different ranks; a part whose
        // u·b, dU and dB products (2·2048·8·1536 ≥ 50 MFLOP) run on all threads; K = 0; no rows;
        // no part adapted.
        let cases = [
            (37, 24, vec![16, 8, 8], vec![4, 0, 2]),
            (130, 40, vec![64, 33], vec![8, 16]),
            (2048, 16, vec![1536], vec![8]),
            (9, 0, vec![5], vec![3]),
            (0, 8, vec![3, 5], vec![2, 2]),
            (10, 6, vec![4, 3], vec![0, 0]),
        ];
        for (m, k, ns, ranks) in cases {
            let what = format!("({m}, {k}, {ns:?}, ranks {ranks:?})");
            let total: usize = ns.iter().sum();
            let (x, dy) = (random(m * k, 70), random(m * total, 71));
            let ws: Vec<Vec<f32>> = ns.iter().enumerate().map(|(i, &n)| random(k * n, 72 + i as u64)).collect();
            let ws: Vec<&[f32]> = ws.iter().map(Vec::as_slice).collect();
            let ab: Vec<(Vec<f32>, Vec<f32>)> = ns
                .iter()
                .zip(&ranks)
                .map(|(&n, &r)| (random(k * r, 80 + r as u64), random(r * n, 90 + n as u64)))
                .collect();
            let parts: Vec<Option<LowRank>> = (0..ns.len())
                .map(|i| {
                    (ranks[i] > 0).then(|| LowRank { a: &ab[i].0, b: &ab[i].1, rank: ranks[i], scale: 0.5 + i as f32 })
                })
                .collect();
            // The reference: one weight with each update folded in, W_i + scale_i · a_i · b_i.
            let mut w = concat_columns(&ws, &ns, k);
            let mut off = 0;
            for (part, &n) in parts.iter().zip(&ns) {
                if let Some(lr) = part {
                    let delta = plain(lr.a, (lr.rank, 1), lr.b, (n, 1), [k, lr.rank, n]);
                    for (row, d) in delta.chunks_exact(n.max(1)).enumerate().filter(|_| n > 0) {
                        let w_row = &mut w[row * total + off..row * total + off + n];
                        w_row.iter_mut().zip(d).for_each(|(w, d)| *w += lr.scale * d);
                    }
                }
                off += n;
            }
            let mut y = linear_multi(&x, &ws, &ns, None, (m, k));
            add_low_rank(&mut y, &x, &ns, &parts, (m, k));
            assert_close(&y, &plain(&x, (k, 1), &w, (total, 1), [m, k, total]), 1e-5, &format!("y {what}"));

            let (dx, _) = linear_multi_backward(&x, &ws, &ns, &dy, (m, k), (true, &vec![false; ns.len()]));
            let mut dx = dx.expect("dx");
            let adapted = parts.iter().filter(|p| p.is_some()).count();
            let grads = low_rank_backward(&x, &ns, &parts, &dy, (m, k), Some(&mut dx), &vec![(true, true); adapted]);
            assert_close(&dx, &plain(&dy, (total, 1), &w, (1, total), [m, total, k]), 1e-5, &format!("dx {what}"));
            let (mut off, mut grads) = (0, grads.into_iter());
            for (part, &n) in parts.iter().zip(&ns) {
                if let Some(lr) = part {
                    let (da, db) = grads.next().expect("one pair an adapted part");
                    let r = lr.rank;
                    let dy_i = column_block(&dy, total, (off, n), m);
                    // dA = xᵀ · (scale · dY_i · bᵀ); dB = scale · (x · a)ᵀ · dY_i.
                    let du: Vec<f32> =
                        plain(&dy_i, (n, 1), lr.b, (1, n), [m, n, r]).iter().map(|v| v * lr.scale).collect();
                    let u = plain(&x, (k, 1), lr.a, (r, 1), [m, k, r]);
                    let want_db: Vec<f32> =
                        plain(&u, (1, r), &dy_i, (n, 1), [r, m, n]).iter().map(|v| v * lr.scale).collect();
                    assert_close(
                        &da.expect("dA"),
                        &plain(&x, (1, k), &du, (r, 1), [k, m, r]),
                        1e-5,
                        &format!("dA {what}"),
                    );
                    assert_close(&db.expect("dB"), &want_db, 1e-5, &format!("dB {what}"));
                }
                off += n;
            }
            // Only dB asked for, no dX: dA not formed.
            let grads = low_rank_backward(&x, &ns, &parts, &dy, (m, k), None, &vec![(false, true); adapted]);
            assert!(grads.iter().all(|(da, db)| da.is_none() && db.is_some()), "{what}: gradients not asked for");
        }
    }

    #[test]
    fn side_by_side_products_equal_the_concatenated_weight() {
        // q/k/v-like parts, a part of one column, and K = 0; with and without a bias.
        // Then: a middle part whose dX product (≥ 50 MFLOP) accumulates on all threads when dX is
        // asked for alone; no rows.
        let cases = [
            (50, 24, vec![16, 8, 8]),
            (300, 40, vec![64, 1, 130]),
            (20, 0, vec![5, 7]),
            (512, 128, vec![128, 384, 128]),
            (0, 8, vec![3, 5]),
        ];
        for (m, k, ns) in cases {
            let ws: Vec<Vec<f32>> = ns.iter().enumerate().map(|(i, &n)| random(k * n, 50 + i as u64)).collect();
            let parts: Vec<&[f32]> = ws.iter().map(Vec::as_slice).collect();
            let total: usize = ns.iter().sum();
            let (x, dy, b) = (random(m * k, 60), random(m * total, 61), random(total, 62));
            let packed = concat_columns(&parts, &ns, k);
            for bias in [None, Some(&b[..])] {
                drop(std::hint::black_box(vec![f32::NAN; m * total]));
                let got = linear_multi(&x, &parts, &ns, bias, (m, k));
                let want = linear(f32_cpu(), &x, &packed, bias, (m, k, total));
                assert_close(&got, &want, 1e-5, &format!("y ({m}, {k}, {ns:?}) bias {}", bias.is_some()));
            }
            let all = LinearGrads { x: true, w: true, b: false };
            let (want_dx, want_dw, _) = linear_backward(f32_cpu(), &x, &packed, &dy, (m, k, total), all);
            let (want_dx, want_dw) = (want_dx.expect("dx"), want_dw.expect("dw"));
            let mut need = vec![true; ns.len()];
            need[0] = false; // a frozen part
            let (dx, dws) = linear_multi_backward(&x, &parts, &ns, &dy, (m, k), (true, &need));
            assert_close(&dx.expect("dx"), &want_dx, 1e-5, &format!("dx ({m}, {k}, {ns:?})"));
            assert!(dws[0].is_none(), "a frozen part got a gradient");
            let mut off = 0;
            for (dw, &n) in dws.iter().zip(&ns) {
                if let Some(dw) = dw {
                    let want = column_block(&want_dw, total, (off, n), k);
                    assert_close(dw, &want, 1e-5, &format!("dw at column {off} ({m}, {k}, {ns:?})"));
                }
                off += n;
            }
            // dX alone: the products one after the other.
            let (dx, _) = linear_multi_backward(&x, &parts, &ns, &dy, (m, k), (true, &vec![false; ns.len()]));
            assert_close(&dx.expect("dx"), &want_dx, 1e-5, "dx alone");
        }
    }

    #[test]
    fn linear_and_its_backward_match_the_definition() {
        let (m, k, n) = (5, 7, 3);
        let (x, w, b, dy) = (random(m * k, 20), random(k * n, 21), random(n, 22), random(m * n, 23));
        let y = linear(f32_cpu(), &x, &w, Some(&b), (m, k, n));
        let (dx, dw, db) =
            linear_backward(f32_cpu(), &x, &w, &dy, (m, k, n), LinearGrads { x: true, w: true, b: true });
        let (dx, dw) = (dx.unwrap(), dw.unwrap());
        let only_w = linear_backward(f32_cpu(), &x, &w, &dy, (m, k, n), LinearGrads { x: false, w: true, b: false });
        assert!(only_w.0.is_none() && only_w.2.is_none() && only_w.1.as_deref() == Some(&dw[..]));
        for i in 0..m {
            for j in 0..n {
                let want: f32 = b[j] + (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum::<f32>();
                assert!((y[i * n + j] - want).abs() < 1e-5);
            }
            for p in 0..k {
                let want: f32 = (0..n).map(|j| dy[i * n + j] * w[p * n + j]).sum();
                assert!((dx[i * k + p] - want).abs() < 1e-5);
            }
        }
        for p in 0..k {
            for j in 0..n {
                let want: f32 = (0..m).map(|i| x[i * k + p] * dy[i * n + j]).sum();
                assert!((dw[p * n + j] - want).abs() < 1e-5);
            }
        }
        let db = db.unwrap();
        for j in 0..n {
            assert!((db[j] - (0..m).map(|i| dy[i * n + j]).sum::<f32>()).abs() < 1e-5);
        }
    }

    #[test]
    fn rms_norm_and_swiglu_backward_match_finite_differences() {
        let (n, d) = (3, 7);
        let x = random(n * d, 8);
        let w = random(d, 9);
        let dy = random(n * d, 10);
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            rms_norm(f32_cpu(), x, w, 1e-5).iter().zip(&dy).map(|(a, b)| (*a as f64) * (*b as f64)).sum()
        };
        let (dx, dw) = rms_norm_backward(f32_cpu(), &x, &w, &dy, 1e-5);
        let eps = 1e-3f32;
        for idx in 0..n * d {
            let (mut up, mut down) = (x.clone(), x.clone());
            up[idx] += eps;
            down[idx] -= eps;
            let fd = ((loss(&up, &w) - loss(&down, &w)) / (2.0 * eps as f64)) as f32;
            assert!((fd - dx[idx]).abs() < 2e-3, "dx[{idx}]: {fd} vs {}", dx[idx]);
        }
        for idx in 0..d {
            let (mut up, mut down) = (w.clone(), w.clone());
            up[idx] += eps;
            down[idx] -= eps;
            let fd = ((loss(&x, &up) - loss(&x, &down)) / (2.0 * eps as f64)) as f32;
            assert!((fd - dw[idx]).abs() < 2e-3, "dw[{idx}]: {fd} vs {}", dw[idx]);
        }
        let f = 11;
        let gu = random(2 * f, 11);
        let dy = random(f, 13);
        let y = glu_packed(f32_cpu(), &gu, f, Gate::Silu);
        let d = glu_packed_backward(f32_cpu(), &gu, &dy, f, Gate::Silu);
        let silu_mul = |g: f32, u: f32| g / (1.0 + (-g).exp()) * u;
        for i in 0..f {
            let (g, u) = (gu[i], gu[f + i]);
            assert!((y[i] - silu_mul(g, u)).abs() < 1e-6);
            let fd_g = (silu_mul(g + eps, u) - silu_mul(g - eps, u)) / (2.0 * eps) * dy[i];
            let fd_u = (silu_mul(g, u + eps) - silu_mul(g, u - eps)) / (2.0 * eps) * dy[i];
            assert!((fd_g - d[i]).abs() < 1e-3 && (fd_u - d[f + i]).abs() < 1e-3, "{i}");
        }
    }

    #[test]
    fn fast_exp_matches_the_library_exp() {
        let mut worst = 0.0f64;
        for i in 0..=2_000_000 {
            let x = -87.0 + 175.0 * i as f32 / 2_000_000.0;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1e-37 && exp(-1000.0) < 1e-37);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn rope_inverse_undoes_rope() {
        let s = AttnShape { start: 3, layout: RopeLayout::Interleaved, ..shape(2, 5, 3, 3, 8) };
        let (cos, sin): (Vec<f32>, Vec<f32>) =
            (0..(16 * 4)).map(|i| ((i as f32 * 0.37).cos(), (i as f32 * 0.37).sin())).unzip();
        let x = random(2 * 5 * s.packed_width(), 14);
        let rotated = rope_packed(f32_cpu(), &x, &s, &cos, &sin, false);
        assert!(rotated.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-3), "the rotation moved nothing");
        let back = rope_packed(f32_cpu(), &rotated, &s, &cos, &sin, true);
        assert_close(&back, &x, 1e-6, "inverse");
    }
}
