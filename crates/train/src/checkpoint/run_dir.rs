//! A run directory made ready to start or resume: what killed writers left behind removed, a
//! missing `latest` restored, and the logs of an attempt that never checkpointed set aside.

use std::path::{Path, PathBuf};

use super::save::file_name;
use super::{step_of, Checkpoint, BEST_DIR, CHECKPOINTS, LATEST, MODEL_CONFIG_FILE};
use crate::error::TrainError;

/// Gets a run directory ready for a start or a resume: leftovers of killed writers removed
/// ([`remove_stale_temporaries`]) and a missing `latest` restored ([`recover_latest`]), so that
/// [`has_checkpoint`] then tells what a resume would find.
pub(crate) fn tidy_run_dir(run_dir: &Path) -> Result<(), TrainError> {
    recover_best(run_dir)?;
    remove_stale_temporaries(run_dir)?;
    recover_latest(run_dir)
}

/// Puts back the best checkpoint of a process killed while replacing it: between renaming `best`
/// to `.best.old-PID` and the new one into place ([`super::save_best`]), there is no `best`, and the
/// old one would be removed as a leftover.
fn recover_best(run_dir: &Path) -> Result<(), TrainError> {
    let best = run_dir.join(BEST_DIR);
    if best.exists() {
        return Ok(());
    }
    let Ok(entries) = std::fs::read_dir(run_dir) else { return Ok(()) };
    let prefix = format!(".{BEST_DIR}.old-");
    let old = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with(&prefix) && leftover_pid(n).and_then(process_gone) == Some(true));
    if let Some(name) = old {
        let from = run_dir.join(&name);
        std::fs::rename(&from, &best).map_err(TrainError::io(&best))?;
        ember_data::sync_dir(run_dir).map_err(TrainError::io(run_dir))?;
        tracing::warn!(path = %best.display(), "restored the best checkpoint a killed run was replacing");
    }
    Ok(())
}

/// Whether the run in `run_dir` has a checkpoint to resume from.
pub(crate) fn has_checkpoint(run_dir: &Path) -> bool {
    run_dir.join(CHECKPOINTS).join(LATEST).is_file()
}

/// Removes what killed writers left in `run_dir` and in its `checkpoints/`: checkpoint folders being
/// written (`.step-N.tmp-PID`) or replaced (`.step-N.old-PID`), and the temporary files of
/// `write_atomic` (`.NAME.tmp-PID`), each when process PID no longer runs. Nothing reads them, but
/// each holds up to a checkpoint's worth of disk, and one more is left by every kill.
///
/// Our own id counts as gone: this process has not yet written into the run, so a leftover with its
/// id is from an earlier process that had the same one (a restarted container starts again from the
/// same low ids). Where liveness cannot be told (no `/proc`), nothing is removed. A process of
/// another PID namespace writing into the same run is not seen; two writers of one run are not
/// supported anyway.
pub(crate) fn remove_stale_temporaries(run_dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    let mut removed = Vec::new();
    for dir in [run_dir.to_path_buf(), run_dir.join(CHECKPOINTS)] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = leftover_pid(&name) else { continue };
            match process_gone(pid) {
                Some(true) => {}
                Some(false) => continue,
                None => {
                    tracing::debug!(name, pid, "cannot tell whether the writer of a temporary still runs; leaving it");
                    continue;
                }
            }
            let path = entry.path();
            let result = if entry.file_type().is_ok_and(|t| t.is_dir()) {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match result {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(TrainError::Io { path, err: e }),
            }
            tracing::info!(path = %path.display(), pid, "removed a temporary left by a process that no longer runs");
            removed.push(path);
        }
    }
    Ok(removed)
}

/// The writer's process id in the name of a leftover temporary: `.NAME.tmp-PID` or `.NAME.old-PID`.
fn leftover_pid(name: &str) -> Option<u32> {
    let (stem, pid) = name.strip_prefix('.')?.rsplit_once('-')?;
    if !(stem.ends_with(".tmp") || stem.ends_with(".old")) || pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    pid.parse().ok()
}

/// Whether process `pid` no longer runs (see [`remove_stale_temporaries`] for our own id); `None`
/// where this cannot be told.
fn process_gone(pid: u32) -> Option<bool> {
    if pid == std::process::id() {
        return Some(true);
    }
    if !Path::new("/proc/self").exists() {
        return None;
    }
    Some(!Path::new("/proc").join(pid.to_string()).exists())
}

/// Writes `checkpoints/latest` when it is missing, or names no checkpoint folder, but complete step
/// folders exist. A process killed after renaming its first checkpoint into place and before writing
/// `latest` leaves the first case (a folder is renamed into place only when complete); one killed
/// while replacing the very folder `latest` names (`.step-N.old-PID`) the second. Without this the
/// run would be stuck: a checkpoint to keep, so no restart, and no usable `latest`, so no resume.
/// The newest folder that opens is named.
fn recover_latest(run_dir: &Path) -> Result<(), TrainError> {
    let root = run_dir.join(CHECKPOINTS);
    let latest = root.join(LATEST);
    if let Ok(name) = std::fs::read_to_string(&latest) {
        if root.join(name.trim()).join(MODEL_CONFIG_FILE).is_file() {
            return Ok(());
        }
    }
    let Ok(entries) = std::fs::read_dir(&root) else { return Ok(()) };
    let mut steps: Vec<(u64, String)> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter_map(|n| step_of(&n).map(|s| (s, n)))
        .collect();
    steps.sort();
    for (_, name) in steps.into_iter().rev() {
        let dir = root.join(&name);
        match Checkpoint::open(&dir) {
            Ok(_) => {
                ember_data::write_atomic(&latest, name.as_bytes())?;
                tracing::warn!(
                    dir = %dir.display(),
                    "{} was missing or named no checkpoint (a run killed while checkpointing); it now names {name}",
                    latest.display()
                );
                return Ok(());
            }
            Err(e) => tracing::warn!(dir = %dir.display(), "not naming it in {LATEST}: {e}"),
        }
    }
    Ok(())
}

