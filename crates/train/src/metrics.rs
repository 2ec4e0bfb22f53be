//! Where metrics go: sinks behind one trait, chosen in the config (`[metrics] sinks`). The JSON-lines
//! sink writes `metrics.jsonl` (one object per logged step) and `samples.jsonl` (text generated at
//! evaluations); the TensorBoard sink writes `events.out.tfevents.*` files.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::TrainError;

pub(crate) const METRICS_FILE: &str = "metrics.jsonl";
pub(crate) const SAMPLES_FILE: &str = "samples.jsonl";

/// Text generated at an evaluation step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct SampleRecord {
    pub step: usize,
    pub elapsed_s: f64,
    pub prompt: String,
    pub text: String,
}

/// The evaluation before the first step, `metrics.jsonl`'s first line: where the val curve starts.
/// No step has been taken, so it has none of a step's fields (`train_loss`, `lr`, `grad_norm`,
/// throughput); its keys are those of [`StepRecord`] (`step` 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct InitialEvalRecord {
    pub step: usize,
    pub elapsed_s: f64,
    pub val_loss: f64,
    /// Fine-tuning runs: 0 epochs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<f64>,
    /// The objective's metrics of the evaluation (`val_…`), as a step's evaluation records them.
    #[serde(flatten, default)]
    pub named: std::collections::BTreeMap<String, f64>,
}

/// A destination for what training logs.
pub(crate) trait MetricsSink {
    fn record(&mut self, record: &StepRecord) -> Result<(), TrainError>;
    fn sample(&mut self, sample: &SampleRecord) -> Result<(), TrainError>;
    /// The evaluation before the first step.
    fn initial(&mut self, record: &InitialEvalRecord) -> Result<(), TrainError>;
}

/// `metrics.jsonl` and `samples.jsonl`.
pub(crate) struct JsonlSink {
    metrics: MetricsLog,
    samples: AppendLog,
}

impl JsonlSink {
    /// Opens both logs, dropping records after `keep_through_step` when resuming.
    pub(crate) fn open(run_dir: &Path, keep_through_step: Option<usize>) -> Result<Self, TrainError> {
        Ok(Self {
            metrics: MetricsLog::open(run_dir, keep_through_step)?,
            samples: AppendLog::open(&run_dir.join(SAMPLES_FILE), keep_through_step, |line| {
                serde_json::from_str::<SampleRecord>(line).ok().map(|r| r.step)
            })?,
        })
    }
}

impl MetricsSink for JsonlSink {
    fn record(&mut self, record: &StepRecord) -> Result<(), TrainError> {
        self.metrics.write(record)
    }
    fn sample(&mut self, sample: &SampleRecord) -> Result<(), TrainError> {
        self.samples.write_line(&serde_json::to_string(sample).expect("sample serialises"))
    }
    fn initial(&mut self, record: &InitialEvalRecord) -> Result<(), TrainError> {
        self.metrics.log.write_line(&serde_json::to_string(record).expect("record serialises"))
    }
}

/// TensorBoard scalars (and the samples as text).
pub(crate) struct TensorBoardSink {
    writer: crate::tensorboard::EventWriter,
    /// Wall time of step 0 of this invocation minus the run's elapsed time before it.
    start: f64,
}

impl TensorBoardSink {
    pub(crate) fn create(run_dir: &Path, resumed_at: Option<usize>, elapsed_before: f64) -> Result<Self, TrainError> {
        let writer = crate::tensorboard::EventWriter::create(run_dir, resumed_at.map(|s| s as u64))?;
        Ok(Self { writer, start: crate::tensorboard::wall_time() - elapsed_before })
    }
}

