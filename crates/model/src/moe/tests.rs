use super::*;
use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::sigmoid as sigmoid_fn;
use burn::tensor::{Distribution, Tolerance};

type AB = Autodiff<Flex>;

fn part(shared: bool, norm_topk: bool) -> Moe<AB> {
    let moe = MoeConfig {
        n_experts: 5,
        top_k: 2,
        d_expert: 6,
        norm_topk,
        shared_expert: shared.then_some(7),
        shared_expert_gate: shared,
        aux_loss_coef: 0.01,
        z_loss_coef: 0.0,
        ..Default::default()
    };
    let config = MoePartConfig { d_model: 8, moe, init_std: 0.3, out_std: 0.3 };
    config.validate().unwrap();
    config.init(&mut Init::new(3), &Default::default())
}

#[test]
fn grouped_experts_equal_the_dense_composition_with_every_gradient() {
    for (shared, norm_topk) in [(false, true), (true, false)] {
        let moe = part(shared, norm_topk);
        let x = Tensor::<AB, 2>::random([11, 8], Distribution::Normal(0.0, 1.0), &Default::default());
        let grads = |dense: bool| {
            let x = x.clone().detach().require_grad();
            let (y, route) = if dense {
                moe.forward_dense(x.clone(), Compute::default())
            } else {
                moe.forward(x.clone(), Compute::default())
            };
            let aux = load_balancing_loss(&[route]).unwrap();
            let loss = (y.clone() * y.clone()).sum() + aux;
            let g = loss.backward();
            let take2 = |t: &Tensor<AB, 2>| t.grad(&g).unwrap().into_data();
            let take3 = |p: &Param<Tensor<AB, 3>>| p.val().grad(&g).unwrap().into_data();
            (
                y.into_data(),
                vec![take2(&x), take2(&moe.router.weight.val()), take3(&moe.gate), take3(&moe.up), take3(&moe.down)],
            )
        };
        let (y_dense, g_dense) = grads(true);
        let (y, g) = grads(false);
        y.assert_approx_eq::<f32>(&y_dense, Tolerance::absolute(1e-5));
        for (a, b) in g.iter().zip(&g_dense) {
            a.assert_approx_eq::<f32>(b, Tolerance::absolute(1e-4));
        }
    }
}

/// DeepSeek-V3's router: sigmoid scores, a selection bias, 4 groups of 2 of which the best 2
/// (by the sum of their best two biased scores) may be chosen from, weights renormalised and
/// scaled by 2.5; DeepSeek-V2's: softmax, groups scored by their best expert, not renormalised.
fn deepseek_part(sigmoid: bool) -> Moe<AB> {
    let moe = MoeConfig {
        n_experts: 8,
        top_k: 3,
        d_expert: 6,
        norm_topk: sigmoid,
        shared_expert: Some(5),
        shared_expert_gate: false,
        aux_loss_coef: 0.01,
        z_loss_coef: 0.0,
        scoring: if sigmoid { Scoring::Sigmoid } else { Scoring::Softmax },
        selection_bias: sigmoid,
        groups: Some(4),
        top_groups: Some(2),
        routed_scale: if sigmoid { 2.5 } else { 1.5 },
        dense_layers: 0,
        bias_update_rate: 0.0,
    };
    let config = MoePartConfig { d_model: 8, moe, init_std: 0.5, out_std: 0.3 };
    config.validate().unwrap();
    let mut part: Moe<AB> = config.init(&mut Init::new(4), &Default::default());
    // Not trainable: an optimizer that lays out every trainable parameter (ZeRO's) leaves it out.
    assert!(part.selection_bias.as_ref().is_none_or(|b| !b.val().is_require_grad()));
    if sigmoid {
        let bias = Tensor::random([8], Distribution::Uniform(-0.3, 0.3), &Default::default());
        part.selection_bias = Some(Param::from_tensor(bias));
    }
    part
}

/// The choice written out per token, as transformers' DeepSeek routers make it.
fn deepseek_choice(scores: &[f32], bias: &[f32], sigmoid: bool, k: usize) -> Vec<(usize, f32)> {
    let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let group_score = |g: usize| {
        let mut v = biased[2 * g..2 * g + 2].to_vec();
        v.sort_by(|a, b| b.total_cmp(a));
        if sigmoid {
            v[0] + v[1]
        } else {
            v[0]
        }
    };
    let mut groups: Vec<usize> = (0..4).collect();
    groups.sort_by(|&a, &b| group_score(b).total_cmp(&group_score(a)));
    let mut allowed: Vec<usize> = groups[..2].iter().flat_map(|&g| [2 * g, 2 * g + 1]).collect();
    allowed.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]));
    let chosen = &allowed[..k];
    let sum: f32 = chosen.iter().map(|&j| scores[j]).sum();
    let (norm, scale) = if sigmoid { (sum + 1e-20, 2.5) } else { (1.0, 1.5) };
    chosen.iter().map(|&j| (j, scores[j] / norm * scale)).collect()
}