/// Before a run without a checkpoint starts again from step 0: the logs of its earlier attempt
/// (killed before its first checkpoint) cover steps that are about to be trained again, and, being
/// appended to, would list them twice. The JSON-lines `logs` (`metrics.jsonl`, `samples.jsonl`) are
/// renamed to `*.aborted`, which nothing reads (kept to look at; an older one is replaced);
/// TensorBoard event files are deleted, since TensorBoard reads every file with `tfevents` in its
/// name, whatever its suffix, and so is the attempt's `best/`. Says what it did in a warning.
pub(crate) fn set_aside_dead_attempt(run_dir: &Path, logs: &[&str]) -> Result<(), TrainError> {
    let Ok(entries) = std::fs::read_dir(run_dir) else { return Ok(()) };
    let events: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("tfevents") && e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.path())
        .collect();
    let mut done = Vec::new();
    for name in logs {
        let path = run_dir.join(name);
        if path.is_file() {
            let aside = run_dir.join(format!("{name}.aborted"));
            std::fs::rename(&path, &aside).map_err(TrainError::io(&path))?;
            done.push(format!("{name} renamed to {name}.aborted"));
        }
    }
    for path in events {
        std::fs::remove_file(&path).map_err(TrainError::io(&path))?;
        done.push(format!("{} deleted", file_name(&path)));
    }
    // Its best weights too: the new attempt's first evaluation would replace them, but until then
    // they would pass for the new attempt's.
    let best = run_dir.join(BEST_DIR);
    if best.is_dir() {
        std::fs::remove_dir_all(&best).map_err(TrainError::io(&best))?;
        done.push(format!("{BEST_DIR}/ deleted"));
    }
    if !done.is_empty() {
        tracing::warn!(
            run_dir = %run_dir.display(),
            "the run has no checkpoint (its last attempt stopped before the first one): starting it again \
             from step 0; the old attempt's logs: {}",
            done.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::save;
    use crate::checkpoint::testing::{data, mkdirs, names};
    use ember_data::Tokenizer;

    #[cfg(target_os = "linux")]
    #[test]
    fn stale_temporaries_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let root = run.join(CHECKPOINTS);
        // Above the largest pid_max Linux allows (2^22): no process has this id.
        let dead = 4_194_305u32;
        let live = std::os::unix::process::parent_id();
        let ours = std::process::id();
        mkdirs(
            &root,
            &[
                &format!(".step-000005.tmp-{dead}"),
                &format!(".step-000004.old-{dead}"),
                &format!(".step-000006.tmp-{ours}"),
                &format!(".step-000007.tmp-{live}"),
                "step-000003",
            ],
        );
        std::fs::write(root.join(format!(".step-000005.tmp-{dead}/model.toml")), "x").unwrap();
        std::fs::write(root.join(format!(".latest.tmp-{dead}")), "step-000005").unwrap();
        std::fs::write(run.join(format!(".metrics.jsonl.tmp-{dead}")), "").unwrap();
        std::fs::write(run.join("notes.tmp-1"), "").unwrap();
        let removed = remove_stale_temporaries(run).unwrap();
        assert_eq!(removed.len(), 5, "{removed:?}");
        assert_eq!(names(&root), [format!(".step-000007.tmp-{live}"), "step-000003".to_string()]);
        assert_eq!(names(run), [CHECKPOINTS, "notes.tmp-1"]);
        assert_eq!(leftover_pid(".step-000001.tmp-"), None);
        assert_eq!(leftover_pid(".step-000001.new-12"), None);
        assert_eq!(leftover_pid("step-000001.tmp-12"), None);
    }

    #[test]
    fn a_missing_latest_names_the_newest_complete_folder() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        let tok = Tokenizer::train_char("abc");
        save(run, data(1, &tok), 5).unwrap();
        save(run, data(2, &tok), 5).unwrap();
        // A folder that does not open is not named.
        mkdirs(&run.join(CHECKPOINTS), &["step-000003"]);
        std::fs::remove_file(run.join(CHECKPOINTS).join(LATEST)).unwrap();
        assert!(!has_checkpoint(run));
        tidy_run_dir(run).unwrap();
        assert!(has_checkpoint(run));
        assert_eq!(std::fs::read_to_string(run.join(CHECKPOINTS).join(LATEST)).unwrap(), "step-000002");
        // A latest naming a folder that is gone.
        std::fs::write(run.join(CHECKPOINTS).join(LATEST), "step-000007").unwrap();
        tidy_run_dir(run).unwrap();
        assert_eq!(std::fs::read_to_string(run.join(CHECKPOINTS).join(LATEST)).unwrap(), "step-000002");
        // Nothing to recover from: no latest is made up.
        let empty = tempfile::tempdir().unwrap();
        tidy_run_dir(empty.path()).unwrap();
        assert!(!has_checkpoint(empty.path()));
    }
}
