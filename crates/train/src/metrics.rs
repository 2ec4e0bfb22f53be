//! The metrics log: `metrics.jsonl` in the run directory, one JSON object per logged step.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::TrainError;

pub const METRICS_FILE: &str = "metrics.jsonl";

/// One logged step. Evaluation fields are present on evaluation steps only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Optimizer steps completed.
    pub step: usize,
    /// Mean loss of this step's micro-batches.
    pub train_loss: f64,
    /// Learning rate used by this step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Training tokens per second since the previous record (evaluation and checkpoint time excluded).
    pub tokens_per_sec: f64,
    /// Model FLOPs utilisation at `tokens_per_sec`: (6N + 12·L·T·d) · tokens/s / peak.
    pub mfu: f64,
    /// Hardware FLOPs utilisation, recomputation included (with activation checkpointing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hfu: Option<f64>,
    /// f16 dynamic loss scale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Wall time of the run so far, across resumes.
    pub elapsed_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Loss on the fixed training evaluation batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_train_loss: Option<f64>,
}

pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Opens `run_dir/metrics.jsonl` for appending, first dropping records after `keep_through_step`
    /// (records a stopped run wrote after its last checkpoint; the resumed run writes them again).
    pub fn open(run_dir: &Path, keep_through_step: Option<usize>) -> Result<Self, TrainError> {
        let path = run_dir.join(METRICS_FILE);
        if let Some(last) = keep_through_step {
            if path.exists() {
                let kept: Vec<String> = read_lines(&path)?
                    .into_iter()
                    .filter(|line| match serde_json::from_str::<StepRecord>(line) {
                        Ok(r) => r.step <= last,
                        Err(_) => false,
                    })
                    .collect();
                let mut text = kept.join("\n");
                if !text.is_empty() {
                    text.push('\n');
                }
                ember_data::write_atomic(&path, text.as_bytes())?;
            }
        }
        let file = OpenOptions::new().create(true).append(true).open(&path).map_err(TrainError::io(&path))?;
        Ok(Self { path, file })
    }

    pub fn write(&mut self, record: &StepRecord) -> Result<(), TrainError> {
        let mut line = serde_json::to_string(record).expect("record serialises");
        line.push('\n');
        self.file.write_all(line.as_bytes()).map_err(TrainError::io(&self.path))?;
        self.file.flush().map_err(TrainError::io(&self.path))
    }
}

fn read_lines(path: &Path) -> Result<Vec<String>, TrainError> {
    let f = File::open(path).map_err(TrainError::io(path))?;
    BufReader::new(f).lines().collect::<Result<_, _>>().map_err(TrainError::io(path))
}

/// Reads every well-formed record of a metrics log (a half-written last line is skipped).
pub fn read_metrics(path: &Path) -> Result<Vec<StepRecord>, TrainError> {
    Ok(read_lines(path)?.iter().filter_map(|l| serde_json::from_str(l).ok()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(step: usize) -> StepRecord {
        StepRecord {
            step,
            train_loss: 1.0,
            lr: 0.1,
            grad_norm: 0.5,
            tokens_per_sec: 10.0,
            mfu: 0.1,
            hfu: None,
            loss_scale: None,
            elapsed_s: 1.0,
            val_loss: (step % 2 == 0).then_some(2.0),
            eval_train_loss: None,
        }
    }

    #[test]
    fn reopening_for_a_resume_drops_later_records() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), None).unwrap();
        for s in 1..=5 {
            log.write(&rec(s)).unwrap();
        }
        drop(log);
        let mut log = MetricsLog::open(dir.path(), Some(3)).unwrap();
        log.write(&rec(4)).unwrap();
        let steps: Vec<usize> = read_metrics(&dir.path().join(METRICS_FILE)).unwrap().iter().map(|r| r.step).collect();
        assert_eq!(steps, [1, 2, 3, 4]);
        let text = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
        assert!(text.lines().next().unwrap().contains("\"val_loss\":2.0") == false);
        assert!(text.lines().nth(1).unwrap().contains("\"val_loss\":2.0"));
    }
}
