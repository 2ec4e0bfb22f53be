//! The loop's objective: accumulated micro-batches are one batch, packed documents score as they
//! do alone; and the errors of a run that cannot start.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use burn::module::AutodiffModule;
use burn::tensor::TensorData;
use ember_data::fetch::Locations;
use ember_model::Decoder;

use super::{train, TrainOptions};
use crate::config::TrainConfig;
use crate::distributed::{Collective, DistError, Solo};
use crate::error::{OptimizerError, TrainError};
use crate::init::ResolvedConfig;

use crate::eval::lm_loss;
use crate::objective::next_token::{forward_backward, total_scored};
use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{ElementConversion, Int, Tensor};
use ember_data::finetune::{Example, PackedExamples, Packing};
use ember_data::{LmBatch, LmBatcher, Window};
use ember_model::{Documents, ModelConfig};

type AB = Autodiff<Flex>;

fn config(vocab: usize, max_seq_len: usize) -> ModelConfig {
    ModelConfig { init_std: 0.2, ..ModelConfig::tiny(vocab, max_seq_len) }
}

/// Every gradient of the model, flattened in parameter order.
fn flat_grads(model: &Decoder<AB>, grads: &GradientsParams) -> Vec<f64> {
    struct Collect<'a>(&'a GradientsParams, Vec<f64>);
    impl ModuleVisitor<AB> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            let g = self.0.get::<Flex, D>(p.id).expect("every parameter has a gradient");
            self.1.extend(g.into_data().convert::<f64>().to_vec::<f64>().unwrap());
        }
    }
    let mut c = Collect(grads, Vec::new());
    model.visit(&mut c);
    c.1
}

fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    (diff / norm).sqrt()
}

/// 8 windows of 12 positions whose masks score between 1 and 12 targets.
fn uneven_windows(vocab: u32) -> Vec<Window> {
    (0..8u32)
        .map(|r| {
            let input: Vec<u32> = (0..12).map(|i| (r * 7 + i * 5 + 1) % vocab).collect();
            let scored = [1, 12, 2, 9, 3, 3, 11, 1][r as usize];
            let target = (0..12).map(|i| if i >= 12 - scored { ((r + i * 3) % vocab) as i32 } else { -1 }).collect();
            Window { input, target, docs: None }
        })
        .collect()
}

#[test]
fn accumulated_micro_batches_give_the_loss_and_gradients_of_one_batch() {
    let dev = Default::default();
    let model = Decoder::<AB>::new(&config(29, 16), 3, &dev).unwrap();
    let windows = uneven_windows(29);
    let run = |per_micro: usize| {
        let micro: Vec<Vec<Window>> = windows.chunks(per_micro).map(<[Window]>::to_vec).collect();
        let total = total_scored(&micro);
        let (loss, grads, _) = forward_backward(&model, micro, total, &dev, 1.0);
        (loss, flat_grads(&model, &grads))
    };
    let (loss8, grads8) = run(8);
    for per_micro in [4, 2] {
        let (loss, grads) = run(per_micro);
        let rel = ((loss - loss8) / loss8).abs();
        assert!(rel < 1e-6, "batch {per_micro} x {}: loss {loss} vs {loss8} (rel {rel:e})", 8 / per_micro);
        let rel = rel_l2(&grads, &grads8);
        assert!(rel < 1e-6, "batch {per_micro} x {}: gradients differ (rel {rel:e})", 8 / per_micro);
    }
    // The mean of per-micro-batch means is a different objective on these masks.
    let means: Vec<f64> = windows
        .chunks(2)
        .map(|w| {
            let batch: LmBatch<Flex> = LmBatcher.batch(w.to_vec(), &dev);
            lm_loss(&model.valid(), batch).into_scalar().elem::<f64>()
        })
        .collect();
    let mean_of_means = means.iter().sum::<f64>() / means.len() as f64;
    assert!((mean_of_means - loss8).abs() > 1e-3, "the test masks must make the two objectives differ");
}

