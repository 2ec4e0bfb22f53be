//! Every recipe in configs/ parses and validates: as a run's config, or (LoRA adapters without a
//! pretrained base to put them on) as a benchmark's, which `ember train` refuses. The templates
//! `ember init` writes (configs/pretrain.toml, lora.toml, full.toml) are among them.

use std::path::{Path, PathBuf};

use ember_train::config::Purpose;
use ember_train::{ConfigFile, TrainConfig};

fn configs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
}

/// SmolLM2-135M's architecture, as the benchmark config at its shapes writes it: the model the
/// fine-tuning templates start from (`init_from` gives it at run time).
fn smollm2() -> ember_model::ModelConfig {
    let file = ConfigFile::read_for(&configs().join("smollm2-135m-lora.toml"), Purpose::Bench).unwrap();
    file.config.model.expect("the benchmark config names its model")
}

#[test]
fn every_config_in_configs_is_valid() {
    let (mut runs, mut benches, mut fine_tunes) = (0, 0, 0);
    for entry in std::fs::read_dir(configs()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let bench = ConfigFile::read_for(&path, Purpose::Bench).unwrap_or_else(|e| panic!("{e}"));
        if bench.config.model.is_none() {
            // A fine-tune of the model init_from names: checked against SmolLM2's architecture.
            assert!(bench.config.init_from.is_some(), "{}", path.display());
            let run = ConfigFile::read(&path).unwrap_or_else(|e| panic!("{e}"));
            run.complete_with(smollm2()).unwrap_or_else(|e| panic!("{e}"));
            fine_tunes += 1;
            continue;
        }
        let random_base_lora = bench.config.lora.is_some() && bench.config.init_from.is_none();
        bench.complete().unwrap_or_else(|e| panic!("{e}"));
        match TrainConfig::from_file(&path) {
            Ok(_) => runs += 1,
            Err(e) if random_base_lora => {
                assert!(e.to_string().contains("set init_from"), "{}: {e}", path.display());
                benches += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        runs >= 2 && benches >= 1 && fine_tunes >= 2,
        "found {runs} run, {benches} benchmark and {fine_tunes} fine-tuning configs in {}",
        configs().display()
    );
}

#[test]
fn the_templates_are_the_recipes_they_describe() {
    // `ember init pretrain` is nano's run, with every key's default in a comment.
    let mut nano = TrainConfig::from_file(&configs().join("nano.toml")).unwrap();
    let pretrain = TrainConfig::from_file(&configs().join("pretrain.toml")).unwrap();
    // nano writes decay_steps out; the template leaves it to its default, max_steps.
    assert_eq!(nano.decay_steps(), pretrain.decay_steps());
    nano.schedule.decay_steps = None;
    assert_eq!(pretrain, nano);
    // The fine-tunes: SmolLM2 imported into runs/smollm2, the repository's example chat, the
    // defaults of what they leave out (LoRA's learning rate, the full fine-tune's).
    for (name, lr, lora) in [("lora.toml", 2e-4, true), ("full.toml", 5e-5, false)] {
        let c = ConfigFile::read(&configs().join(name)).unwrap().complete_with(smollm2()).unwrap();
        assert_eq!(c.init_from.as_ref().map(ToString::to_string).as_deref(), Some("run:runs/smollm2"), "{name}");
        assert_eq!(c.data.path.as_deref(), Some(Path::new("examples/chat.jsonl")), "{name}");
        assert_eq!((c.schedule.lr, c.lora.is_some(), c.train.seq_len), (lr, lora, None), "{name}");
        assert_eq!((c.train.eval_interval, c.schedule.warmup_steps), (c.train.max_steps / 10, c.train.max_steps / 20));
    }
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/chat.jsonl");
    let n = std::fs::read_to_string(examples).unwrap().lines().count();
    assert!((20..=100).contains(&n), "{n} examples");
}