#[test]
fn deepseek_routing_chooses_and_weighs_as_written_out() {
    for sigmoid in [true, false] {
        let moe = deepseek_part(sigmoid);
        let x = Tensor::<AB, 2>::random([17, 8], Distribution::Normal(0.0, 1.0), &Default::default());
        let logits = moe.router.forward(x.clone(), Compute::default());
        let scores = if sigmoid { sigmoid_fn(logits) } else { softmax(logits, 1) };
        let scores = scores.into_data().to_vec::<f32>().unwrap();
        let bias = match &moe.selection_bias {
            Some(b) => b.val().into_data().to_vec::<f32>().unwrap(),
            None => vec![0.0; 8],
        };
        let choice = moe.choose(x.clone(), Compute::default());
        let weights = choice.weights.into_data().to_vec::<f32>().unwrap();
        for (n, row) in scores.chunks_exact(8).enumerate() {
            let want = deepseek_choice(row, &bias, sigmoid, 3);
            let mut got: Vec<(usize, f32)> = (0..3).map(|i| (choice.experts[3 * n + i], weights[3 * n + i])).collect();
            got.sort_by_key(|&(j, _)| j);
            let mut want = want;
            want.sort_by_key(|&(j, _)| j);
            for ((gj, gw), (wj, ww)) in got.iter().zip(&want) {
                assert_eq!(gj, wj, "token {n}: experts");
                assert!((gw - ww).abs() < 1e-5, "token {n}: weight {gw} vs {ww}");
            }
        }
        // The grouped kernel equals the dense composition for this router too, gradients included.
        let run = |dense: bool| {
            let x = x.clone().detach().require_grad();
            let (y, route) = if dense {
                moe.forward_dense(x.clone(), Compute::default())
            } else {
                moe.forward(x.clone(), Compute::default())
            };
            let loss = (y.clone() * y.clone()).sum() + load_balancing_loss(&[route]).unwrap();
            let g = loss.backward();
            // The selection bias only chooses: no gradient reaches it, so no optimizer moves it.
            assert!(moe.selection_bias.as_ref().is_none_or(|b| b.val().grad(&g).is_none()));
            (y.into_data(), x.grad(&g).unwrap().into_data(), moe.router.weight.val().grad(&g).unwrap().into_data())
        };
        let (a, b) = (run(false), run(true));
        a.0.assert_approx_eq::<f32>(&b.0, Tolerance::absolute(1e-5));
        a.1.assert_approx_eq::<f32>(&b.1, Tolerance::absolute(1e-4));
        a.2.assert_approx_eq::<f32>(&b.2, Tolerance::absolute(1e-4));
    }
}

