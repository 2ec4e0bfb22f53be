//! Muon's Newton–Schulz iteration over one step's matrices (all of a config's block matrices at
//! once, as the optimizer calls it): f32; bf16 rounding on f32 products; bf16 on each bf16 kernel
//! this CPU reaches. Alternating, 5 rounds, the median; GFLOP/s counts the three products of each
//! of the 5 steps. Side by side with torch.optim.Muon's iteration: experiments/ns_vs_torch.py.
//!
//! ```sh
//! cargo bench -p ember-train --bench newton_schulz -- 6 384 1024    # layers, width, d_ff
//! ```
//!
//! Results are in experiments/speedrun.md.

use std::time::Instant;

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use ember_kernels::newton_schulz::{newton_schulz, NsStep};
use ember_kernels::{on_cpu_workers, Bf16Kernel, Bf16Products, Compute, Cpu};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let [layers, d, ff] = match args[..] {
        [l, d, f] => [l, d, f],
        _ => [6, 384, 1024],
    };
    // q, k, v, o [d, d]; gate, up [d, ff]; down [ff, d] (ember's [fan_in, fan_out]).
    let shapes: Vec<[usize; 2]> =
        (0..layers).flat_map(|_| [[d, d], [d, d], [d, d], [d, d], [d, ff], [d, ff], [ff, d]]).collect();
    let flops: f64 = shapes
        .iter()
        .map(|&[r, c]| {
            let (s, l) = (r.min(c) as f64, r.max(c) as f64);
            5.0 * 2.0 * (s * s * l + s * s * s + s * s * l)
        })
        .sum();
    let matrices: Vec<Tensor<Flex, 2>> = shapes
        .iter()
        .enumerate()
        .map(|(i, &[r, c])| {
            let v: Vec<f32> = (0..r * c).map(|e| (((e * 7919 + i * 104_729) % 2000) as f32 / 1000.0) - 1.0).collect();
            Tensor::from_data(TensorData::new(v, [r, c]), &Default::default())
        })
        .collect();
    let plain = Cpu::f32_products();
    let mut modes = vec![("f32", false, plain), ("bf16, f32 products", true, plain)];
    for k in Bf16Kernel::reachable() {
        modes.push((k.name(), true, Cpu { bf16: Some(k), ..plain }));
    }
    let mut times = vec![Vec::new(); modes.len()];
    on_cpu_workers(|| {
        for round in 0..6 {
            for (i, &(_, bf16, cpu)) in modes.iter().enumerate() {
                let h = NsStep { coefficients: [3.4445, -4.7750, 2.0315], steps: 5, eps: 1e-7, bf16 };
                let t = Instant::now();
                let on = Bf16Products { newton_schulz: cpu.bf16, ..Bf16Products::NONE };
                let out = newton_schulz(matrices.clone(), h, Compute::default().with_bf16(on));
                assert_eq!(out.len(), matrices.len());
                if round > 0 {
                    times[i].push(t.elapsed().as_secs_f64());
                }
            }
        }
    });
    println!("{} matrices ({layers} layers, width {d}, d_ff {ff}), {:.1} GFLOP", shapes.len(), flops / 1e9);
    for ((name, _, _), t) in modes.iter().zip(times) {
        let m = median(t);
        println!("{name:>20}: {:8.1} ms  {:6.1} GFLOP/s", m * 1e3, flops / m / 1e9);
    }
}
