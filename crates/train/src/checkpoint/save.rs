//! Writing a checkpoint: files into a temporary folder, fsynced, renamed into place, then `latest`,
//! then pruning, each step durable before the next depends on it.

use std::path::{Path, PathBuf};

use ember_model::weights::to_safetensors;

use super::{step_dir_name, step_of, CheckpointData, RunInputs, INPUTS_FILE};
use super::{BestRecord, BEST_DIR, BEST_FILE, OPTIMIZER_FILE, STATE_FILE, TOKENIZER_EXTRAS, TOKENIZER_FILE};
use super::{ADAPTER_FILE, CHECKPOINTS, CONFIG_FILE, HF_CONFIG_FILE, LATEST, MODEL_CONFIG_FILE, MODEL_FILE};
use crate::error::TrainError;

/// Writes a checkpoint of `data.step` and makes it the latest; keeps the newest `keep`.
pub fn save(run_dir: &Path, data: CheckpointData<'_>, keep: usize) -> Result<PathBuf, TrainError> {
    let root = run_dir.join(CHECKPOINTS);
    if !root.is_dir() {
        std::fs::create_dir_all(&root).map_err(TrainError::io(&root))?;
        // `checkpoints/` itself must survive a power loss for the first checkpoint in it to.
        sync_dir(run_dir)?;
    }
    let name = step_dir_name(data.step);
    let tmp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    write_folder(&tmp, checkpoint_files(&data)?)?;
    let dest = root.join(&name);
    if dest.exists() {
        // A resumed run that passes the same step again: replace the older copy.
        let old = root.join(format!(".{name}.old-{}", std::process::id()));
        rename(&dest, &old)?;
        std::fs::remove_dir_all(&old).map_err(TrainError::io(&old))?;
    }
    rename(&tmp, &dest)?;
    sync_dir(&root)?;
    // `latest` is written (and it and its folder synced) only once the folder it names is durable,
    // and pruning waits for `latest`: a power loss at any point leaves a `latest` naming a whole
    // checkpoint that is still there.
    ember_data::write_atomic(&root.join(LATEST), name.as_bytes())?;
    journal(|| format!("latest {name}"));
    prune(&root, keep, &name)?;
    Ok(dest)
}

/// The files of a checkpoint folder, by name.
fn checkpoint_files(data: &CheckpointData<'_>) -> Result<Vec<(&'static str, Vec<u8>)>, TrainError> {
    let meta = |kind: &str| {
        Some(std::collections::HashMap::from([
            ("format".to_string(), "ember".to_string()),
            ("content".to_string(), kind.to_string()),
            ("step".to_string(), data.step.to_string()),
        ]))
    };
    let weights_file = if data.adapters_only { ADAPTER_FILE } else { MODEL_FILE };
    let model_toml = toml::to_string_pretty(data.model_config).expect("model config serialises");
    let mut files: Vec<(&'static str, Vec<u8>)> = vec![
        (weights_file, to_safetensors(&data.weights, meta("model"))),
        (MODEL_CONFIG_FILE, model_toml.into_bytes()),
        (TOKENIZER_FILE, data.tokenizer.to_json()?.into_bytes()),
    ];
    if let Some(hf) = data.hf_config {
        files.push((HF_CONFIG_FILE, serde_json::to_vec_pretty(hf).expect("json serialises")));
    }
    if let Some(t) = &data.training {
        files.push((OPTIMIZER_FILE, to_safetensors(&t.optimizer, meta("adamw"))));
        files.push((STATE_FILE, serde_json::to_vec_pretty(t.state).expect("state serialises")));
        files.push((CONFIG_FILE, t.config.to_toml().into_bytes()));
        files.push((INPUTS_FILE, serde_json::to_vec_pretty(t.inputs).expect("inputs serialise")));
    }
    for extra in TOKENIZER_EXTRAS {
        if let Some(src) = data.tokenizer_dir.map(|d| d.join(extra)).filter(|p| p.is_file()) {
            files.push((extra, std::fs::read(&src).map_err(TrainError::io(&src))?));
        }
    }
    Ok(files)
}

/// Writes `files` into the fresh folder `tmp` (one left by an earlier process of the same id is
/// replaced), each file and then the folder fsynced. Inside the folder nothing needs replacing
/// atomically (the folder is the unit), but every file must be on disk before the folder's rename
/// can be.
fn write_folder(tmp: &Path, files: Vec<(&'static str, Vec<u8>)>) -> Result<(), TrainError> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).map_err(TrainError::io(tmp))?;
    }
    std::fs::create_dir_all(tmp).map_err(TrainError::io(tmp))?;
    for (file, bytes) in files {
        write_synced(&tmp.join(file), &bytes)?;
    }
    sync_dir(tmp)
}

