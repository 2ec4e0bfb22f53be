//! The recorder's timekeeping: the run's wall time across resumes, and the speed of its steps.

use std::time::{Duration, Instant};

use crate::step::StepOutput;

/// Wall time of a run across resumes: `before` seconds of earlier invocations, then this one's.
pub(super) struct Clock {
    started: Instant,
    before: f64,
}

impl Clock {
    /// Starts now, after `before` seconds of earlier invocations.
    pub(super) fn after(before: f64) -> Self {
        Self { started: Instant::now(), before }
    }

    pub(super) fn elapsed_s(&self) -> f64 {
        self.before + self.started.elapsed().as_secs_f64()
    }
}

/// Time and tokens of training steps (evaluation and checkpoints excluded): since the last record,
/// and over this invocation.
#[derive(Default)]
pub(super) struct Throughput {
    window: (Duration, usize),
    total: (Duration, usize),
    /// Communication and waiting time since the last record.
    pub(super) window_comm: Duration,
    pub(super) window_wait: Duration,
}

impl Throughput {
    pub(super) fn add(&mut self, dt: Duration, tokens: usize, out: &StepOutput) {
        self.window = (self.window.0 + dt, self.window.1 + tokens);
        self.total = (self.total.0 + dt, self.total.1 + tokens);
        self.window_comm += out.comm;
        self.window_wait += out.wait;
    }

    /// Milliseconds per step of `d`, averaged over the window's steps.
    pub(super) fn per_step_ms(&self, d: Duration, tokens_per_step: usize) -> f64 {
        d.as_secs_f64() * 1e3 / (self.window.1 / tokens_per_step).max(1) as f64
    }

    pub(super) fn window_rate(&self) -> f64 {
        self.window.1 as f64 / self.window.0.as_secs_f64().max(1e-9)
    }

    pub(super) fn window_ms_per_step(&self, tokens_per_step: usize) -> f64 {
        self.per_step_ms(self.window.0, tokens_per_step)
    }

    pub(super) fn reset_window(&mut self) {
        self.window = (Duration::ZERO, 0);
        self.window_comm = Duration::ZERO;
        self.window_wait = Duration::ZERO;
    }

    pub(super) fn total_rate(&self) -> f64 {
        self.total.1 as f64 / self.total.0.as_secs_f64().max(1e-9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(comm_ms: u64, wait_ms: u64) -> StepOutput {
        StepOutput {
            loss: 1.0,
            grad_norm: 1.0,
            skipped: false,
            comm: Duration::from_millis(comm_ms),
            wait: Duration::from_millis(wait_ms),
            sums: Vec::new(),
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn the_window_restarts_at_each_record_and_the_total_does_not() {
        let mut t = Throughput::default();
        // Two steps of 100 tokens, 0.5 s each.
        t.add(Duration::from_millis(500), 100, &out(10, 2));
        t.add(Duration::from_millis(500), 100, &out(30, 4));
        assert!(close(t.window_rate(), 200.0));
        assert!(close(t.window_ms_per_step(100), 500.0));
        assert!(close(t.per_step_ms(t.window_comm, 100), 20.0));
        assert!(close(t.per_step_ms(t.window_wait, 100), 3.0));
        t.reset_window();
        t.add(Duration::from_millis(250), 100, &out(0, 0));
        assert!(close(t.window_rate(), 400.0));
        assert_eq!(t.window_comm, Duration::ZERO);
        assert!(close(t.total_rate(), 300.0 / 1.25));
    }
}
