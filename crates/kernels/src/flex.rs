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
    if let Some(s) = t.as_slice::<f32>() {
        return Cow::Borrowed(s);
    }
    if let Some(rows) = copy_rows(t) {
        return Cow::Owned(rows);
    }
    Cow::Owned(t.to_contiguous().as_slice::<f32>().map(<[f32]>::to_vec).unwrap_or_default())
}

/// The elements of a strided f32 view whose last dimension is contiguous in its storage (a
/// transposed or narrowed view of heads, `[B, H, T, Dh]` of a `[B, T, H·Dh]` tensor), copied a
/// last-dimension row at a time: burn-flex's own copy walks such a view of more than two
/// dimensions an element at a time. `None` for other layouts.
fn copy_rows(t: &FlexTensor) -> Option<Vec<f32>> {
    if t.dtype() != DType::F32 {
        return None;
    }
    let (dims, strides, start) = (shape(t), t.layout().strides(), t.layout().start_offset());
    let rank = dims.len();
    if rank < 2 || strides.len() != rank || strides[rank - 1] != 1 || strides.iter().any(|&s| s < 0) {
        return None;
    }
    let (inner, n) = (dims[rank - 1], dims.iter().product::<usize>());
    if inner == 0 || n == 0 {
        return None;
    }
    let src = t.storage::<f32>();
    // The furthest element the view reads must lie in the storage.
    let last = start + dims.iter().zip(strides).map(|(&d, &s)| (d - 1) * s as usize).sum::<usize>();
    if last >= src.len() {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    let mut at = vec![0usize; rank - 1];
    for _ in 0..n / inner {
        let from = start + at.iter().zip(strides).map(|(&i, &s)| i * s as usize).sum::<usize>();
        out.extend_from_slice(&src[from..from + inner]);
        for d in (0..rank - 1).rev() {
            at[d] += 1;
            if at[d] < dims[d] {
                break;
            }
            at[d] = 0;
        }
    }
    Some(out)
}

/// A tensor whose storage holds exactly its elements in order, so that `storage_mut` can update it
/// in place (copying first only when the storage is shared). f32 or f16.
pub(crate) fn exclusive(t: FlexTensor) -> FlexTensor {
    use burn::tensor::f16;
    let n: usize = shape(&t).iter().product();
    let whole = match t.dtype() {
        DType::F16 => t.as_slice::<f16>().is_some() && t.storage::<f16>().len() == n,
        _ => t.as_slice::<f32>().is_some() && t.storage::<f32>().len() == n,
    };
    if whole {
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Tensor;

    /// Views the kernels are handed (heads swapped out of the positions, a narrowed part, a
    /// broadcast dimension) read in order, as burn-flex's own copy reads them.
    #[test]
    fn row_copies_read_views_as_the_contiguous_copy_does() {
        let dev = Default::default();
        let values: Vec<f32> = (0..2 * 5 * 36).map(|i| i as f32).collect();
        let base = Tensor::<Flex, 3>::from_data(TensorData::new(values, [2, 5, 36]), &dev);
        let views: Vec<Tensor<Flex, 4>> = vec![
            base.clone().reshape([2, 5, 9, 4]).swap_dims(1, 2),
            base.clone().narrow(2, 8, 12).reshape([2, 5, 3, 4]).swap_dims(1, 2),
            base.clone().reshape([2, 5, 9, 4]).narrow(1, 1, 3).swap_dims(0, 2),
            base.clone().narrow(1, 2, 1).reshape([2, 1, 9, 4]).expand([2, 3, 9, 4]),
        ];
        for (n, view) in views.into_iter().enumerate() {
            let want = view.clone().into_data().to_vec::<f32>().unwrap();
            let t = crate::prim(view);
            assert!(t.as_slice::<f32>().is_none(), "view {n} should be strided");
            let rows = copy_rows(&t);
            if n < 3 {
                assert!(rows.is_some(), "view {n}: its last dimension is contiguous");
            }
            assert_eq!(f32s(&t).to_vec(), want, "view {n}");
        }
    }
}
