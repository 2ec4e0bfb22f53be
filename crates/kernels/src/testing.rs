//! Helpers of the ops' tests: each fused op against its reference, values and gradients, and each
//! kernel's copies against each other.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

use crate::{Cpu, Tier};

pub(super) type AB = Autodiff<Flex>;

/// `len` deterministic values in [-1, 1], different for each seed (for the kernels' slice tests).
pub(crate) fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len).map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0).collect()
}

pub(super) fn rel_err(a: Tensor<Flex, 2>, b: Tensor<Flex, 2>) -> f32 {
    // Floor: a gradient that is zero in theory (one key per query) is compared absolutely.
    let scale = b.clone().abs().max().into_scalar().max(0.1);
    (a - b).abs().max().into_scalar() / scale
}

pub(super) fn leaf(shape: [usize; 2], seed: u64) -> Tensor<Flex, 2> {
    <Flex as Backend>::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

/// An op under test: the fused path (`true`) or the reference.
pub(super) type FusedOrReference<'a> = dyn Fn(&[Tensor<AB, 2>], bool) -> Tensor<AB, 2> + 'a;

/// Runs `f` on fresh leaves built from `inputs`, with fused kernels or the reference, and returns
/// the output and the gradient of `Σ out ⊙ weight` for every input.
fn run(
    inputs: &[Tensor<Flex, 2>],
    weight: &Tensor<Flex, 2>,
    f: &FusedOrReference<'_>,
    fused: bool,
) -> (Tensor<Flex, 2>, Vec<Tensor<Flex, 2>>) {
    let leaves: Vec<Tensor<AB, 2>> = inputs.iter().map(|x| Tensor::from_inner(x.clone()).require_grad()).collect();
    let out = f(&leaves, fused);
    let loss = (out.clone() * Tensor::from_inner(weight.clone())).sum();
    let grads = loss.backward();
    (out.inner(), leaves.iter().map(|l| l.grad(&grads).expect("gradient")).collect())
}

/// The fused op's output and input gradients against the reference's, within `1e-5` relative.
pub(super) fn compare(name: &str, inputs: Vec<Tensor<Flex, 2>>, out_shape: [usize; 2], f: &FusedOrReference) {
    let weight = leaf(out_shape, 99);
    let (y1, g1) = run(&inputs, &weight, f, true);
    let (y0, g0) = run(&inputs, &weight, f, false);
    let e = rel_err(y1, y0);
    assert!(e < 1e-5, "{name}: output relative error {e}");
    for (i, (a, b)) in g1.into_iter().zip(g0).enumerate() {
        let e = rel_err(a, b);
        assert!(e < 1e-5, "{name}: gradient {i} relative error {e}");
    }
}

/// Two lists of gradients within `1e-5` relative, pairwise.
pub(super) fn assert_close(name: &str, got: Vec<Tensor<Flex, 2>>, want: Vec<Tensor<Flex, 2>>) {
    assert_eq!(got.len(), want.len(), "{name}: gradient count");
    for (i, (a, b)) in got.into_iter().zip(want).enumerate() {
        let e = rel_err(a, b);
        assert!(e < 1e-5, "{name}: gradient {i} relative error {e}");
    }
}

/// Asserts that `run` gives the same bits from every copy of the `multiversion!` kernels that this
/// CPU can run (AVX-512, AVX2 + FMA, the baseline) as from the widest: the copies change speed,
/// never results.
pub(crate) fn same_bits_on_every_tier(name: &str, run: impl Fn(Cpu) -> Vec<Vec<f32>>) {
    let widest = run(Cpu::f32_products());
    for cap in Tier::ALL.into_iter().filter(|&t| t <= Cpu::f32_products().tier) {
        let narrower = run(Cpu::f32_products().capped(cap));
        assert_eq!(widest.len(), narrower.len(), "{name}: output count");
        for (i, (a, b)) in widest.iter().zip(&narrower).enumerate() {
            let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{name}, output {i}: the {cap:?} copy differs from the widest");
        }
    }
}
