//! Learning rate: linear warmup, then either a cosine decay to a floor (nanoGPT's `get_lr`) or
//! warmup-stable-decay (the rate held, then a linear cool-down to the floor over the last part of
//! the decay steps: the modded-nanogpt speedrun's), then the floor.

use crate::config::{ScheduleShape, TrainConfig};

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub decay_steps: usize,
    /// Checkpoints from before the key have the cosine.
    #[serde(default)]
    pub shape: ScheduleShape,
    /// Warmup-stable-decay: the fraction of `decay_steps` the cool-down takes.
    #[serde(default)]
    pub cooldown_frac: f64,
}

impl LrSchedule {
    pub(crate) fn from_config(c: &TrainConfig) -> Self {
        Self {
            lr: c.schedule.lr,
            min_lr: c.schedule.min_lr,
            warmup_steps: c.schedule.warmup_steps,
            decay_steps: c.decay_steps(),
            shape: c.schedule.shape,
            cooldown_frac: c.schedule.cooldown_frac,
        }
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub(crate) fn lr(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            // (step + 1) / (warmup + 1): never 0, reaches lr just after warmup.
            return self.lr * (step + 1) as f64 / (self.warmup_steps + 1) as f64;
        }
        if step >= self.decay_steps {
            return self.min_lr;
        }
        if self.shape == ScheduleShape::Wsd {
            // The cool-down's steps end at `decay_steps`, where the rate reaches the floor.
            let cooldown = ((self.decay_steps as f64 * self.cooldown_frac).round() as usize).max(1);
            let start = self.decay_steps.saturating_sub(cooldown).max(self.warmup_steps);
            if step < start {
                return self.lr;
            }
            let left = (self.decay_steps - step) as f64 / (self.decay_steps - start).max(1) as f64;
            return self.min_lr + left * (self.lr - self.min_lr);
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
        let s = LrSchedule {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 100,
            decay_steps: 2000,
            shape: ScheduleShape::Cosine,
            cooldown_frac: 0.0,
        };
        assert!((s.lr(0) - 1e-3 / 101.0).abs() < 1e-15);
        assert!((s.lr(99) - 1e-3 * 100.0 / 101.0).abs() < 1e-15);
        assert!((s.lr(100) - 1e-3).abs() < 1e-15);
        assert!((s.lr(1050) - 5.5e-4).abs() < 1e-12); // halfway: (lr + min_lr) / 2
        assert!((s.lr(2000) - 1e-4).abs() < 1e-15);
        assert_eq!(s.lr(5000), 1e-4);
        // Monotone decay after warmup.
        assert!((100..2000).all(|i| s.lr(i + 1) <= s.lr(i)));
    }

    #[test]
    fn warmup_stable_then_linear_cooldown() {
        let s = LrSchedule {
            lr: 1e-3,
            min_lr: 0.0,
            warmup_steps: 100,
            decay_steps: 1000,
            shape: ScheduleShape::Wsd,
            cooldown_frac: 0.4,
        };
        assert!((s.lr(99) - 1e-3 * 100.0 / 101.0).abs() < 1e-15); // the warmup is the cosine's
        assert_eq!((s.lr(100), s.lr(599), s.lr(600)), (1e-3, 1e-3, 1e-3)); // stable to the cool-down
        assert!((s.lr(800) - 5e-4).abs() < 1e-15); // halfway down
        assert!((s.lr(999) - 1e-3 / 400.0).abs() < 1e-15);
        assert_eq!((s.lr(1000), s.lr(5000)), (0.0, 0.0));
        assert!((0..2000).all(|i| i < 100 || s.lr(i + 1) <= s.lr(i)));
        // Old checkpoints (no shape) read as the cosine.
        let old: LrSchedule =
            serde_json::from_str(r#"{"lr":0.001,"min_lr":0.0001,"warmup_steps":100,"decay_steps":2000}"#).unwrap();
        assert_eq!((old.shape, old.lr(1050)), (ScheduleShape::Cosine, 5.5e-4 + 0.0));
    }
}
