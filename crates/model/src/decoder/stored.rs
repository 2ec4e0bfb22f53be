//! A model whose weights stay in a GGUF file's block-quantized types: the projections and tables
//! it keeps so ([`Decoder::empty_keeping`]), the weights it refuses to keep, and the rows of a
//! stored embedding table.

use std::collections::BTreeMap;

use burn::tensor::{backend::Backend, Int, Tensor, TensorData};
use ember_kernels::{EmberBackend, QuantWeight};

use super::Decoder;
use crate::block::Block;
use crate::config::ModelConfig;
use crate::init::Init;
use crate::kinds::ConfigError;
use crate::lora::Target;

impl<B: EmberBackend> Decoder<B> {
    /// [`Self::empty`] with the projections named by path (`layers.{i}.self_attn.q_proj`, …), the
    /// embedding table (`embed_tokens`) and the head (`lm_head`) kept in a block-quantized storage
    /// type, frozen ([`crate::Weight::Stored`]): each layer's are replaced as it is built, so that
    /// their f32 weights never exist together, and the tables are never f32 at all.
    pub fn empty_keeping(
        config: &ModelConfig,
        device: &B::Device,
        weights: Vec<(String, QuantWeight)>,
    ) -> Result<Self, KeepError> {
        let mut by_layer: BTreeMap<usize, Vec<(String, QuantWeight)>> = BTreeMap::new();
        let (mut embed, mut head) = (None, None);
        for (path, weight) in weights {
            match path.as_str() {
                "embed_tokens" => {
                    embed = Some(weight);
                    continue;
                }
                "lm_head" => {
                    head = Some(weight);
                    continue;
                }
                _ => {}
            }
            let layer = match path.split('.').collect::<Vec<_>>().as_slice() {
                ["layers", l, .., _] => l.parse::<usize>().ok(),
                _ => None,
            };
            let Some(layer) = layer.filter(|l| *l < config.n_layers) else {
                return Err(KeepError::NotAProjection(path));
            };
            by_layer.entry(layer).or_default().push((path, weight));
        }
        // Reported after the config's and the blocks' faults, as they are found in that order.
        let tables = table_fault(config, embed.as_ref(), head.as_ref());
        let mut failed = None;
        let model = Self::build_with(config, Init::zeros(), device, [embed, head], |l, mut block| {
            for (path, weight) in by_layer.remove(&l).unwrap_or_default() {
                if let Err(e) = keep_quantized(&mut block, &path, weight) {
                    failed.get_or_insert(e);
                }
            }
            block
        })?;
        let model = failed.map_or(Ok(model), Err)?;
        tables.map_or(Ok(model), Err)
    }

    /// (projections kept quantized, their bytes).
    pub fn quantized_projections(&self) -> (usize, usize) {
        let kept = self.layers.iter().flat_map(|layer| Target::ALL.into_iter().filter_map(|t| layer.projection(t)));
        kept.filter_map(|lin| lin.weight.stored()).fold((0, 0), |(n, b), q| (n + 1, b + q.stored_bytes()))
    }
}

/// A quantized weight a model cannot keep.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KeepError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("`{0}` is not a projection of this model")]
    NotAProjection(String),
    #[error(
        "`{path}`: a {kind} weight of {} × {} for a projection of {} × {}",
        stored.0,
        stored.1,
        projection.0,
        projection.1
    )]
    Shape { path: String, kind: String, stored: (usize, usize), projection: (usize, usize) },
}

impl KeepError {
    /// `weight`, stored at `path`, is not `(in, out)` of the projection it would be.
    fn shape(path: &str, weight: &QuantWeight, projection: (usize, usize)) -> Self {
        let stored = (weight.d_in(), weight.d_out());
        Self::Shape { path: path.into(), kind: weight.kind().to_string(), stored, projection }
    }
}

/// Why a model of `config` cannot keep the stored embedding table `embed` (`V` rows of `D`) or
/// head `head` (`D` inputs to `V` outputs; none when the head is tied), if it cannot.
fn table_fault(config: &ModelConfig, embed: Option<&QuantWeight>, head: Option<&QuantWeight>) -> Option<KeepError> {
    let (v, d) = (config.vocab_size, config.d_model);
    if let Some(weight) = embed.filter(|w| (w.d_out(), w.d_in()) != (v, d)) {
        return Some(KeepError::shape("embed_tokens", weight, (d, v)));
    }
    match head {
        Some(_) if config.tie_embeddings => Some(KeepError::NotAProjection("lm_head".into())),
        Some(weight) if (weight.d_in(), weight.d_out()) != (d, v) => Some(KeepError::shape("lm_head", weight, (d, v))),
        _ => None,
    }
}

/// The projection of `block` that `path` names (its last part), kept as `weight`.
fn keep_quantized<B: Backend>(block: &mut Block<B>, path: &str, weight: QuantWeight) -> Result<(), KeepError> {
    let target = path.rsplit('.').next().and_then(|name| Target::ALL.into_iter().find(|t| t.name() == name));
    let Some(lin) = target.and_then(|t| block.projection_mut(t)) else {
        return Err(KeepError::NotAProjection(path.to_string()));
    };
    if (lin.d_in(), lin.d_out()) != (weight.d_in(), weight.d_out()) {
        return Err(KeepError::shape(path, &weight, (lin.d_in(), lin.d_out())));
    }
    *lin = lin.clone().with_quantized(weight);
    Ok(())
}

