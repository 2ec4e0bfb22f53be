//! What the TRL parity tests share (tests/preference.rs, tests/rl.rs): every parameter's gradient
//! of a loss against the fixture's, in Hugging Face's layout.

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use ember_model::weights::{map_paths, PathMapper};
use ember_model::Decoder;
use serde_json::Value;

pub type AD = Autodiff<Flex>;

/// Every parameter replaced by its gradient.
struct ToGrad<'a>(&'a <AD as AutodiffBackend>::Gradients);
impl PathMapper<AD> for ToGrad<'_> {
    fn map<const D: usize>(&mut self, path: &str, p: Param<Tensor<AD, D>>) -> Param<Tensor<AD, D>> {
        let g = p.val().grad(self.0).unwrap_or_else(|| panic!("{path} has no gradient"));
        Param::from_tensor(Tensor::from_inner(g))
    }
}

/// `|got − want| ≤ rel · max(|want|, floor)`.
pub fn close(got: f64, want: f64, rel: f64, floor: f64) -> bool {
    (got - want).abs() <= rel * want.abs().max(floor)
}

/// The gradients of `loss` with respect to `policy`'s parameters against `want` (by Hugging Face
/// name: `sum_sq`, and `values` at `index`): each sum of squares within `sum_sq_rel`, each element
/// within `element_rel` of the larger of itself and the gradient's RMS. Every parameter of `want`
/// is checked.
pub fn assert_gradients(
    policy: Decoder<AD>,
    loss: Tensor<AD, 1>,
    want: &Value,
    sum_sq_rel: f64,
    element_rel: f64,
    name: &str,
) {
    let grads = loss.backward();
    let grads = map_paths(policy, &mut ToGrad(&grads)).valid();
    let mut checked = 0;
    let llama = ember_hf::families::llama::LLAMA.architecture();
    for (hf_name, data) in ember_hf::weights::hf_tensors(&grads, llama).unwrap() {
        let g: Vec<f32> = data.to_vec().unwrap();
        let w = &want[&hf_name];
        let sum_sq: f64 = g.iter().map(|&x| (x as f64).powi(2)).sum();
        let trl_sq = w["sum_sq"].as_f64().unwrap();
        assert!(
            close(sum_sq, trl_sq, sum_sq_rel, 1e-12),
            "{name}: {hf_name} sum of squares {sum_sq} vs TRL's {trl_sq}"
        );
        let scale = trl_sq.sqrt() / (g.len() as f64).sqrt();
        for (i, v) in w["index"].as_array().unwrap().iter().zip(w["values"].as_array().unwrap()) {
            let (got, trl) = (g[i.as_u64().unwrap() as usize] as f64, v.as_f64().unwrap());
            assert!(
                (got - trl).abs() <= element_rel * trl.abs().max(scale),
                "{name}: {hf_name}[{i}] {got} vs TRL's {trl}"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, want.as_object().unwrap().len(), "{name}: parameters checked");
}
