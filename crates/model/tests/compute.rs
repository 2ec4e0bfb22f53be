//! How a model computes is a value it carries, not a switch of the process: two models with
//! different settings run side by side, at the same time, and each gets its own results.

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Int, Tensor, TensorData};
use ember_model::lora::Target;
use ember_model::{Compute, Decoder, ModelConfig, Weight};

use ember_kernels::{Bf16Products, Cpu, Path, Tier};

type B = Autodiff<Flex>;

/// Large enough for every bf16 path: GEMMs over 50 MFLOP, sequences over 256 positions, heads of 64.
fn config() -> ModelConfig {
    ModelConfig {
        d_model: 256,
        n_heads: 4,
        n_kv_heads: Some(2),
        d_ff: 1024,
        init_std: 0.05,
        ..ModelConfig::tiny(97, 320)
    }
}

/// The logits and the gradient of the first layer's q projection, as plain vectors.
fn step(model: &Decoder<B>, tokens: &Tensor<B, 2, Int>) -> (Vec<f32>, Vec<f32>) {
    let logits = model.forward(tokens.clone());
    let grads = logits.clone().powi_scalar(2).mean().backward();
    let Some(Weight::Dense(q)) = model.layers[0].projection(Target::QProj).map(|q| &q.weight) else {
        panic!("a dense q projection")
    };
    let g = q.grad(&grads).expect("a gradient");
    (logits.into_data().to_vec().expect("f32"), g.into_data().to_vec().expect("f32"))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn models_with_different_compute_run_side_by_side() {
    let cfg = config();
    let dev = Default::default();
    let base = Decoder::<B>::new(&cfg, 7, &dev).expect("a valid config");
    let ids: Vec<i32> = (0..320).map(|i| (i * 13 + 5) % 97).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, 320]), &dev);
    let settings = [
        ("f32 kernels", Compute::default().with_cpu(Cpu::f32_products())),
        ("bf16 products", Compute::default().with_bf16(Bf16Products::ALL)),
        ("reference", Compute::default().with_path(Path::Reference)),
        ("baseline copies", Compute::default().with_cpu(Cpu::f32_products().capped(Tier::Baseline))),
    ];
    // Alone, one after the other.
    let alone: Vec<_> = settings.iter().map(|(_, cx)| step(&base.clone().with_compute(*cx), &tokens)).collect();
    // All at once, each on its own thread, twice over: a setting that leaked into the others (a
    // process-wide switch) would change someone's bits.
    let together: Vec<Vec<_>> = std::thread::scope(|s| {
        let runs: Vec<_> = settings
            .iter()
            .map(|(_, cx)| {
                let model = base.clone().with_compute(*cx);
                let tokens = tokens.clone();
                s.spawn(move || (0..2).map(|_| step(&model, &tokens)).collect::<Vec<_>>())
            })
            .collect();
        runs.into_iter().map(|r| r.join().expect("a run")).collect()
    });
    for ((name, _), (once, twice)) in settings.iter().zip(alone.iter().zip(&together)) {
        for run in twice {
            assert_eq!(run.0, once.0, "{name}: logits changed when run beside the others");
            assert_eq!(run.1, once.1, "{name}: gradient changed when run beside the others");
        }
    }
    // They are different computations of the same model: close, and where the CPU has a bf16
    // kernel, the bf16 products are not the f32 ones.
    let f32_run = &alone[0];
    let scale = f32_run.0.iter().fold(0f32, |m, x| m.max(x.abs()));
    for ((name, _), run) in settings.iter().zip(&alone).skip(1) {
        let d = max_diff(&run.0, &f32_run.0);
        assert!(d <= 2e-2 * scale, "{name}: logits {d} from f32's (scale {scale})");
    }
    let bf16_differs = max_diff(&alone[1].0, &f32_run.0) > 0.0;
    assert_eq!(bf16_differs, Cpu::detect().bf16.is_some(), "bf16 products where the CPU has them, only there");
    assert_eq!(alone[3], alone[0], "the baseline copies compute the same bits as the widest");
}
