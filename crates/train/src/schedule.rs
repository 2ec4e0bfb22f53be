//! Learning rate: linear warmup, cosine decay to a floor, then the floor (nanoGPT's `get_lr`).

use crate::config::TrainConfig;

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub decay_steps: usize,
}

impl LrSchedule {
    pub fn from_config(c: &TrainConfig) -> Self {
        Self {
            lr: c.schedule.lr,
            min_lr: c.schedule.min_lr,
            warmup_steps: c.schedule.warmup_steps,
            decay_steps: c.decay_steps(),
        }
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            // (step + 1) / (warmup + 1): never 0, reaches lr just after warmup.
            return self.lr * (step + 1) as f64 / (self.warmup_steps + 1) as f64;
        }
        if step >= self.decay_steps {
            return self.min_lr;
        }
        let progress = (step - self.warmup_steps) as f64 / (self.decay_steps - self.warmup_steps).max(1) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_cosine_floor() {
        let s = LrSchedule { lr: 1e-3, min_lr: 1e-4, warmup_steps: 100, decay_steps: 2000 };
        assert!((s.lr(0) - 1e-3 / 101.0).abs() < 1e-15);
        assert!((s.lr(99) - 1e-3 * 100.0 / 101.0).abs() < 1e-15);
        assert!((s.lr(100) - 1e-3).abs() < 1e-15);
        assert!((s.lr(1050) - 5.5e-4).abs() < 1e-12); // halfway: (lr + min_lr) / 2
        assert!((s.lr(2000) - 1e-4).abs() < 1e-15);
        assert_eq!(s.lr(5000), 1e-4);
        // Monotone decay after warmup.
        assert!((100..2000).all(|i| s.lr(i + 1) <= s.lr(i)));
    }
}