#[test]
fn experts_add_their_weighted_balancing_loss_and_count_every_pair() {
    let dev = Default::default();
    let moe = |aux_loss_coef: f64| ModelConfig {
        moe: Some(ember_model::MoeConfig {
            n_experts: 4,
            top_k: 2,
            d_expert: 16,
            norm_topk: true,
            shared_expert: None,
            shared_expert_gate: false,
            aux_loss_coef,
            z_loss_coef: 0.0,
            ..Default::default()
        }),
        ..config(29, 16)
    };
    let windows = uneven_windows(29);
    let run = |coef: f64| {
        let model = Decoder::<AB>::new(&moe(coef), 3, &dev).unwrap();
        let micro = vec![windows.clone()];
        let total = total_scored(&micro);
        let (loss, grads, sums) = forward_backward(&model, micro, total, &dev, 1.0);
        (loss, flat_grads(&model, &grads), sums.expect("a model with experts sums its routing"))
    };
    let (loss0, grads0, sums0) = run(0.0);
    let (loss1, grads1, sums1) = run(0.5);
    // The reported loss is the next-token loss, the same whatever the weight of the balancing loss.
    assert_eq!(loss0.to_bits(), loss1.to_bits());
    assert_eq!(sums0.counts, sums1.counts, "the same weights route the same way");
    // Every token reaches its two experts in each of the 2 layers: 8 rows of 12 positions.
    assert_eq!(sums1.counts.iter().sum::<f64>(), (2 * 8 * 12 * 2) as f64);
    assert!((1.0..4.0).contains(&sums1.aux), "E · Σ f·P is k = 2 when even, {}", sums1.aux);
    // The balancing loss is in the objective: the gradients move with its weight.
    let rel = rel_l2(&grads1, &grads0);
    assert!(rel > 1e-6, "the balancing loss changed no gradient (rel {rel:e})");
    let named: std::collections::BTreeMap<String, f64> = sums1.named().into_iter().collect();
    assert_eq!(named["aux_loss"], sums1.aux);
    assert!(named["expert_load_max_over_mean"] >= 1.0 && named.contains_key("expert_load_max_over_mean/layer1"));
}

fn example(ids: &[u32], prompt: usize) -> Example {
    Example { ids: ids.to_vec(), scored: (0..ids.len()).map(|i| i >= prompt).collect() }
}

/// Mean loss and scored-target count of rows, through the training objective.
fn loss_of(model: &Decoder<Flex>, rows: &PackedExamples) -> (f64, usize) {
    use burn::data::dataset::Dataset;
    let items: Vec<Window> = (0..rows.len()).map(|i| rows.get(i).unwrap()).collect();
    let batch: LmBatch<Flex> = LmBatcher.batch(items, &Default::default());
    let n = batch.scored;
    (lm_loss(model, batch).into_scalar().elem::<f64>(), n)
}

#[test]
fn a_packed_document_scores_as_it_does_alone() {
    let dev = Default::default();
    let model = Decoder::<Flex>::new(&config(31, 32), 5, &dev).unwrap();
    let examples = [
        example(&[1, 4, 9, 16, 25, 5], 2),
        example(&[3, 1, 4, 1, 5, 9, 2, 6], 3),
        example(&[2, 7, 1, 8, 2], 1),
        example(&[30, 29, 28, 27], 0),
    ];
    let pack = |ex: &[Example], packing| PackedExamples::new(ex, 24, 0, packing, false).unwrap();
    let packed = pack(&examples, Packing::Documents);
    assert_eq!(burn::data::dataset::Dataset::len(&packed), 1, "all four examples fit one row");
    let (loss, n) = loss_of(&model, &packed);
    let alone: Vec<(f64, usize)> =
        examples.iter().map(|e| loss_of(&model, &pack(std::slice::from_ref(e), Packing::None))).collect();
    let want =
        alone.iter().map(|(l, n)| l * *n as f64).sum::<f64>() / alone.iter().map(|(_, n)| *n as f64).sum::<f64>();
    assert_eq!(n, alone.iter().map(|(_, n)| n).sum::<usize>());
    assert!((loss - want).abs() < 1e-5, "packed {loss} vs alone {want}");
    // Stream packing lets the examples see each other: a different loss.
    let (stream, _) = loss_of(&model, &pack(&examples, Packing::Stream));
    assert!((stream - want).abs() > 1e-4, "stream packing {stream} should differ from {want}");
}

#[test]
fn an_examples_logits_do_not_depend_on_what_is_packed_before_it() {
    let dev = Default::default();
    let model = Decoder::<Flex>::new(&config(31, 32), 6, &dev).unwrap();
    let target = [11u32, 3, 17, 5, 23, 2];
    // The same example after a 4-token and after a 9-token neighbour, and alone at position 0.
    let rows: [(Vec<u32>, Vec<usize>); 3] = [
        ([vec![1, 2, 3, 4], target.to_vec()].concat(), vec![4, 6]),
        ([vec![9, 8, 7, 6, 5, 4, 3, 2, 1], target.to_vec()].concat(), vec![9, 6]),
        (target.to_vec(), vec![6]),
    ];
    let hidden_of = |(ids, lens): &(Vec<u32>, Vec<usize>), docs: bool| {
        let t = ids.len();
        let tokens = Tensor::<Flex, 2, Int>::from_data(
            TensorData::new(ids.iter().map(|&x| x as i32).collect::<Vec<_>>(), [1, t]),
            &dev,
        );
        let d = Documents::from_lengths(std::slice::from_ref(lens), t).unwrap();
        let h = model.hidden_documents(tokens, 0, docs.then_some(&d)); // [1, T, D]
        let logits = model.logits(h.narrow(1, t - 6, 6).reshape([6, 32]));
        logits.into_data().to_vec::<f32>().unwrap()
    };
    let alone = hidden_of(&rows[2], true);
    for row in &rows[..2] {
        let got = hidden_of(row, true);
        let err = got.iter().zip(&alone).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err < 1e-5, "logits moved by {err} with a neighbour packed before");
        // Without documents the neighbour and the shifted positions change them.
        let crossed = hidden_of(row, false);
        let err = crossed.iter().zip(&alone).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err > 1e-3, "without documents the logits should depend on the neighbour ({err})");
    }
}

