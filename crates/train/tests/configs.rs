//! Every recipe in configs/ parses and validates: as a run's config, or (LoRA adapters without a
//! pretrained base to put them on) as a benchmark's, which `ember train` refuses.

use ember_train::config::Purpose;
use ember_train::{ConfigFile, TrainConfig};

#[test]
fn every_config_in_configs_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let (mut runs, mut benches) = (0, 0);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let bench = ConfigFile::read_for(&path, Purpose::Bench).unwrap_or_else(|e| panic!("{e}"));
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
    assert!(runs >= 2 && benches >= 1, "found {runs} run and {benches} benchmark configs in {}", dir.display());
}
