//! CPU kernels of the fused ops, on f32 slices: RMSNorm, SwiGLU, and RoPE + causal grouped-query
//! attention, each with its backward pass. Rows are split across threads with rayon; the attention's
//! per-head products run through the `gemm` crate with strides, reading queries, keys and values
//! where the projections put them (`[B, T, heads, Dh]` rows), so no transposed copy is ever made.
//!
//! Every kernel has a test against a direct transcription of its formula (`mod tests`), and the
//! Burn-level ops built on them are tested against the plain tensor compositions (values and
//! gradients) in `ops::fused`.

use rayon::prelude::*;

use crate::config::RopeLayout;

/// Rows per rayon task in the row-wise kernels: enough work per task to outweigh scheduling.
fn rows_per_task(d: usize) -> usize {
    (16_384 / d.max(1)).max(1)
}

/// `y = x / sqrt(mean(x²) + eps) · w`, row by row.
///
/// # Shapes
/// - x: `[N, D]`, w: `[D]` -> `[N, D]`
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut y = vec![0.0f32; x.len()];
    let chunk = rows_per_task(d) * d;
    y.par_chunks_mut(chunk).zip(x.par_chunks(chunk)).for_each(|(y, x)| {
        for (yr, xr) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                *o = v * inv * g;
            }
        }
    });
    y
}

/// Gradients of [`rms_norm`]: with `x̂ = x·r`, `r = 1/sqrt(mean(x²)+eps)` and `g = dy·w`,
/// `dx = r·(g − x̂·mean(g·x̂))` and `dw = Σ_rows dy·x̂`.
pub fn rms_norm_backward(x: &[f32], w: &[f32], dy: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let d = w.len();
    let mut dx = vec![0.0f32; x.len()];
    let chunk = rows_per_task(d) * d;
    let dw = dx
        .par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk).zip(dy.par_chunks(chunk)))
        .map(|(dx, (x, dy))| {
            let mut dw = vec![0.0f32; d];
            for ((dxr, xr), dyr) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(dy.chunks_exact(d)) {
                let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
                let r = 1.0 / (ms + eps).sqrt();
                let mut dot = 0.0f32; // Σ g·x̂
                for j in 0..d {
                    let xh = xr[j] * r;
                    dot += dyr[j] * w[j] * xh;
                    dw[j] += dyr[j] * xh;
                }
                let mean = dot / d as f32;
                for j in 0..d {
                    dxr[j] = r * (dyr[j] * w[j] - xr[j] * r * mean);
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
    (dx, dw)
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// `silu(g) · u`, elementwise.
pub fn swiglu(g: &[f32], u: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0f32; g.len()];
    y.par_chunks_mut(16_384).zip(g.par_chunks(16_384).zip(u.par_chunks(16_384))).for_each(|(y, (g, u))| {
        for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
            *y = g * sigmoid(g) * u;
        }
    });
    y
}

/// Gradients of [`swiglu`]: `dg = dy·u·σ(g)·(1 + g·(1 − σ(g)))`, `du = dy·silu(g)`.
pub fn swiglu_backward(g: &[f32], u: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dg = vec![0.0f32; g.len()];
    let mut du = vec![0.0f32; g.len()];
    dg.par_chunks_mut(16_384)
        .zip(du.par_chunks_mut(16_384))
        .zip(g.par_chunks(16_384).zip(u.par_chunks(16_384)).zip(dy.par_chunks(16_384)))
        .for_each(|((dg, du), ((g, u), dy))| {
            for i in 0..g.len() {
                let s = sigmoid(g[i]);
                du[i] = dy[i] * g[i] * s;
                dg[i] = dy[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
            }
        });
    (dg, du)
}

/// The layout of a batch of sequences for the attention kernels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Absolute position of each sequence's first token.
    pub start: usize,
    pub layout: RopeLayout,
    pub scale: f32,
}

impl AttnShape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// Rotates every head of every row of `x` (`[B, T, heads, Dh]` rows) by its position's angles;
/// `inverse` rotates back (the gradient of the rotation). `cos`, `sin`: `[T_max, Dh/2]`.
pub fn rope(x: &[f32], heads: usize, s: &AttnShape, cos: &[f32], sin: &[f32], inverse: bool) -> Vec<f32> {
    let dh = s.head_dim;
    let half = dh / 2;
    let row = heads * dh;
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(row).zip(x.par_chunks(row)).enumerate().for_each(|(r, (o, xr))| {
        let pos = s.start + r % s.seq;
        let (c, sn) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
        for h in 0..heads {
            let (o, xr) = (&mut o[h * dh..(h + 1) * dh], &xr[h * dh..(h + 1) * dh]);
            for i in 0..half {
                let (a, b) = match s.layout {
                    RopeLayout::HalfSplit => (i, i + half),
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                };
                let sin = if inverse { -sn[i] } else { sn[i] };
                o[a] = xr[a] * c[i] - xr[b] * sin;
                o[b] = xr[a] * sin + xr[b] * c[i];
            }
        }
    });
    out
}

/// `dst[m×n] (row stride dst_rs) = alpha·dst + lhs[m×k]·rhs[k×n]`, all strided, single-threaded
/// (the callers run many of these in parallel).
#[allow(clippy::too_many_arguments)]
fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[f32],
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: &[f32],
    (rhs_rs, rhs_cs): (usize, usize),
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    debug_assert!((m - 1) * dst_rs + n <= dst.len());
    debug_assert!(k == 0 || (m - 1) * lhs_rs + (k - 1) * lhs_cs < lhs.len());
    debug_assert!(k == 0 || (k - 1) * rhs_rs + (n - 1) * rhs_cs < rhs.len());
    // SAFETY: the debug assertions above state the extents the strides reach; every caller passes
    // slices that cover them (checked by the tests in debug builds).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
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
            gemm::Parallelism::None,
        );
    }
}

