//! What the `Flex` impls of the ops share: moving between Flex tensors and the f32 slices the
//! kernels take, and when the kernels run at all.

use std::borrow::Cow;

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::{DType, TensorData};

use super::collective::DeviceReduceOps;
use super::EmberBackend;

/// Whether the CPU kernels are switched off with `EMBER_FUSED=0` (read once): the model then runs
/// the reference compositions, to compare speeds or to rule the kernels out when debugging.
fn kernels_disabled() -> bool {
    static DISABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DISABLED.get_or_init(|| std::env::var("EMBER_FUSED").is_ok_and(|v| v == "0"))
}

impl EmberBackend for Flex {
    fn fused(dtype: DType) -> bool {
        dtype == DType::F32 && !kernels_disabled()
    }

    fn native_low_precision() -> bool {
        false
    }

    fn cpu_bf16_gemms() -> bool {
        super::bf16_gemm::supported() && !kernels_disabled()
    }
}

impl DeviceReduceOps for Flex {}

/// Whether the kernels take these tensors: all f32 (the kernels' type; other dtypes run the
/// reference).
pub(super) fn all_f32(tensors: &[&FlexTensor]) -> bool {
    tensors.iter().all(|t| t.dtype() == DType::F32)
}

/// The f32 elements of `t` in order: borrowed where its storage already is that, else copied.
pub(super) fn f32s(t: &FlexTensor) -> Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(t.to_contiguous().as_slice::<f32>().map(<[f32]>::to_vec).unwrap_or_default()),
    }
}

/// A tensor whose storage holds exactly its elements in order, so that `storage_mut` can update it
/// in place (copying first only when the storage is shared).
pub(super) fn exclusive(t: FlexTensor) -> FlexTensor {
    let n: usize = shape(&t).iter().product();
    if t.as_slice::<f32>().is_some() && t.storage::<f32>().len() == n {
        t
    } else {
        t.to_contiguous()
    }
}

pub(super) fn tensor(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

pub(super) fn shape(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().to_vec()
}
