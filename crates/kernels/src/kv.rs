//! Writing rows into a KV cache's block pool: `pool[dst[i]] = rows[i]`, the one op a decode step
//! needs per layer to store every sequence's new keys (or values), whatever the batch.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{backend::Backend, f16, DType, IndexingUpdateOp, Int, Tensor, TensorData};

use half::slice::HalfFloatSliceExt;

use crate::{flex, float, prim};

/// A backend's row write into a cache pool; the default method is the reference.
pub trait KvWriteOps: Backend {
    /// `pool` with row `dst[i]` replaced by row `i` of `rows` (the `dst` are distinct), in the
    /// pool's type (an f16 pool stores the rows rounded to f16).
    ///
    /// # Shapes
    /// - pool: `[N, W]`, dst: `[P]`, rows: `[P, W]` -> `[N, W]`
    fn kv_write(pool: FloatTensor<Self>, dst: &[usize], rows: FloatTensor<Self>) -> FloatTensor<Self> {
        prim(reference(float::<Self, 2>(pool), dst, float(rows)))
    }
}

/// The composition: Burn's `select_assign` adds, so the difference to the old rows is added.
pub fn reference<B: Backend>(pool: Tensor<B, 2>, dst: &[usize], rows: Tensor<B, 2>) -> Tensor<B, 2> {
    let rows = if rows.dtype() == pool.dtype() { rows } else { rows.cast(pool.dtype()) };
    let ids: Vec<i64> = dst.iter().map(|&d| d as i64).collect();
    let dst = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [dst.len()]), &pool.device());
    let old = pool.clone().select(0, dst.clone());
    pool.select_assign(0, dst, rows - old, IndexingUpdateOp::Add)
}

/// In place where the pool's storage is not shared (the cache holds the only reference): the cost
/// is the rows written, not the pool.
impl KvWriteOps for Flex {
    fn kv_write(pool: FlexTensor, dst: &[usize], rows: FlexTensor) -> FlexTensor {
        let (ps, rs) = (flex::shape(&pool), flex::shape(&rows));
        let f16_pool = pool.dtype() == DType::F16 && rows.dtype() == DType::F32;
        let fits = (flex::all_f32(&[&pool, &rows]) || f16_pool)
            && rs.len() == 2
            && ps.len() == 2
            && rs[1] == ps[1]
            && rs[0] == dst.len()
            && dst.iter().all(|&d| d < ps[0]);
        if !fits {
            return prim(reference(float::<Self, 2>(pool), dst, float(rows)));
        }
        let width = ps[1];
        let rows = flex::f32s(&rows);
        if f16_pool {
            let mut pool = flex::exclusive(pool);
            let storage = pool.storage_mut::<f16>();
            for (i, &d) in dst.iter().enumerate() {
                storage[d * width..(d + 1) * width].convert_from_f32_slice(&rows[i * width..(i + 1) * width]);
            }
            return pool;
        }
        let mut pool = flex::exclusive(pool);
        let storage = pool.storage_mut::<f32>();
        for (i, &d) in dst.iter().enumerate() {
            storage[d * width..(d + 1) * width].copy_from_slice(&rows[i * width..(i + 1) * width]);
        }
        pool
    }
}

impl<B: KvWriteOps, C: CheckpointStrategy> KvWriteOps for Autodiff<B, C> {}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    #[test]
    fn the_in_place_write_equals_the_reference_and_leaves_shared_pools_alone() {
        let dev = Default::default();
        let pool = Tensor::<Flex, 2>::random([10, 6], Distribution::Normal(0.0, 1.0), &dev);
        let rows = Tensor::<Flex, 2>::random([3, 6], Distribution::Normal(0.0, 1.0), &dev);
        let dst = [7, 0, 4];
        let want = reference(pool.clone(), &dst, rows.clone());
        let before = pool.to_data();
        // `pool` is still held here: the op must copy, not write into this tensor.
        let got = float::<Flex, 2>(Flex::kv_write(prim(pool.clone()), &dst, prim(rows.clone())));
        // The reference adds the difference, so it may round in the last bit; the write is exact.
        got.to_data().assert_approx_eq::<f32>(&want.to_data(), burn::tensor::Tolerance::absolute(1e-6));
        for (i, &d) in dst.iter().enumerate() {
            got.clone().narrow(0, d, 1).to_data().assert_eq(&rows.clone().narrow(0, i, 1).to_data(), true);
        }
        got.narrow(0, 1, 3).to_data().assert_eq(&pool.clone().narrow(0, 1, 3).to_data(), true);
        pool.to_data().assert_eq(&before, true);
    }

    /// An f16 pool takes f32 rows rounded to nearest, as the reference's cast does, and keeps the
    /// other rows; a pool still held elsewhere is left alone.
    #[test]
    fn an_f16_pool_stores_the_rows_rounded() {
        let dev = Default::default();
        let pool = Tensor::<Flex, 2>::random([10, 6], Distribution::Normal(0.0, 1.0), &dev).cast(DType::F16);
        let rows = Tensor::<Flex, 2>::random([3, 6], Distribution::Normal(0.0, 1.0), &dev);
        let dst = [7, 0, 4];
        let before = pool.to_data();
        let got = float::<Flex, 2>(Flex::kv_write(prim(pool.clone()), &dst, prim(rows.clone())));
        assert_eq!(got.dtype(), DType::F16);
        // The reference adds the difference to the old rows in f16: within f16's rounding of it.
        let want = reference(pool.clone(), &dst, rows.clone()).cast(DType::F32);
        let got32 = got.clone().cast(DType::F32);
        got32.to_data().assert_approx_eq::<f32>(&want.to_data(), burn::tensor::Tolerance::absolute(1e-2));
        let rounded: Vec<f32> =
            rows.to_data().to_vec::<f32>().unwrap().iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        for (i, &d) in dst.iter().enumerate() {
            let row = got.clone().narrow(0, d, 1).cast(DType::F32).to_data().to_vec::<f32>().unwrap();
            assert_eq!(row, rounded[i * 6..(i + 1) * 6], "row {d}");
        }
        got.narrow(0, 1, 3).to_data().assert_eq(&pool.clone().narrow(0, 1, 3).to_data(), true);
        pool.to_data().assert_eq(&before, true);
    }
}