/// Rows `tokens` of a table kept quantized, decoded: `[B, T]` -> `[B, T, D]` in f32.
pub(super) fn gather_rows<B: Backend>(table: &QuantWeight, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let [b, t] = tokens.dims();
    let (d, device) = (table.d_in(), tokens.device());
    let ids = tokens.into_data();
    let mut out = vec![0f32; b * t * d];
    for (id, row) in ids.iter::<i64>().zip(out.chunks_exact_mut(d.max(1))) {
        // Ids past the table are refused before a model runs (`check_prompts`, the server's
        // checks); a stray one reads row 0 rather than panicking here.
        let id = usize::try_from(id).ok().filter(|&i| i < table.d_out()).unwrap_or(0);
        table.decode_tile(id..id + 1, 0..d, row);
    }
    Tensor::from_data(TensorData::new(out, [b, t, d]), &device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tiny_config;
    use crate::linear::{f32_blocks, Weight};
    use crate::lora::LoraConfig;
    use crate::TestBackend;
    use burn::tensor::{Distribution, Tolerance};

    type B = TestBackend;

    /// `weight` (`[in, out]`, or a table's `[V, D]` with `table`) as stored blocks.
    fn blocks(weight: &Weight<B>, table: bool) -> QuantWeight {
        let w = weight.val();
        let w = if table { w } else { w.transpose() }; // stored rows: the outputs (a table's rows)
        let [rows, cols] = w.dims();
        f32_blocks(rows, cols, &w.into_data().to_vec::<f32>().unwrap())
    }

    #[test]
    fn a_model_keeping_stored_weights_computes_as_the_dense_one_and_merges_back_to_it() {
        let dev = Default::default();
        let config = ModelConfig { init_std: 0.2, ..tiny_config() };
        let dense = Decoder::<B>::new(&config, 3, &dev).unwrap();
        let q = dense.layers[1].projection(Target::QProj).unwrap();
        let kept = vec![
            ("embed_tokens".to_string(), blocks(&dense.embed_tokens, true)),
            ("layers.1.self_attn.q_proj".to_string(), blocks(&q.weight, false)),
            ("lm_head".to_string(), blocks(&dense.lm_head.as_ref().unwrap().weight, false)),
        ];
        let empty = Decoder::<B>::empty_keeping(&config, &dev, kept).unwrap();
        // The rest of the weights loaded by name: a stored weight has no tensor to load.
        let rest = crate::weights::named_tensors_where::<B, _, _>(&dense, |_| true).into_iter().collect();
        let stored = crate::weights::assign::<B, _>(empty, rest, "dense", true).unwrap();
        assert_eq!(stored.quantized_projections(), (1, 32 * 32 * 4));
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(vec![1i32, 5, 9, 2, 7], [1, 5]), &dev);
        let want = dense.forward(ids.clone());
        stored
            .forward(ids.clone())
            .into_data()
            .assert_approx_eq::<f32>(&want.clone().into_data(), Tolerance::absolute(1e-5));
        // With adapters (B non-zero), merging dequantizes the stored weights: plain f32 weights that
        // compute as the adapted model does.
        let lora = LoraConfig { rank: 2, alpha: 4.0, dropout: 0.0, targets: vec![Target::QProj] };
        let mut adapted = stored.with_lora(&lora, 1);
        for layer in adapted.layers.iter_mut() {
            let l = layer.projection_mut(Target::QProj).unwrap().lora.as_mut().unwrap();
            l.lora_b = burn::module::Param::from_tensor(Tensor::random([2, 32], Distribution::Normal(0.0, 0.3), &dev));
        }
        let with_adapters = adapted.forward(ids.clone());
        let merged = adapted.merge_lora();
        assert_eq!(merged.quantized_projections(), (0, 0));
        assert!(matches!(merged.embed_tokens, Weight::Dense(_)) && !merged.has_lora());
        let got = merged.forward(ids);
        got.into_data().assert_approx_eq::<f32>(&with_adapters.into_data(), Tolerance::absolute(1e-4));
    }

    #[test]
    fn weights_a_model_cannot_keep_are_refused_by_name() {
        let dev = Default::default();
        let config = tiny_config();
        let keep = |path: &str, rows, cols| {
            let weights = vec![(path.to_string(), f32_blocks(rows, cols, &vec![0.0; rows * cols]))];
            Decoder::<B>::empty_keeping(&config, &dev, weights).map(|_| ()).unwrap_err().to_string()
        };
        assert_eq!(keep("embed_tokens", 37, 16), "`embed_tokens`: a f32 weight of 16 × 37 for a projection of 32 × 37");
        assert_eq!(keep("lm_head", 32, 32), "`lm_head`: a f32 weight of 32 × 32 for a projection of 32 × 37");
        assert_eq!(
            keep("layers.0.self_attn.q_norm", 32, 32),
            "`layers.0.self_attn.q_norm` is not a projection of this model"
        );
        let tied = ModelConfig { tie_embeddings: true, ..config.clone() };
        let weights = vec![("lm_head".to_string(), f32_blocks(37, 32, &[0.0; 37 * 32]))];
        let e = Decoder::<B>::empty_keeping(&tied, &dev, weights).map(|_| ()).unwrap_err();
        assert_eq!(e, KeepError::NotAProjection("lm_head".into()));
    }
}