/// Replaces `<run_dir>/best` with a checkpoint of `data` (weights, model, tokenizer, the run's
/// `config` and `inputs`; no optimizer or loop state: it is for sampling, evaluating and exporting, not for
/// resuming) and `best.json` naming its step and val loss. Written aside and renamed into place
/// like a step's checkpoint; the folder it replaces is renamed to `.best.old-PID` first and deleted
/// after, and a run killed between the two renames gets it back at its next start
/// ([`super::run_dir::tidy_run_dir`]).
pub(crate) fn save_best(
    run_dir: &Path,
    data: CheckpointData<'_>,
    config: &crate::config::TrainConfig,
    inputs: &RunInputs,
    val_loss: f64,
) -> Result<PathBuf, TrainError> {
    let best = BestRecord { step: data.step, val_loss };
    let mut files = checkpoint_files(&CheckpointData { training: None, ..data })?;
    files.push((CONFIG_FILE, config.to_toml().into_bytes()));
    files.push((INPUTS_FILE, serde_json::to_vec_pretty(inputs).expect("inputs serialise")));
    files.push((BEST_FILE, serde_json::to_vec_pretty(&best).expect("best record serialises")));
    std::fs::create_dir_all(run_dir).map_err(TrainError::io(run_dir))?;
    let pid = std::process::id();
    let tmp = run_dir.join(format!(".{BEST_DIR}.tmp-{pid}"));
    write_folder(&tmp, files)?;
    let dest = run_dir.join(BEST_DIR);
    let old = run_dir.join(format!(".{BEST_DIR}.old-{pid}"));
    let replacing = dest.exists();
    if replacing {
        rename(&dest, &old)?;
    }
    rename(&tmp, &dest)?;
    sync_dir(run_dir)?;
    if replacing {
        std::fs::remove_dir_all(&old).map_err(TrainError::io(&old))?;
        journal(|| format!("remove {}", file_name(&old)));
    }
    Ok(dest)
}

/// Deletes all but the newest `keep` step folders (never `current`). Newest by step number, not by
/// name: names are zero-padded to six digits only, so as text `step-1000000` sorts before
/// `step-999999` and the newest checkpoints would be the ones deleted.
fn prune(root: &Path, keep: usize, current: &str) -> Result<(), TrainError> {
    let mut steps: Vec<(u64, String)> = std::fs::read_dir(root)
        .map_err(TrainError::io(root))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter_map(|n| step_of(&n).map(|s| (s, n)))
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, name) in steps.into_iter().take(excess).filter(|(_, n)| n != current) {
        let dir = root.join(&name);
        std::fs::remove_dir_all(&dir).map_err(TrainError::io(&dir))?;
        journal(|| format!("prune {name}"));
    }
    Ok(())
}

/// Writes a file and fsyncs it (no rename: inside a checkpoint's temporary folder the folder's own
/// rename is what makes the files appear at once).
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(TrainError::io(path))?;
    f.write_all(bytes).map_err(TrainError::io(path))?;
    f.sync_all().map_err(TrainError::io(path))?;
    journal(|| format!("file {}", file_name(path)));
    Ok(())
}

/// fsyncs a folder, so that the files created and renamed in it survive a power loss.
fn sync_dir(dir: &Path) -> Result<(), TrainError> {
    ember_data::sync_dir(dir).map_err(TrainError::io(dir))?;
    journal(|| format!("sync {}", file_name(dir)));
    Ok(())
}

fn rename(from: &Path, to: &Path) -> Result<(), TrainError> {
    std::fs::rename(from, to).map_err(TrainError::io(to))?;
    journal(|| format!("rename {} {}", file_name(from), file_name(to)));
    Ok(())
}

pub(super) fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

