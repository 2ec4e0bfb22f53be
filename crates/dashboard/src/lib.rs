//! `ember dashboard`: a TensorBoard-style page over run directories. It reads what training writes
//! (`metrics.jsonl`, `samples.jsonl`, `config.toml`) and never imports the trainer or writes to a run.

mod columns;
pub mod confine;
pub mod runs;
pub mod server;

pub use columns::{Columns, MetricsJson};
pub use ember_http::{Idle, Limits};
pub use runs::{RunError, RunStore, RunSummary};
pub use server::{start, Dashboard, Options, ServeError};

/// `ember bench dashboard`: how long a log directory of many long runs takes to load.
pub mod bench {
    use std::io::Write;
    use std::path::Path;
    use std::time::Instant;

    use serde::Serialize;

    use crate::runs::RunStore;

    #[derive(Debug, Clone, Serialize)]
    pub struct LoadBench {
        pub runs: usize,
        pub steps: usize,
        pub bytes: u64,
        /// Discovering every run and reading all its metrics (the run list's first request).
        pub load_ms: f64,
        /// Serialising one run's full metrics as the page receives them.
        pub one_run_json_ms: f64,
        /// A second run-list request once everything is read (the 2-second poll).
        pub refresh_ms: f64,
    }

    impl std::fmt::Display for LoadBench {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "{} runs × {} steps ({:.0} MB of metrics.jsonl): loaded in {:.0} ms, one run's metrics as JSON in {:.1} ms, a refresh in {:.1} ms",
                self.runs,
                self.steps,
                self.bytes as f64 / 1e6,
                self.load_ms,
                self.one_run_json_ms,
                self.refresh_ms
            )
        }
    }

    /// Writes `runs` runs of `steps` records each (the fields training writes) under `dir`, then times
    /// loading them.
    pub fn load(dir: &Path, runs: usize, steps: usize) -> std::io::Result<LoadBench> {
        let mut bytes = 0;
        for r in 0..runs {
            let run = dir.join(format!("run-{r:03}"));
            std::fs::create_dir_all(&run)?;
            let mut out = std::io::BufWriter::new(std::fs::File::create(run.join("metrics.jsonl"))?);
            for s in 1..=steps {
                let loss = 4.0 * (-(s as f64) / 3000.0).exp() + 1.0 + (r as f64) * 1e-3;
                let val = if s % 250 == 0 {
                    format!(",\"val_loss\":{:.6},\"eval_train_loss\":{:.6}", loss + 0.1, loss)
                } else {
                    String::new()
                };
                let line = format!(
                    "{{\"step\":{s},\"train_loss\":{loss:.6},\"lr\":0.001,\"grad_norm\":0.8123,\"clipped\":false,\"step_ms\":143.2,\"tokens_per_sec\":5362.1,\"mfu\":0.1935,\"memory_bytes\":17539183,\"elapsed_s\":{:.3}{val}}}\n",
                    s as f64 * 0.143
                );
                bytes += line.len() as u64;
                out.write_all(line.as_bytes())?;
            }
        }
        let start = Instant::now();
        let store = RunStore::new(dir).map_err(|e| std::io::Error::other(e.to_string()))?;
        let summaries = store.summaries();
        let load_ms = start.elapsed().as_secs_f64() * 1e3;
        assert_eq!(summaries.len(), runs);
        let start = Instant::now();
        let m = store.metrics("run-000", 0).map_err(|e| std::io::Error::other(e.to_string()))?;
        let json = serde_json::to_string(&m).expect("json");
        let one_run_json_ms = start.elapsed().as_secs_f64() * 1e3;
        assert!(json.len() > steps);
        let start = Instant::now();
        store.summaries();
        let refresh_ms = start.elapsed().as_secs_f64() * 1e3;
        Ok(LoadBench { runs, steps, bytes, load_ms, one_run_json_ms, refresh_ms })
    }
}