impl MetricsSink for TensorBoardSink {
    fn record(&mut self, r: &StepRecord) -> Result<(), TrainError> {
        let mut values: Vec<(&str, f32)> = vec![
            ("loss/train", r.train_loss as f32),
            ("lr", r.lr as f32),
            ("grad_norm", r.grad_norm as f32),
            ("grad_clipped", r.clipped as u8 as f32),
            ("tokens_per_sec", r.tokens_per_sec as f32),
            ("mfu", r.mfu as f32),
            ("step_ms", r.step_ms as f32),
        ];
        let optional = [
            ("loss/val", r.val_loss),
            ("loss/eval_train", r.eval_train_loss),
            ("loss_scale", r.loss_scale),
            ("memory_bytes", r.memory_bytes.map(|m| m as f64)),
            ("epoch", r.epoch),
        ];
        values.extend(optional.iter().filter_map(|(k, v)| v.map(|v| (*k, v as f32))));
        values.extend(r.named.iter().map(|(k, v)| (k.as_str(), *v as f32)));
        self.writer.scalars(r.step as u64, self.start + r.elapsed_s, &values)?;
        self.writer.flush()
    }
    fn sample(&mut self, s: &SampleRecord) -> Result<(), TrainError> {
        // Markdown code block: TensorBoard renders text summaries as Markdown.
        let text = format!("```\n{}{}\n```", s.prompt, s.text);
        self.writer.text(s.step as u64, self.start + s.elapsed_s, "samples", &text)?;
        self.writer.flush()
    }
    fn initial(&mut self, r: &InitialEvalRecord) -> Result<(), TrainError> {
        let mut values = vec![("loss/val", r.val_loss as f32)];
        values.extend(r.epoch.map(|e| ("epoch", e as f32)));
        values.extend(r.named.iter().map(|(k, v)| (k.as_str(), *v as f32)));
        self.writer.scalars(r.step as u64, self.start + r.elapsed_s, &values)?;
        self.writer.flush()
    }
}

/// Every configured sink.
pub(crate) struct Sinks(pub Vec<Box<dyn MetricsSink>>);

impl MetricsSink for Sinks {
    fn record(&mut self, record: &StepRecord) -> Result<(), TrainError> {
        self.0.iter_mut().try_for_each(|s| s.record(record))
    }
    fn sample(&mut self, sample: &SampleRecord) -> Result<(), TrainError> {
        self.0.iter_mut().try_for_each(|s| s.sample(sample))
    }
    fn initial(&mut self, record: &InitialEvalRecord) -> Result<(), TrainError> {
        self.0.iter_mut().try_for_each(|s| s.initial(record))
    }
}

/// An append-only JSON-lines file, truncated past a step on resume.
struct AppendLog {
    path: PathBuf,
    file: File,
}

impl AppendLog {
    fn open(
        path: &Path,
        keep_through_step: Option<usize>,
        step_of: impl Fn(&str) -> Option<usize>,
    ) -> Result<Self, TrainError> {
        if let (Some(last), true) = (keep_through_step, path.exists()) {
            let kept: Vec<String> =
                read_lines(path)?.into_iter().filter(|l| step_of(l).is_some_and(|s| s <= last)).collect();
            let mut text = kept.join("\n");
            if !text.is_empty() {
                text.push('\n');
            }
            ember_data::write_atomic(path, text.as_bytes())?;
        }
        let file = OpenOptions::new().create(true).append(true).open(path).map_err(TrainError::io(path))?;
        Ok(Self { path: path.into(), file })
    }

    fn write_line(&mut self, line: &str) -> Result<(), TrainError> {
        let mut line = line.to_string();
        line.push('\n');
        self.file.write_all(line.as_bytes()).map_err(TrainError::io(&self.path))?;
        self.file.flush().map_err(TrainError::io(&self.path))
    }
}