#[cfg(test)]
thread_local! {
    /// What `save` did to the disk, in order, for the test of its durability order.
    static JOURNAL: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Records a step of `save` in tests; nothing otherwise.
fn journal(event: impl FnOnce() -> String) {
    #[cfg(test)]
    JOURNAL.with(|j| j.borrow_mut().push(event()));
    #[cfg(not(test))]
    let _ = event;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::testing::{data, mkdirs, names};
    use ember_data::Tokenizer;

    #[test]
    fn prune_orders_by_step_number_past_a_million() {
        let dir = tempfile::tempdir().unwrap();
        mkdirs(dir.path(), &["step-999998", "step-999999", "step-1000000", "step-1000001", "other"]);
        prune(dir.path(), 2, "step-1000001").unwrap();
        assert_eq!(names(dir.path()), ["other", "step-1000000", "step-1000001"]);
        assert_eq!(step_of("step-000250"), Some(250));
        assert_eq!(step_of("step-"), None);
        assert_eq!(step_of("step-12a"), None);
        assert_eq!(step_of(".step-000001.tmp-12"), None);
    }

    #[test]
    fn save_syncs_each_step_before_the_next_depends_on_it() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::train_char("abc");
        save(dir.path(), data(1, &tok), 1).unwrap();
        JOURNAL.with(|j| j.borrow_mut().clear());
        save(dir.path(), data(2, &tok), 1).unwrap();
        let events = JOURNAL.with(|j| j.borrow().clone());
        let at = |prefix: &str| {
            events.iter().position(|e| e.starts_with(prefix)).unwrap_or_else(|| panic!("no `{prefix}` in {events:?}"))
        };
        let files: Vec<usize> =
            events.iter().enumerate().filter(|(_, e)| e.starts_with("file ")).map(|(i, _)| i).collect();
        assert_eq!(files.len(), 3, "{events:?}");
        let tmp = format!(".step-000002.tmp-{}", std::process::id());
        let (sync_tmp, rename) = (at(&format!("sync {tmp}")), at(&format!("rename {tmp} step-000002")));
        let (sync_root, latest, prune) = (at("sync checkpoints"), at("latest step-000002"), at("prune step-000001"));
        assert!(files.iter().all(|&f| f < sync_tmp), "{events:?}");
        assert!(sync_tmp < rename && rename < sync_root && sync_root < latest && latest < prune, "{events:?}");
        assert_eq!(names(&dir.path().join(CHECKPOINTS)), [LATEST, "step-000002"]);
    }

    #[test]
    fn the_best_checkpoint_is_replaced_whole_and_a_killed_replacement_is_undone() {
        use crate::checkpoint::{read_best, tidy_run_dir, Checkpoint};
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let text = dir.path().join("text.txt");
        std::fs::write(&text, "abc".repeat(100)).unwrap();
        let tok = Tokenizer::train_char("abc");
        let toml = format!(
            "[model]\nd_model = 8\nn_layers = 1\nn_heads = 2\nd_ff = 16\nmax_seq_len = 8\n\n\
             [data]\npath = {:?}\ntokenizer = \"char\"\n\n\
             [train]\nbatch_size = 1\nmax_steps = 6\neval_interval = 1\neval_iters = 1\n\n\
             [optim]\n\n[schedule]\nlr = 1e-3\n",
            text.display().to_string()
        );
        let config = crate::config::TrainConfig::from_toml(&toml, Path::new("t.toml")).unwrap();
        let inputs = RunInputs::default();
        save_best(&run, data(3, &tok), &config, &inputs, 1.5).unwrap();
        save_best(&run, data(5, &tok), &config, &inputs, 1.25).unwrap();
        // One copy, no temporaries: the step-3 folder was replaced whole.
        assert_eq!(names(&run), [BEST_DIR]);
        assert_eq!(read_best(&run), Some(BestRecord { step: 5, val_loss: 1.25 }));
        // Weights, model and the run's config (for `eval --data val` and LoRA bases); no optimizer.
        let best = Checkpoint::open(&run.join(BEST_DIR)).unwrap();
        assert!(best.state.is_none() && best.config.is_some(), "{best:?}");
        assert!(run.join(BEST_DIR).join(MODEL_FILE).is_file() && !run.join(BEST_DIR).join(OPTIMIZER_FILE).exists());
        if !cfg!(target_os = "linux") {
            return; // whether a writer still runs is told from /proc
        }
        // Killed between moving the old folder aside and renaming the new one into place: the next
        // start puts the old one back instead of deleting it as a leftover.
        let dead = 4_194_305u32; // above Linux's largest pid_max
        std::fs::rename(run.join(BEST_DIR), run.join(format!(".{BEST_DIR}.old-{dead}"))).unwrap();
        mkdirs(&run, &[&format!(".{BEST_DIR}.tmp-{dead}")]);
        tidy_run_dir(&run).unwrap();
        assert_eq!(names(&run), [BEST_DIR]);
        assert_eq!(read_best(&run).map(|b| b.step), Some(5));
    }
}
