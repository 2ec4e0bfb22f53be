//! A two-parameter module for the optimizer and data-parallel unit tests: `x·w + b`.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Device, Tensor};

pub(crate) type AB = Autodiff<Flex>;

#[derive(Module, Debug)]
pub(crate) struct Two<B: Backend> {
    pub w: Param<Tensor<B, 2>>,
    pub b: Param<Tensor<B, 1>>,
}

impl Two<AB> {
    pub(crate) fn new<const R: usize, const C: usize>(w: [[f32; C]; R], b: [f32; C], dev: &Device<AB>) -> Self {
        Self { w: Param::from_tensor(Tensor::from_data(w, dev)), b: Param::from_tensor(Tensor::from_data(b, dev)) }
    }
}
