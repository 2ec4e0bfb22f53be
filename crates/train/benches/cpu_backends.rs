//! Which CPU backend to train on, by measurement: the training step of a config on Flex (with
//! ember's kernels, the default) and on NdArray (which runs the reference compositions), in one
//! process, alternating, median of medians.
//!
//! ```sh
//! EMBER_DATA_DIR=../shared/datasets cargo bench -p ember-train --bench cpu_backends -- configs/nano.toml
//! ```
//!
//! Flex's own compositions (kernels off) are `EMBER_FUSED=0 ember bench train --config ...`. Results
//! are in experiments/cpu-speed.md.

use std::path::PathBuf;

use burn::backend::{Autodiff, Flex, NdArray};
use ember_data::fetch::Locations;
use ember_kernels::{on_cpu_workers, TrainBackend};
use ember_train::bench::{bench_run, BenchSettings, NoProbe};
use ember_train::TrainConfig;

fn step_ms<B: TrainBackend>(config: &TrainConfig, name: &str) -> f64 {
    let device = Default::default();
    let run = || {
        let run = config.clone().resolve()?;
        let locations = Locations {
            repo_dir: PathBuf::from("datasets"),
            data_dir: std::env::var_os("EMBER_DATA_DIR").map(PathBuf::from),
            cache_dir: PathBuf::from(".ember-cache"),
        };
        let settings = BenchSettings { warmup: 3, steps: 10, ..Default::default() };
        bench_run::<B>(run, &locations, &settings, &device, name, &NoProbe)
    };
    match on_cpu_workers(run) {
        Ok(r) => r.step_ms,
        Err(e) => {
            eprintln!("{name}: {e}");
            std::process::exit(1);
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; the config is the first argument that is not a flag.
    let path = std::env::args().skip(1).find(|a| !a.starts_with("--")).unwrap_or_else(|| "configs/nano.toml".into());
    // Benches run from the crate's folder; configs and datasets are at the workspace root.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::env::set_current_dir(&root).expect("workspace root");
    let config = match TrainConfig::from_file(std::path::Path::new(&path)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{path}: {e}");
            std::process::exit(1);
        }
    };
    let (mut flex, mut ndarray) = (Vec::new(), Vec::new());
    for round in 1..=3 {
        flex.push(step_ms::<Autodiff<Flex>>(&config, "flex"));
        ndarray.push(step_ms::<Autodiff<NdArray>>(&config, "ndarray"));
        println!("round {round}: flex {:.1} ms/step, ndarray {:.1} ms/step", flex[round - 1], ndarray[round - 1]);
    }
    let (f, n) = (median(flex), median(ndarray));
    println!(
        "{path}: flex {f:.1} ms/step, ndarray {n:.1} ms/step (median of 3 rounds of 10 steps); flex is {:.2}x",
        n / f
    );
}