/// What the forward pass keeps for the backward pass.
pub struct AttnOut {
    /// `[B, T, H, Dh]` rows.
    pub o: Vec<f32>,
    /// Log-sum-exp of each query's scaled scores, `[B, H, T]`.
    pub lse: Vec<f32>,
}

/// Causal attention of rotated queries over rotated keys and values, for every (batch, head); query
/// head `h` reads key/value head `h / (H/K)`. Query `i` sees keys `0..=i`.
///
/// # Shapes
/// - q: `[B, T, H, Dh]`, k, v: `[B, T, K, Dh]` (rows) -> o: `[B, T, H, Dh]`, lse: `[B, H, T]`
pub fn attention(q: &[f32], k: &[f32], v: &[f32], s: &AttnShape) -> AttnOut {
    let (t, h, kh, dh) = (s.seq, s.heads, s.kv_heads, s.head_dim);
    let (q_rs, kv_rs) = (h * dh, kh * dh);
    let blocks: Vec<(Vec<f32>, Vec<f32>)> = (0..s.batch * h)
        .into_par_iter()
        .map(|bh| {
            let (b, head) = (bh / h, bh % h);
            let kv = head / s.group();
            let qb = &q[b * t * q_rs + head * dh..];
            let kb = &k[b * t * kv_rs + kv * dh..];
            let vb = &v[b * t * kv_rs + kv * dh..];
            let mut scores = vec![0.0f32; t * t];
            matmul((t, t, dh), &mut scores, t, false, qb, (q_rs, 1), kb, (1, kv_rs), s.scale);
            let mut lse = vec![0.0f32; t];
            for i in 0..t {
                let row = &mut scores[i * t..(i + 1) * t];
                let max = row[..=i].iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for p in row[..=i].iter_mut() {
                    *p = (*p - max).exp();
                    sum += *p;
                }
                let inv = 1.0 / sum;
                row[..=i].iter_mut().for_each(|p| *p *= inv);
                row[i + 1..].iter_mut().for_each(|p| *p = 0.0);
                lse[i] = max + sum.ln();
            }
            let mut o = vec![0.0f32; t * dh];
            matmul((t, dh, t), &mut o, dh, false, &scores, (t, 1), vb, (kv_rs, 1), 1.0);
            (o, lse)
        })
        .collect();
    let mut o = vec![0.0f32; s.batch * t * q_rs];
    let mut lse = vec![0.0f32; s.batch * h * t];
    for (bh, (ob, lb)) in blocks.into_iter().enumerate() {
        let (b, head) = (bh / h, bh % h);
        for i in 0..t {
            let at = (b * t + i) * q_rs + head * dh;
            o[at..at + dh].copy_from_slice(&ob[i * dh..(i + 1) * dh]);
        }
        lse[bh * t..(bh + 1) * t].copy_from_slice(&lb);
    }
    AttnOut { o, lse }
}