#[test]
fn adapters_on_the_stacks_equal_the_composition_and_merge_into_the_weights() {
    let mut moe = deepseek_part(true);
    let config = LoraConfig { rank: 2, alpha: 6.0, dropout: 0.0, targets: Vec::new() };
    let mut init = Init::new(9);
    let dev = Default::default();
    let mut stack = |shape: [usize; 3]| {
        let mut l = StackLora::<AB>::new(&mut init, shape, &config, &dev);
        let b = Tensor::random([shape[0], 2, shape[2]], Distribution::Normal(0.0, 0.5), &dev);
        l.lora_b = Param::from_tensor(b); // B non-zero: the adapters change the part
        l
    };
    // Adapters on the gate and down stacks, none on the up one.
    moe.lora = Some(ExpertsLora { gate: Some(stack([8, 8, 6])), up: None, down: Some(stack([8, 6, 8])) });
    assert!(moe.has_lora());
    let x = Tensor::<AB, 2>::random([13, 8], Distribution::Normal(0.0, 1.0), &dev);
    let run = |dense: bool| {
        let x = x.clone().detach().require_grad();
        let (y, _) = if dense {
            moe.forward_dense(x.clone(), Compute::default())
        } else {
            moe.forward(x.clone(), Compute::default())
        };
        let g = (y.clone() * y.clone()).sum().backward();
        let lora = moe.lora.as_ref().unwrap();
        let take = |p: &Param<Tensor<AB, 3>>| p.val().grad(&g).unwrap().into_data();
        let (gate, down) = (lora.gate.as_ref().unwrap(), lora.down.as_ref().unwrap());
        (y.into_data(), vec![take(&gate.lora_a), take(&gate.lora_b), take(&down.lora_a), take(&down.lora_b)])
    };
    let ((y, g), (y_ref, g_ref)) = (run(false), run(true));
    y.assert_approx_eq::<f32>(&y_ref, Tolerance::absolute(1e-5));
    for (a, b) in g.iter().zip(&g_ref) {
        // Relative to the tensor's largest gradient (they reach the hundreds): f32 sums in
        // another order.
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 1e-5 * scale, "adapter gradient {diff} off (up to {scale})");
    }
    let merged = moe.clone().merge_lora();
    assert!(!merged.has_lora());
    let (a, _) = merged.forward(x.clone(), Compute::default());
    let (b, _) = moe.forward(x, Compute::default());
    a.into_data().assert_approx_eq::<f32>(&b.into_data(), Tolerance::absolute(1e-5));
}

#[test]
fn the_selection_bias_moves_towards_an_even_load() {
    let mut moe = deepseek_part(true);
    let bias = |m: &Moe<AB>| m.selection_bias.as_ref().unwrap().val().into_data().to_vec::<f32>().unwrap();
    let before = bias(&moe);
    moe.balance_selection_bias(&[0.5, 0.125, 0.0, 0.125, 0.125, 0.125, 0.0, 0.125], 0.01);
    let moved: Vec<f32> = bias(&moe).iter().zip(&before).map(|(a, b)| ((a - b) * 1000.0).round() / 1000.0).collect();
    assert_eq!(moved, [-0.01, 0.0, 0.01, 0.0, 0.0, 0.0, 0.01, 0.0]);
}

#[test]
fn routing_counts_and_the_balancing_loss_follow_the_choice() {
    let moe = part(false, true);
    let x = Tensor::<AB, 2>::random([13, 8], Distribution::Normal(0.0, 1.0), &Default::default());
    let (_, route) = moe.forward(x, Compute::default());
    assert_eq!(route.counts.iter().sum::<u32>(), 26, "two experts a token, none dropped");
    assert_eq!(route.tokens, 13);
    // A perfectly even router (every probability 1/E) scores k: E · Σ (count/N) · (1/E).
    let even = Route::<AB> {
        prob_sum: Tensor::full([5], 13.0 / 5.0, &Default::default()),
        z_sum: Tensor::zeros([1], &Default::default()),
        counts: route.counts.clone(),
        tokens: 13,
    };
    let aux: f32 = load_balancing_loss(&[even.clone(), even]).unwrap().into_scalar();
    assert!((aux - 2.0).abs() < 1e-5, "{aux}");
    let load = expert_load(&[route]);
    assert!((load[0].iter().sum::<f64>() - 1.0).abs() < 1e-12);
}

#[test]
fn bad_configs_name_the_key() {
    let good = part(false, false);
    drop(good);
    let base = MoeConfig {
        n_experts: 4,
        top_k: 2,
        d_expert: 8,
        norm_topk: false,
        shared_expert: None,
        shared_expert_gate: false,
        aux_loss_coef: 0.01,
        z_loss_coef: 0.0,
        ..Default::default()
    };
    let err = |c: MoeConfig| c.validate().unwrap_err().to_string();
    assert!(err(MoeConfig { top_k: 5, ..base.clone() }).contains("moe.top_k"));
    assert!(err(MoeConfig { n_experts: 0, ..base.clone() }).contains("moe.n_experts"));
    assert!(err(MoeConfig { shared_expert_gate: true, ..base.clone() }).contains("moe.shared_expert_gate"));
    assert!(err(MoeConfig { aux_loss_coef: f64::NAN, ..base.clone() }).contains("moe.aux_loss_coef"));
    assert!(err(MoeConfig { d_expert: 1 << 21, ..base.clone() }).contains("moe.d_expert"));
    assert!(err(MoeConfig { shared_expert: Some(1 << 21), ..base.clone() }).contains("moe.shared_expert"));
    assert!(err(MoeConfig { n_experts: 1 << 13, ..base }).contains("moe.n_experts"));
}
