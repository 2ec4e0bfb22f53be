//! `ember bench allreduce`: the bus bandwidth of ember's gradient reduction (tensors flattened into
//! buckets, reduced with deadlines, put back as tensors) against the engine's own blocking
//! all-reduce of the same number of bytes, alternating, on the same ranks.

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde::Serialize;

use super::buckets::{all_reduce_buckets, all_reduce_grads, GradBuffers};
use super::{bus_bandwidth, Collective, DistError};

#[derive(Debug, Clone, Serialize)]
pub struct AllreduceRow {
    pub bytes: usize,
    /// Median milliseconds: the engine's blocking all-reduce of one buffer; ember's bucketed
    /// reduction of the same flat buffer (deadlines, buckets); and ember's whole gradient path
    /// (tensors flattened, reduced, put back as tensors).
    pub engine_ms: f64,
    pub bucketed_ms: f64,
    pub end_to_end_ms: f64,
    /// Bus bandwidth (nccl-tests' busbw), GB/s.
    pub engine_busbw_gbs: f64,
    pub bucketed_busbw_gbs: f64,
    pub end_to_end_busbw_gbs: f64,
    /// The bucketed reduction's time over the engine's, minus one.
    pub overhead: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct AllreduceBench {
    pub engine: String,
    pub world: usize,
    pub bucket_mib: usize,
    pub reps: usize,
    pub rows: Vec<AllreduceRow>,
}

/// Parameters shaped like a model's: tensors of at most 4 Mi values, as many as `bytes` needs.
#[derive(Module, Debug)]
struct Params<B: Backend> {
    tensors: Vec<Param<Tensor<B, 1>>>,
}

type AB = Autodiff<Flex>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `reps` reductions of each size (after one untimed), both ways, alternating.
pub fn bench_allreduce(
    c: &dyn Collective,
    sizes: &[usize],
    reps: usize,
    bucket_mib: usize,
) -> Result<AllreduceBench, DistError> {
    let dev = Default::default();
    let bucket = bucket_mib * (1 << 20) / 4;
    let mut rows = Vec::new();
    for (i, &bytes) in sizes.iter().enumerate() {
        let n = (bytes / 4).max(1);
        let chunk = 1 << 22;
        let lens: Vec<usize> = (0..n.div_ceil(chunk)).map(|k| chunk.min(n - k * chunk)).collect();
        let model = Params::<AB> {
            tensors: lens.iter().map(|&l| Param::from_tensor(Tensor::<AB, 1>::ones([l], &dev))).collect(),
        };
        let values: Vec<f32> = (0..n).map(|k| (k % 97) as f32 * 0.01 + c.rank() as f32).collect();
        let mut recv = vec![0.0f32; n];
        let mut sums = vec![0.0f32; n];
        let mut buffers = GradBuffers::default();
        let (mut engine, mut bucketed, mut ember) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..=reps {
            c.arrive((i * (reps + 1) + rep) as u64, "allreduce benchmark")?;
            let t = Instant::now();
            c.all_reduce_baseline(&values, &mut recv);
            let engine_ms = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            all_reduce_buckets(c, &values, &mut sums, bucket, "allreduce benchmark")?;
            let bucketed_ms = t.elapsed().as_secs_f64() * 1e3;
            // ember's path starts from gradient tensors and ends with gradient tensors.
            let mut grads = GradientsParams::new();
            let mut offset = 0;
            for (p, &l) in model.tensors.iter().zip(&lens) {
                let data = TensorData::new(values[offset..offset + l].to_vec(), [l]);
                grads.register::<Flex, 1>(p.id, Tensor::from_data(data, &dev));
                offset += l;
            }
            let t = Instant::now();
            let reduced = all_reduce_grads::<AB, _>(c, &model, grads, bucket, &mut buffers, "allreduce benchmark")?;
            let ember_ms = t.elapsed().as_secs_f64() * 1e3;
            let first = reduced.get::<Flex, 1>(model.tensors[0].id).map(|g| g.into_data().to_vec::<f32>());
            if rep == 0 {
                // The two must agree: the same sum (up to the summation order, which MPI may choose
                // differently for a bucket than for the whole buffer).
                if let Some(Ok(g)) = first {
                    let k = g.len().min(8);
                    let close = g[..k].iter().zip(&recv[..k]).all(|(a, b)| (a - b).abs() <= 1e-5 * b.abs().max(1.0));
                    if !close {
                        return Err(DistError::Rank {
                            rank: c.rank(),
                            message: format!(
                                "ember's reduction {:?} differs from the engine's {:?}",
                                &g[..k],
                                &recv[..k]
                            ),
                        });
                    }
                }
                continue;
            }
            engine.push(engine_ms);
            bucketed.push(bucketed_ms);
            ember.push(ember_ms);
        }
        let (engine_ms, bucketed_ms, end_to_end_ms) = (median(engine), median(bucketed), median(ember));
        let bw = |ms: f64| bus_bandwidth(n * 4, c.world(), ms / 1e3) / 1e9;
        rows.push(AllreduceRow {
            bytes: n * 4,
            engine_ms,
            bucketed_ms,
            end_to_end_ms,
            engine_busbw_gbs: bw(engine_ms),
            bucketed_busbw_gbs: bw(bucketed_ms),
            end_to_end_busbw_gbs: bw(end_to_end_ms),
            overhead: bucketed_ms / engine_ms - 1.0,
        });
    }
    Ok(AllreduceBench { engine: c.engine(), world: c.world(), bucket_mib, reps, rows })
}

impl std::fmt::Display for AllreduceBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "all-reduce over {} ranks, {} (bus bandwidth):", self.world, self.engine)?;
        for x in &self.rows {
            write!(
                f,
                "\n  {:>10} B: engine {:8.3} ms {:6.2} GB/s · ember bucketed {:8.3} ms {:6.2} GB/s ({:+.1}%) · from tensors {:8.3} ms {:6.2} GB/s",
                x.bytes,
                x.engine_ms,
                x.engine_busbw_gbs,
                x.bucketed_ms,
                x.bucketed_busbw_gbs,
                100.0 * x.overhead,
                x.end_to_end_ms,
                x.end_to_end_busbw_gbs
            )?;
        }
        Ok(())
    }
}