/// One logged step. Evaluation fields are present on evaluation steps only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Optimizer steps completed.
    pub step: usize,
    /// Mean loss of this step's micro-batches.
    pub train_loss: f64,
    /// Learning rate used by this step.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether clipping scaled the gradients down.
    #[serde(default)]
    pub clipped: bool,
    /// Milliseconds per optimizer step, averaged like `tokens_per_sec`.
    #[serde(default)]
    pub step_ms: f64,
    /// Training tokens per second since the previous record (evaluation and checkpoint time excluded).
    pub tokens_per_sec: f64,
    /// Model FLOPs utilisation at `tokens_per_sec`: (6N + 12·L·T·d) · tokens/s / peak.
    pub mfu: f64,
    /// f16 dynamic loss scale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Memory in use on the device, where the backend reports it (the heap on the CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Wall time of the run so far, across resumes.
    pub elapsed_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Loss on the fixed training evaluation batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_train_loss: Option<f64>,
    /// Fine-tuning runs: epochs of the training examples drawn so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<f64>,
    /// Data-parallel runs: milliseconds per step spent in communication (gradient reduction,
    /// parameter gathering), averaged like `step_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_ms: Option<f64>,
    /// Data-parallel runs: milliseconds per step this rank (0) waited for the others to finish
    /// their micro-batches (load imbalance, a slow or stalled rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<f64>,
    /// The evaluation at which the val loss first reached `train.target_val_loss` (the run stops
    /// there): the wall time at its end, evaluation included, the run's time to target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_reached_s: Option<f64>,
    /// A mixture of experts: each layer's load, the fraction of its token-expert pairs each
    /// expert received this step (the layers with experts, in order: after DeepSeek's leading dense
    /// layers, entry 0 is the first sparse layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<Vec<Vec<f64>>>,
    /// The objective's own metrics. Preference tuning: TRL's metrics of the step's pairs
    /// (`rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`,
    /// `logps/chosen`, `logps/rejected`) and, at evaluations, of the held-out pairs (the same names
    /// after `val_`). A mixture of experts: `aux_loss` (the load-balancing loss, unweighted),
    /// `z_loss`, each layer's `expert_load_max_over_mean/layer{l}` (the most loaded expert's share
    /// over the mean share: 1 is even, `E` all on one) and the largest, `expert_load_max_over_mean`.
    #[serde(flatten, default)]
    pub named: std::collections::BTreeMap<String, f64>,
}

/// `metrics.jsonl`.
pub(crate) struct MetricsLog {
    log: AppendLog,
}

impl MetricsLog {
    /// Opens `run_dir/metrics.jsonl` for appending, first dropping records after `keep_through_step`
    /// (records a stopped run wrote after its last checkpoint; the resumed run writes them again).
    pub(crate) fn open(run_dir: &Path, keep_through_step: Option<usize>) -> Result<Self, TrainError> {
        // By `step` alone: the step-0 evaluation is kept too.
        #[derive(Deserialize)]
        struct Step {
            step: usize,
        }
        let log = AppendLog::open(&run_dir.join(METRICS_FILE), keep_through_step, |line| {
            serde_json::from_str::<Step>(line).ok().map(|r| r.step)
        })?;
        Ok(Self { log })
    }

    pub(crate) fn write(&mut self, record: &StepRecord) -> Result<(), TrainError> {
        self.log.write_line(&serde_json::to_string(record).expect("record serialises"))
    }
}

fn read_lines(path: &Path) -> Result<Vec<String>, TrainError> {
    let f = File::open(path).map_err(TrainError::io(path))?;
    BufReader::new(f).lines().collect::<Result<_, _>>().map_err(TrainError::io(path))
}

/// Reads every well-formed step record of a metrics log (a half-written last line is skipped, and
/// so is the step-0 evaluation, an [`InitialEvalRecord`]).
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
            clipped: false,
            step_ms: 3.0,
            tokens_per_sec: 10.0,
            mfu: 0.1,
            loss_scale: None,
            memory_bytes: None,
            elapsed_s: 1.0,
            val_loss: step.is_multiple_of(2).then_some(2.0),
            eval_train_loss: None,
            epoch: None,
            comm_ms: None,
            wait_ms: None,
            target_reached_s: None,
            expert_load: None,
            named: Default::default(),
        }
    }

    #[test]
    fn reopening_for_a_resume_drops_later_records() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = JsonlSink::open(dir.path(), None).unwrap();
        sink.initial(&InitialEvalRecord {
            step: 0,
            elapsed_s: 0.5,
            val_loss: 3.0,
            epoch: None,
            named: Default::default(),
        })
        .unwrap();
        drop(sink);
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
        // The step-0 evaluation survives the resume, first, without a step's fields.
        assert_eq!(text.lines().next().unwrap(), r#"{"step":0,"elapsed_s":0.5,"val_loss":3.0}"#);
        assert!(!text.lines().nth(1).unwrap().contains("\"val_loss\":2.0"));
        assert!(text.lines().nth(2).unwrap().contains("\"val_loss\":2.0"));
    }
}
