//! Metrics of a task's items, with the standard errors lm-evaluation-harness reports beside them,
//! and the centred aggregate nanochat reports as CORE.

use serde::Serialize;

use crate::task::Output;

/// What one item scored: its continuations' log-likelihoods and greedy flags, the lengths (in
/// characters) of its choices, and the right choice.
#[derive(Debug, Clone, Serialize)]
pub struct ItemScore {
    pub loglikelihoods: Vec<f64>,
    pub greedy: Vec<bool>,
    pub choice_chars: Vec<usize>,
    pub gold: usize,
    /// The per-choice contexts' form (one target after several contexts) has no `acc_norm`.
    pub per_choice_contexts: bool,
    /// A generation task's text, each filter's answer from it, and whether that answer matched.
    pub generated: Option<Generated>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Generated {
    pub text: String,
    pub filtered: Vec<String>,
    pub matched: Vec<bool>,
}

impl ItemScore {
    /// The choice with the largest log-likelihood (the first of equals, as `np.argmax`).
    pub fn prediction(&self) -> usize {
        argmax(self.loglikelihoods.iter().copied())
    }

    /// The choice with the largest log-likelihood per character.
    pub fn prediction_norm(&self) -> usize {
        argmax(self.loglikelihoods.iter().zip(&self.choice_chars).map(|(&ll, &n)| ll / n as f64))
    }
}

fn argmax(values: impl Iterator<Item = f64>) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (i, v) in values.enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0
}

/// A metric's value and its standard error.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    pub value: f64,
    pub stderr: f64,
}

/// The mean of `xs` and its standard error `sqrt(s² / n)`, `s²` the sample variance (the
/// harness's `mean_stderr`).
pub fn mean(xs: &[f64]) -> Estimate {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return Estimate { value: f64::NAN, stderr: f64::NAN };
    }
    let m = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    Estimate { value: m, stderr: (var / n).sqrt() }
}

/// The task's metrics by name, in a fixed order.
pub fn task_metrics(output: Output, items: &[ItemScore]) -> Vec<(&'static str, Estimate)> {
    match output {
        Output::MultipleChoice { norm } => {
            let acc: Vec<f64> = items.iter().map(|i| f64::from(u8::from(i.prediction() == i.gold))).collect();
            let mut out = vec![("acc", mean(&acc))];
            if norm && items.iter().all(|i| !i.per_choice_contexts) {
                let acc_norm: Vec<f64> =
                    items.iter().map(|i| f64::from(u8::from(i.prediction_norm() == i.gold))).collect();
                out.push(("acc_norm", mean(&acc_norm)));
            }
            out
        }
        Output::Generate(g) => g
            .filters
            .iter()
            .enumerate()
            .map(|(f, (name, _))| {
                let hits: Vec<f64> = items
                    .iter()
                    .map(|i| f64::from(u8::from(i.generated.as_ref().is_some_and(|g| g.matched[f]))))
                    .collect();
                (*name, mean(&hits))
            })
            .collect(),
        Output::Loglikelihood => {
            let ll: Vec<f64> = items.iter().map(|i| i.loglikelihoods[0]).collect();
            let acc: Vec<f64> = items.iter().map(|i| f64::from(u8::from(i.greedy[0]))).collect();
            // exp(-mean ll); its standard error by the delta method (the harness bootstraps it).
            let m = mean(&ll);
            let ppl = (-m.value).exp();
            vec![("perplexity", Estimate { value: ppl, stderr: ppl * m.stderr }), ("acc", mean(&acc))]
        }
    }
}

/// nanochat's CORE-style centring: `(accuracy - baseline) / (1 - baseline)`.
pub fn centred(accuracy: f64, baseline: f64) -> f64 {
    (accuracy - baseline) / (1.0 - baseline)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accuracy_and_its_error() {
        let e = mean(&[1.0, 0.0, 1.0, 1.0]);
        assert_eq!(e.value, 0.75);
        assert!((e.stderr - (0.25f64 / 4.0).sqrt()).abs() < 1e-12, "{e:?}"); // s² = 0.25
        let item = ItemScore {
            loglikelihoods: vec![-4.0, -5.0],
            greedy: vec![false, false],
            choice_chars: vec![2, 10],
            gold: 1,
            per_choice_contexts: false,
            generated: None,
        };
        assert_eq!((item.prediction(), item.prediction_norm()), (0, 1));
        let m = task_metrics(Output::MultipleChoice { norm: true }, &[item]);
        assert_eq!((m[0].1.value, m[1].1.value), (0.0, 1.0));
        assert_eq!(centred(0.625, 0.25), 0.5);
    }
}
