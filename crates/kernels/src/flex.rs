//! What the `Flex` impls of the ops share: moving between Flex tensors and the f32 slices the
//! kernels take, and which tensors the kernels run on at all.

use std::borrow::Cow;

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::{DType, TensorData};

use crate::collective::DeviceReduceOps;
use crate::EmberBackend;

/// The CPU kernels run on f32 tensors; bf16 and f16 GEMMs are f32 conversions here, so low
/// precision means bf16 operands of the CPU's own kernels under f32 tensors.
impl EmberBackend for Flex {
    fn fused(dtype: DType) -> bool {
        dtype == DType::F32
    }

    fn native_low_precision() -> bool {
        false
    }

    fn cpu_bf16_gemms() -> bool {
        crate::bf16_gemm::supported()
    }
}

impl DeviceReduceOps for Flex {}

/// Whether the kernels take these tensors: all f32 (the kernels' type; other dtypes run the
/// reference).
pub(crate) fn all_f32(tensors: &[&FlexTensor]) -> bool {
    tensors.iter().all(|t| t.dtype() == DType::F32)
}

/// The f32 elements of `t` in order: borrowed where its storage already is that, else copied.
pub(crate) fn f32s(t: &FlexTensor) -> Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(t.to_contiguous().as_slice::<f32>().map(<[f32]>::to_vec).unwrap_or_default()),
    }
}

/// A tensor whose storage holds exactly its elements in order, so that `storage_mut` can update it
/// in place (copying first only when the storage is shared).
pub(crate) fn exclusive(t: FlexTensor) -> FlexTensor {
    let n: usize = shape(&t).iter().product();
    if t.as_slice::<f32>().is_some() && t.storage::<f32>().len() == n {
        t
    } else {
        t.to_contiguous()
    }
}

pub(crate) fn tensor(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

pub(crate) fn shape(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}
