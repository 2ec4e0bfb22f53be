//! What the trainer reads off the routing: the auxiliary losses and the experts' load.

use burn::tensor::{backend::Backend, Tensor, TensorData};

use super::Route;

/// The load-balancing loss over every layer's routing, as Hugging Face's
/// `load_balancing_loss_func` computes it over the layers' router logits concatenated:
/// `E · Σₑ fₑ·Pₑ`, `fₑ` the pairs expert `e` received over all layers' `L·N` tokens (a fraction
/// per top-k slot, summed over the slots) and `Pₑ` its mean router probability. `fₑ` is a count, so
/// the gradient flows through `Pₑ` alone. `None` without routing.
pub fn load_balancing_loss<B: Backend>(routes: &[Route<B>]) -> Option<Tensor<B, 1>> {
    let first = routes.first()?;
    let e = first.counts.len();
    let tokens: usize = routes.iter().map(|r| r.tokens).sum();
    let mut counts = vec![0f64; e];
    for r in routes {
        for (c, &n) in counts.iter_mut().zip(&r.counts) {
            *c += n as f64;
        }
    }
    let scale = e as f64 / (tokens as f64 * tokens as f64);
    let weights: Vec<f32> = counts.iter().map(|&c| (c * scale) as f32).collect();
    let weights = Tensor::<B, 1>::from_data(TensorData::new(weights, [e]), &first.prob_sum.device());
    let probs = routes.iter().map(|r| r.prob_sum.clone()).reduce(|a, b| a + b)?;
    Some((probs * weights).sum())
}

/// The router z-loss over every layer's routing: the mean over the layers' tokens of the squared
/// log-sum-exp of the router logits. `None` without routing.
pub fn router_z_loss<B: Backend>(routes: &[Route<B>]) -> Option<Tensor<B, 1>> {
    let tokens: usize = routes.iter().map(|r| r.tokens).sum();
    let sum = routes.iter().map(|r| r.z_sum.clone()).reduce(|a, b| a + b)?;
    Some(sum.div_scalar(tokens.max(1) as f64))
}

/// Each layer's expert load: the fraction of its token-expert pairs each expert received.
pub fn expert_load<B: Backend>(routes: &[Route<B>]) -> Vec<Vec<f64>> {
    routes
        .iter()
        .map(|r| {
            let total = r.counts.iter().map(|&c| c as f64).sum::<f64>().max(1.0);
            r.counts.iter().map(|&c| c as f64 / total).collect()
        })
        .collect()
}
