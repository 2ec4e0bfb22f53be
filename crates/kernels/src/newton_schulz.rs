//! Muon's Newton–Schulz iteration (the optimizer is `ember_train::muon`): the update matrix divided
//! by its Frobenius norm, then `k` times `X <- a·X + (b·A + c·A²)·X` with `A = X·Xᵀ`, on the wide
//! orientation (`A` the smaller Gram matrix; the iteration is transpose-equivariant).
//!
//! The CPU kernel runs the matrices of a step side by side (one per thread, each product on one
//! thread: at hidden sizes a product is far below the size a split across threads pays for), and
//! writes the polynomial's sums into the products' outputs (`A·A` accumulated onto `b·A`, `P·X`
//! onto `a·X`), as torch's `addmm` does.

use burn::backend::Flex;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, bf16, ElementConversion, Tensor};
use rayon::prelude::*;

use crate::bf16_gemm::{self, Kernel as Bf16Kernel, Strided};
use crate::compute::{Compute, Path};
use crate::kernels::transposed;
use crate::products::{gemm_new, gemm_strided};
use crate::{flex, float, prim};

/// The iteration's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NsStep {
    /// (a, b, c) of the quintic.
    pub coefficients: [f64; 3],
    pub steps: usize,
    /// Floor of the norm the input is divided by.
    pub eps: f64,
    /// Operands and results rounded to bf16 after each operation, as torch runs the iteration (its
    /// products still accumulate in f32).
    pub bf16: bool,
}

/// [`crate::AdamWOps::newton_schulz`] as a composition of tensor ops: the reference.
///
/// # Shapes
/// - g: `[R, C]` -> `[R, C]`
pub fn newton_schulz_reference<B: Backend>(g: Tensor<B, 2>, h: NsStep) -> Tensor<B, 2> {
    let [a, b, c] = h.coefficients;
    let round = |t: Tensor<B, 2>| if h.bf16 { round_bf16(t) } else { t };
    let [rows, cols] = g.dims();
    let tall = rows > cols;
    let x = round(if tall { g.transpose() } else { g }); // [S, L], S <= L
    let norm = x.clone().square().sum().sqrt().into_scalar().elem::<f64>();
    let norm = if h.bf16 { bf16::from_f64(norm).to_f64() } else { norm };
    let mut x = round(x.div_scalar(norm.max(h.eps)));
    for _ in 0..h.steps {
        let gram = round(x.clone().matmul(x.clone().transpose())); // [S, S]
        let poly = round(gram.clone().mul_scalar(b) + gram.clone().matmul(gram).mul_scalar(c));
        x = round(x.clone().mul_scalar(a) + poly.matmul(x));
    }
    if tall {
        x.transpose()
    } else {
        x
    }
}

/// Values rounded to the nearest bf16 (ties to even), kept in f32.
fn round_bf16<B: Backend>(t: Tensor<B, 2>) -> Tensor<B, 2> {
    let device = t.device();
    let data = t.into_data().convert::<bf16>().convert::<f32>();
    Tensor::from_data(data, &device)
}

/// Tensor-level entry point of [`crate::AdamWOps::newton_schulz`]: the backend's kernel over all
/// of `gs` at once, or the reference where `cx` asks for it.
pub fn newton_schulz<B: crate::EmberBackend>(gs: Vec<Tensor<B, 2>>, h: NsStep, cx: Compute) -> Vec<Tensor<B, 2>> {
    if cx.path == Path::Reference {
        return gs.into_iter().map(|g| newton_schulz_reference(g, h)).collect();
    }
    B::newton_schulz(gs.into_iter().map(prim).collect(), h, cx).into_iter().map(float).collect()
}

/// The default body of the backend op: the reference, matrix by matrix.
pub(crate) fn reference_each<B: Backend>(gs: Vec<FloatTensor<B>>, h: NsStep) -> Vec<FloatTensor<B>> {
    gs.into_iter().map(|g| prim(newton_schulz_reference(float::<B, 2>(g), h))).collect()
}

/// The Flex op: the host kernel per matrix, the matrices across the threads; with `h.bf16`, the
/// products on the bf16 kernel `cx` puts this iteration on ([`crate::Bf16Products::newton_schulz`]),
/// else on f32 products of the rounded values.
pub(crate) fn flex_newton_schulz(gs: Vec<FloatTensor<Flex>>, h: NsStep, cx: Compute) -> Vec<FloatTensor<Flex>> {
    if !flex::all_f32(&gs.iter().collect::<Vec<_>>()) {
        return reference_each::<Flex>(gs, h);
    }
    let kernel = cx.bf16.newton_schulz.filter(|_| h.bf16);
    gs.into_par_iter()
        .map(|g| {
            let shape = flex::shape(&g);
            let (rows, cols) = (shape[0], shape[1]);
            flex::tensor(orthogonalize(&flex::f32s(&g), rows, cols, h, kernel), shape)
        })
        .collect()
}