/// Gradients of [`attention`] with respect to the rotated queries and keys and the values, given the
/// forward's output and log-sum-exp: per query head, `P` is recomputed from the scores and `lse`,
/// `dV += Pᵀ dO`, `dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O))`, `dQ = scale · dS K`, `dK += scale · dSᵀ Q`.
/// Heads sharing a key/value head are done by one task, which owns that head's `dK`, `dV`.
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &AttnOut,
    d_o: &[f32],
    s: &AttnShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (t, h, kh, dh) = (s.seq, s.heads, s.kv_heads, s.head_dim);
    let (q_rs, kv_rs) = (h * dh, kh * dh);
    let group = s.group();
    let blocks: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..s.batch * kh)
        .into_par_iter()
        .map(|bk| {
            let (b, kv) = (bk / kh, bk % kh);
            let kb = &k[b * t * kv_rs + kv * dh..];
            let vb = &v[b * t * kv_rs + kv * dh..];
            let (mut dk, mut dv) = (vec![0.0f32; t * dh], vec![0.0f32; t * dh]);
            let mut dq = vec![0.0f32; group * t * dh];
            let mut p = vec![0.0f32; t * t];
            let mut dp = vec![0.0f32; t * t];
            for g in 0..group {
                let head = kv * group + g;
                let off = b * t * q_rs + head * dh;
                let (qb, ob, dob) = (&q[off..], &out.o[off..], &d_o[off..]);
                let lse = &out.lse[(b * h + head) * t..(b * h + head + 1) * t];
                matmul((t, t, dh), &mut p, t, false, qb, (q_rs, 1), kb, (1, kv_rs), s.scale);
                for i in 0..t {
                    let row = &mut p[i * t..(i + 1) * t];
                    row[..=i].iter_mut().for_each(|x| *x = (*x - lse[i]).exp());
                    row[i + 1..].iter_mut().for_each(|x| *x = 0.0);
                }
                matmul((t, dh, t), &mut dv, dh, true, &p, (1, t), dob, (q_rs, 1), 1.0);
                matmul((t, t, dh), &mut dp, t, false, dob, (q_rs, 1), vb, (1, kv_rs), 1.0);
                for i in 0..t {
                    let (o_i, do_i) = (&ob[i * q_rs..i * q_rs + dh], &dob[i * q_rs..i * q_rs + dh]);
                    let delta: f32 = o_i.iter().zip(do_i).map(|(a, b)| a * b).sum();
                    for j in 0..=i {
                        dp[i * t + j] = p[i * t + j] * (dp[i * t + j] - delta);
                    }
                    dp[i * t + i + 1..(i + 1) * t].iter_mut().for_each(|x| *x = 0.0);
                }
                let dqg = &mut dq[g * t * dh..(g + 1) * t * dh];
                matmul((t, dh, t), dqg, dh, false, &dp, (t, 1), kb, (kv_rs, 1), s.scale);
                matmul((t, dh, t), &mut dk, dh, true, &dp, (1, t), qb, (q_rs, 1), s.scale);
            }
            (dq, dk, dv)
        })
        .collect();
    let mut dq = vec![0.0f32; q.len()];
    let mut dk = vec![0.0f32; k.len()];
    let mut dv = vec![0.0f32; v.len()];
    for (bk, (dqb, dkb, dvb)) in blocks.into_iter().enumerate() {
        let (b, kv) = (bk / kh, bk % kh);
        for i in 0..t {
            let at = (b * t + i) * kv_rs + kv * dh;
            dk[at..at + dh].copy_from_slice(&dkb[i * dh..(i + 1) * dh]);
            dv[at..at + dh].copy_from_slice(&dvb[i * dh..(i + 1) * dh]);
            for g in 0..group {
                let at = (b * t + i) * q_rs + (kv * group + g) * dh;
                dq[at..at + dh].copy_from_slice(&dqb[(g * t + i) * dh..(g * t + i + 1) * dh]);
            }
        }
    }
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::*;
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
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let kj = &k[((b * t + j) * kh + kv) * dh..][..dh];
                            qi.iter().zip(kj).map(|(x, y)| (*x as f64) * (*y as f64)).sum::<f64>() * s.scale as f64
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                    for d in 0..dh {
                        let mut acc = 0.0f64;
                        for (j, sc) in scores.iter().enumerate() {
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
        AttnShape {
            batch,
            seq,
            heads,
            kv_heads,
            head_dim,
            start: 0,
            layout: RopeLayout::HalfSplit,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }

    #[test]
    fn attention_matches_the_definition() {
        for s in [shape(2, 7, 4, 2, 6), shape(1, 1, 2, 2, 4), shape(1, 33, 3, 1, 8), shape(3, 5, 2, 2, 2)] {
            let q = random(s.batch * s.seq * s.heads * s.head_dim, 1);
            let k = random(s.batch * s.seq * s.kv_heads * s.head_dim, 2);
            let v = random(s.batch * s.seq * s.kv_heads * s.head_dim, 3);
            let got = attention(&q, &k, &v, &s);
            assert_close(&got.o, &attention_slow(&q, &k, &v, &s), 1e-5, &format!("{s:?}"));
        }
    }

    #[test]
    fn attention_backward_matches_finite_differences() {
        let s = shape(2, 5, 4, 2, 4);
        let q = random(s.batch * s.seq * 4 * 4, 4);
        let k = random(s.batch * s.seq * 2 * 4, 5);
        let v = random(s.batch * s.seq * 2 * 4, 6);
        let w = random(q.len(), 7); // loss = Σ w ⊙ o
        let loss = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
            attention_slow(q, k, v, &s).iter().zip(&w).map(|(a, b)| (*a as f64) * (*b as f64)).sum()
        };
        let out = attention(&q, &k, &v, &s);
        let (dq, dk, dv) = attention_backward(&q, &k, &v, &out, &w, &s);
        let eps = 1e-3f32;
        for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
            for idx in [0usize, 3, 11, grad.len() - 1] {
                let mut xs = [q.clone(), k.clone(), v.clone()];
                xs[which][idx] += eps;
                let up = loss(&xs[0], &xs[1], &xs[2]);
                xs[which][idx] -= 2.0 * eps;
                let down = loss(&xs[0], &xs[1], &xs[2]);
                let fd = ((up - down) / (2.0 * eps as f64)) as f32;
                assert!((fd - grad[idx]).abs() < 2e-3, "input {which} index {idx}: {fd} vs {}", grad[idx]);
            }
        }
    }

    #[test]
    fn rms_norm_and_swiglu_backward_match_finite_differences() {
        let (n, d) = (3, 7);
        let x = random(n * d, 8);
        let w = random(d, 9);
        let dy = random(n * d, 10);
        let loss = |x: &[f32], w: &[f32]| -> f64 {
            rms_norm(x, w, 1e-5).iter().zip(&dy).map(|(a, b)| (*a as f64) * (*b as f64)).sum()
        };
        let (dx, dw) = rms_norm_backward(&x, &w, &dy, 1e-5);
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
        let (g, u) = (random(11, 11), random(11, 12));
        let dy = random(11, 13);
        let (dg, du) = swiglu_backward(&g, &u, &dy);
        for i in 0..11 {
            let f = |g: f32, u: f32| g / (1.0 + (-g).exp()) * u;
            let fd_g = (f(g[i] + eps, u[i]) - f(g[i] - eps, u[i])) / (2.0 * eps) * dy[i];
            let fd_u = (f(g[i], u[i] + eps) - f(g[i], u[i] - eps)) / (2.0 * eps) * dy[i];
            assert!((fd_g - dg[i]).abs() < 1e-3 && (fd_u - du[i]).abs() < 1e-3, "{i}");
        }
    }

    #[test]
    fn rope_inverse_undoes_rope() {
        let s = AttnShape { start: 3, layout: RopeLayout::Interleaved, ..shape(2, 5, 3, 3, 8) };
        let (cos, sin): (Vec<f32>, Vec<f32>) =
            (0..(16 * 4)).map(|i| ((i as f32 * 0.37).cos(), (i as f32 * 0.37).sin())).unzip();
        let x = random(2 * 5 * 3 * 8, 14);
        let back = rope(&rope(&x, 3, &s, &cos, &sin, false), 3, &s, &cos, &sin, true);
        assert_close(&back, &x, 1e-6, "inverse");
    }
}