/// Rank 0 of 2^31 ranks, every collective the identity: ZeRO-1 over MPI counts a collective's values
/// in a C int, so at one value a rank even the smallest model is past its limit. The stand-in for
/// a run too large to shard, which no test could allocate.
struct VastWorld;

/// Everything but the size of the world, the collectives' buffers sized for one rank and `abort` is
/// [`Solo`]'s.
impl Collective for VastWorld {
    fn rank(&self) -> usize {
        Solo.rank()
    }
    fn world(&self) -> usize {
        1 << 31
    }
    fn local_rank(&self) -> usize {
        Solo.local_rank()
    }
    fn local_world(&self) -> usize {
        Solo.local_world()
    }
    fn engine(&self) -> String {
        "a stand-in for 2^31 ranks".into()
    }
    fn set_timeout(&self, timeout: Duration) {
        Solo.set_timeout(timeout)
    }
    fn arrive(&self, seq: u64, what: &str) -> Result<(), DistError> {
        Solo.arrive(seq, what)
    }
    fn all_reduce_f32(&self, buf: &mut [f32], what: &str) -> Result<(), DistError> {
        Solo.all_reduce_f32(buf, what)
    }
    fn all_reduce_f32_into(&self, send: &[f32], recv: &mut [f32], what: &str) -> Result<(), DistError> {
        Solo.all_reduce_f32_into(send, recv, what)
    }
    fn all_reduce_f64(&self, buf: &mut [f64], what: &str) -> Result<(), DistError> {
        Solo.all_reduce_f64(buf, what)
    }
    fn reduce_scatter_f32(&self, send: &[f32], recv: &mut [f32], _: &str) -> Result<(), DistError> {
        recv.copy_from_slice(&send[..recv.len()]);
        Ok(())
    }
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], _: &str) -> Result<(), DistError> {
        recv[..send.len()].copy_from_slice(send);
        Ok(())
    }
    /// Rank 0's bytes only: every other rank agrees with it.
    fn all_gather_bytes(&self, send: &[u8], what: &str) -> Result<Vec<Vec<u8>>, DistError> {
        Solo.all_gather_bytes(send, what)
    }
    fn gather_f32(&self, send: &[f32], what: &str) -> Result<Option<Vec<f32>>, DistError> {
        Solo.gather_f32(send, what)
    }
    fn all_reduce_baseline(&self, send: &[f32], recv: &mut [f32]) {
        Solo.all_reduce_baseline(send, recv)
    }
    fn abort(&self, code: i32) -> ! {
        panic!("abort({code})")
    }
}

/// A fresh run whose optimizer cannot be built says so; it used to report its (nonexistent)
/// checkpoint as damaged.
#[test]
fn a_fresh_run_whose_optimizer_cannot_be_built_reports_the_optimizer() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog. ".repeat(40)).unwrap();
    let toml = format!(
        "[model]\nd_model = 16\nn_layers = 1\nn_heads = 2\nd_ff = 32\nmax_seq_len = 16\n\n\
         [data]\npath = {:?}\ntokenizer = \"char\"\n\n\
         [train]\nbatch_size = 2\nmax_steps = 2\neval_interval = 1\neval_iters = 1\n\n\
         [optim]\n\n[schedule]\nlr = 1e-3\n\n[distributed]\nshard_optimizer = true\n",
        text.display().to_string()
    );
    let config = TrainConfig::from_toml(&toml, Path::new("zero.toml")).unwrap();
    let run_dir = dir.path().join("run");
    let opts = TrainOptions {
        run_dir: run_dir.clone(),
        resume: false,
        accept_data_change: false,
        stop_at: None,
        show_progress: false,
        locations: Locations {
            repo_dir: dir.path().join("datasets"),
            data_dir: None,
            cache_dir: dir.path().join("cache"),
        },
        eval_dir: None,
        device_name: None,
        peak_tflops: Some(1.0),
        memory: None,
        memory_available: None,
        collective: Arc::new(VastWorld),
        device_comm: None,
        compute: Default::default(),
        stop_requested: None,
    };
    let run = ResolvedConfig { config, init: None };
    let e = train::<AB>(run, &opts, &Default::default()).unwrap_err();
    assert!(matches!(e, TrainError::Optimizer(OptimizerError::Sharding(_))), "{e:?}");
    let message = e.to_string();
    assert!(message.starts_with("cannot build the optimizer: distributed.shard_optimizer: "), "{message}");
    assert!(!message.contains("checkpoint"), "{message}");
    assert!(!crate::checkpoint::has_checkpoint(&run_dir));
}