/// The iteration on a row-major `rows × cols` matrix: its f32 products on this thread, or with
/// `kernel` (for `h.bf16`) on the bf16 kernel, whose operands are the bf16 values the rounding
/// left and whose sums are f32, as torch's bf16 products are.
pub(crate) fn orthogonalize(g: &[f32], rows: usize, cols: usize, h: NsStep, kernel: Option<Bf16Kernel>) -> Vec<f32> {
    let [a, b, c] = h.coefficients.map(|v| v as f32);
    let round = |v: &mut [f32]| {
        if h.bf16 {
            v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
        }
    };
    let tall = rows > cols;
    let (s, l) = if tall { (cols, rows) } else { (rows, cols) };
    let mut x: Vec<f32> = if tall { transposed(g, (rows, cols)) } else { g.to_vec() };
    round(&mut x);
    let norm = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
    let norm = if h.bf16 { bf16::from_f64(norm).to_f64() } else { norm };
    let inv = (1.0 / norm.max(h.eps)) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
    round(&mut x);
    let one = gemm::Parallelism::None;
    if let Some(kernel) = kernel.filter(|k| h.bf16 && k.runs_here()) {
        for _ in 0..h.steps {
            x = bf16_step(kernel, &x, (s, l), [a, b, c]);
        }
        return if tall { transposed(&x, (s, l)) } else { x };
    }
    for _ in 0..h.steps {
        // A = X·Xᵀ: Xᵀ read through its strides.
        let mut gram = gemm_new((s, s, l), (&x, (l, 1)), (&x, (1, l)), one);
        round(&mut gram);
        // P = b·A + c·A·A.
        let mut poly: Vec<f32> = gram.iter().map(|&v| b * v).collect();
        gemm_strided((s, s, s), (&mut poly, (s, 1)), true, (&gram, (s, 1)), (&gram, (s, 1)), c, one);
        round(&mut poly);
        // X = a·X + P·X.
        let mut next: Vec<f32> = x.iter().map(|&v| a * v).collect();
        gemm_strided((s, l, s), (&mut next, (l, 1)), true, (&poly, (s, 1)), (&x, (l, 1)), 1.0, one);
        round(&mut next);
        x = next;
    }
    if tall {
        transposed(&x, (s, l))
    } else {
        x
    }
}

/// One step of the bf16 iteration on the wide `[s, l]` `x` (bf16 values): the three products on
/// `kernel`, each result rounded to bf16, the polynomial's sums in f32.
fn bf16_step(kernel: Bf16Kernel, x: &[f32], (s, l): (usize, usize), [a, b, c]: [f32; 3]) -> Vec<f32> {
    let round = |v: &mut [f32]| v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
    let product = |p: Strided<'_>, q: Strided<'_>, shape| bf16_gemm::gemm_new(kernel, p, q, shape).expect("reachable");
    // A = X·Xᵀ, Xᵀ read through its strides.
    let mut gram = product((x, (l, 1)), (x, (1, l)), (s, l, s));
    round(&mut gram);
    // P = b·A + c·A·A.
    let mut poly = product((&gram, (s, 1)), (&gram, (s, 1)), (s, s, s));
    poly.iter_mut().zip(&gram).for_each(|(p, &g)| *p = b * g + c * *p);
    round(&mut poly);
    // X = a·X + P·X.
    let mut next: Vec<f32> = x.iter().map(|&v| a * v).collect();
    let done = bf16_gemm::gemm(kernel, &mut next, true, (&poly, (s, 1)), (x, (l, 1)), (s, s, l));
    debug_assert!(done, "the kernel runs here");
    round(&mut next);
    next
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{leaf, rel_err};

    /// f32, and bf16 on f32 products (rounded) and on every bf16 kernel this CPU reaches.
    #[test]
    fn the_kernel_equals_the_composition() {
        let plain = crate::Cpu::f32_products();
        let kernels = Bf16Kernel::reachable().into_iter().map(|k| crate::Cpu { bf16: Some(k), ..plain });
        let cases = [(false, plain), (true, plain)].into_iter().chain(kernels.map(|cpu| (true, cpu)));
        for (bf16, cpu) in cases {
            let h = NsStep { coefficients: [3.4445, -4.7750, 2.0315], steps: 5, eps: 1e-7, bf16 };
            let gs: Vec<Tensor<Flex, 2>> = [[12, 20], [20, 12], [16, 16], [1, 7]]
                .into_iter()
                .enumerate()
                .map(|(i, s)| leaf(s, i as u64 + 1))
                .collect();
            let want: Vec<_> = gs.iter().map(|g| newton_schulz_reference(g.clone(), h)).collect();
            let on = crate::Bf16Products { newton_schulz: cpu.bf16, ..crate::Bf16Products::NONE };
            let got = newton_schulz(gs.clone(), h, Compute::default().with_bf16(on));
            for (g, (a, b)) in gs.iter().zip(got.into_iter().zip(want)) {
                assert_eq!(a.dims(), g.dims());
                let err = rel_err(a, b);
                // bf16: a product's sum rounds to a neighbouring bf16 where the two sums differ in the
                // last f32 bits.
                let tol = if bf16 { 2e-2 } else { 1e-5 };
                assert!(err < tol, "{:?} bf16={bf16} {:?}: {err}", g.dims(), cpu.bf16);
            }
        }
    }
}
