//! Parameters by name, and safetensors files of them.
//!
//! A parameter's name is its field path, `layers.0.self_attn.q_proj.weight`, in Burn's layout (linear
//! weights `[in, out]`). Loading checks every name and shape before anything is replaced, and reports
//! what is missing, what is left over and what has the wrong shape.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{backend::Backend, DType, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WeightsError {
    #[error("{source_name}: not a safetensors file: {message}")]
    Format { source_name: String, message: String },
    #[error("{source_name}: tensor `{key}` has dtype {dtype}, expected a float type")]
    Dtype { source_name: String, key: String, dtype: String },
    #[error("{source_name}: missing tensor(s) {}", keys.join(", "))]
    Missing { source_name: String, keys: Vec<String> },
    #[error("{source_name}: unexpected tensor(s) {}", keys.join(", "))]
    Unexpected { source_name: String, keys: Vec<String> },
    #[error("{source_name}: `{key}`: expected shape {expected:?}, found {found:?}")]
    Shape { source_name: String, key: String, expected: Vec<usize>, found: Vec<usize> },
}

/// How many of `data`'s values are NaN or infinite: those whose exponent bits are all set, counted
/// on the stored bytes (f64, f32, bf16 or f16; other dtypes hold none).
pub(crate) fn count_non_finite(data: &TensorData) -> usize {
    let (width, exponent): (usize, u64) = match data.dtype {
        DType::F64 => (8, 0x7ff0_0000_0000_0000),
        DType::F32 => (4, 0x7f80_0000),
        DType::BF16 => (2, 0x7f80),
        DType::F16 => (2, 0x7c00),
        _ => return 0,
    };
    let bits = |c: &[u8]| {
        let mut word = [0u8; 8];
        word[..width].copy_from_slice(c);
        u64::from_le_bytes(word)
    };
    data.as_bytes().chunks_exact(width).filter(|c| bits(c) & exponent == exponent).count()
}

/// Warns when tensor `name` of `source` (a file) holds NaN or infinite values
/// ("blk.3.attn_q.weight: 12 NaN/Inf values of 65536"): an import or a sampling run goes on, but a
/// model of such weights computes NaN. Whether it warned.
pub fn warn_non_finite(source: &str, name: &str, data: &TensorData) -> bool {
    let bad = count_non_finite(data);
    if bad > 0 {
        tracing::warn!("{source}: {name}: {bad} NaN/Inf values of {}", data.num_elements());
    }
    bad > 0
}

/// Checks, before a model of `config` is allocated, that its weights can be what `files` hold
/// (`file_bytes` in all: at least one byte a parameter, as in any float or 8-bit format) and that
/// its f32 parameters fit in the memory the host has left. A config that describes a far bigger
/// model than its files (a damaged or hostile `config.json`) is an error, not an abort.
pub fn check_model_size(config: &crate::ModelConfig, files: &str, file_bytes: u64) -> Result<(), SizeError> {
    config.validate()?;
    let params = config.num_params();
    if params > file_bytes {
        return Err(SizeError::LargerThanFiles { params, files: files.to_string(), file_bytes });
    }
    let need = params.saturating_mul(4);
    match host_available() {
        Some(have) if need > have => Err(SizeError::NoMemory { params, need, have }),
        _ => Ok(()),
    }
}

/// A config whose model cannot be what its files hold, or cannot fit in memory.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SizeError {
    #[error(transparent)]
    Config(#[from] crate::ConfigError),
    #[error(
        "the config describes {params} parameters, but {files} hold only {file_bytes} bytes: the config does not \
         belong to these weights"
    )]
    LargerThanFiles { params: u64, files: String, file_bytes: u64 },
    #[error(
        "a model of {params} parameters needs {:.2} GiB in f32, more than the {:.2} GiB of memory available",
        gib(*need),
        gib(*have)
    )]
    NoMemory { params: u64, need: u64, have: u64 },
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Memory the host can still give (`MemAvailable` of /proc/meminfo); `None` where unknown.
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb.saturating_mul(1024))
}

/// A visit of every float parameter with its path (`layers.0.self_attn.q_proj.weight`), through
/// [`visit_paths`]: the one place that follows Burn's modules to a parameter's name.
pub trait PathVisitor<B: Backend> {
    fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>);
}

/// A change of every float parameter with its path, through [`map_paths`].
pub trait PathMapper<B: Backend> {
    fn map<const D: usize>(&mut self, path: &str, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>>;
}

/// A visitor or mapper with the dotted path of the module being visited.
struct Paths<V> {
    path: Vec<String>,
    inner: V,
}

impl<V> Paths<V> {
    fn joined(&self) -> String {
        self.path.join(".")
    }

    /// A module entered by field `name`. An enum's variant takes its field's place in the path, in
    /// snake case (`ffn: FeedForward::Mlp(…)` is `mlp`), so that a part whose kind is a type keeps
    /// the names it had as one of two optional fields; the variant of one of [`KINDS`] leaves the
    /// field's name as it is.
    fn enter(&mut self, name: &str, container: &str) {
        if KINDS.contains(&container) {
            return;
        }
        if container.starts_with("Enum:") {
            self.path.pop();
            self.path.push(snake_case(name));
        } else {
            self.path.push(name.to_string());
        }
    }

    /// Leaves what [`Self::enter`] entered: the enum's variant stays as its field's name until the
    /// field itself is left.
    fn exit(&mut self, container: &str) {
        if !container.starts_with("Enum:") {
            self.path.pop();
        }
    }
}

/// The enums whose variant is how their field's part is held, not which part it is: a weight dense
/// or stored (`q_proj.weight`, `embed_tokens`), self-attention grouped or latent (`self_attn.q_proj`,
/// `self_attn.mla.kv_a_norm`). Their parameters are named by the field alone.
const KINDS: [&str; 2] = ["Enum:Weight", "Enum:SelfAttention"];

/// `FeedForward` → `feed_forward`.
fn snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

impl<B: Backend, V: PathVisitor<B>> ModuleVisitor<B> for Paths<&mut V> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, container: &str) {
        self.exit(container);
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let path = self.joined();
        self.inner.visit(&path, param);
    }
}

impl<B: Backend, V: PathMapper<B>> ModuleMapper<B> for Paths<&mut V> {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.enter(name, container);
    }
    fn exit_module(&mut self, _: &str, container: &str) {
        self.exit(container);
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.joined();
        self.inner.map(&path, param)
    }
}

/// Visits every float parameter of `module` with its path, in visiting order.
pub fn visit_paths<B: Backend, M: Module<B>, V: PathVisitor<B>>(module: &M, visitor: &mut V) {
    module.visit(&mut Paths { path: Vec::new(), inner: visitor });
}

/// Maps every float parameter of `module` with its path, in visiting order.
pub fn map_paths<B: Backend, M: Module<B>, V: PathMapper<B>>(module: M, mapper: &mut V) -> M {
    module.map(&mut Paths { path: Vec::new(), inner: mapper })
}

/// Every float parameter of `module`, by path, in visiting order.
pub fn named_tensors<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, TensorData)> {
    named_tensors_where::<B, M, _>(module, |_| true)
}

/// The float parameters of `module` whose path `keep` accepts, by path, in visiting order; the
/// others are not read.
pub fn named_tensors_where<B: Backend, M: Module<B>, F: Fn(&str) -> bool>(
    module: &M,
    keep: F,
) -> Vec<(String, TensorData)> {
    struct Collect<F> {
        out: Vec<(String, TensorData)>,
        keep: F,
    }
    impl<B: Backend, F: Fn(&str) -> bool> PathVisitor<B> for Collect<F> {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            if (self.keep)(path) {
                self.out.push((path.to_string(), param.val().into_data()));
            }
        }
    }
    let mut c = Collect { out: Vec::new(), keep };
    visit_paths(module, &mut c);
    c.out
}

/// Every float parameter's path and shape, without reading values.
pub fn param_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, Vec<usize>)> {
    struct Shapes(Vec<(String, Vec<usize>)>);
    impl<B: Backend> PathVisitor<B> for Shapes {
        fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
            self.0.push((path.to_string(), param.lazy_shape().to_vec()));
        }
    }
    let mut s = Shapes(Vec::new());
    visit_paths(module, &mut s);
    s.0
}

/// Replaces the values of `module`'s parameters with `tensors` (by path), keeping parameter ids and
/// `require_grad`, converting each tensor to the parameter's dtype. All names and shapes are checked
/// first: on any error the module is not touched. Keys of `tensors` that match no parameter are an
/// error unless `allow_unused`.
pub fn assign<B: Backend, M: Module<B>>(
    module: M,
    tensors: BTreeMap<String, TensorData>,
    source_name: &str,
    allow_unused: bool,
) -> Result<M, WeightsError> {
    assign_as(module, tensors, source_name, allow_unused, None)
}

/// [`assign`], a parameter not yet initialised (a loading model's lazy zeros) made `lazy_dtype`
/// (the device's default float type where `None`) without ever holding its zeros.
pub fn assign_as<B: Backend, M: Module<B>>(
    module: M,
    mut tensors: BTreeMap<String, TensorData>,
    source_name: &str,
    allow_unused: bool,
    lazy_dtype: Option<DType>,
) -> Result<M, WeightsError> {
    let mut missing = Vec::new();
    for (key, expected) in param_shapes::<B, M>(&module) {
        match tensors.get(&key) {
            None => missing.push(key),
            Some(data) if data.shape.as_slice() != expected.as_slice() => {
                return Err(WeightsError::Shape {
                    source_name: source_name.into(),
                    key,
                    expected,
                    found: data.shape.to_vec(),
                })
            }
            Some(_) => {}
        }
    }
    if !missing.is_empty() {
        return Err(WeightsError::Missing { source_name: source_name.into(), keys: missing });
    }
    let known: std::collections::HashSet<String> = param_shapes::<B, M>(&module).into_iter().map(|(k, _)| k).collect();
    let unused: Vec<String> = tensors.keys().filter(|k| !known.contains(*k)).cloned().collect();
    if !unused.is_empty() && !allow_unused {
        return Err(WeightsError::Unexpected { source_name: source_name.into(), keys: unused });
    }

    struct Assign<'a>(&'a mut BTreeMap<String, TensorData>, DType);
    impl<B: Backend> PathMapper<B> for Assign<'_> {
        fn map<const D: usize>(&mut self, path: &str, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let data = self.0.remove(path).expect("checked above");
            if !param.is_initialized() {
                // Lazy zeros (trainable, no mapper yet): replaced without being made.
                let new = Tensor::<B, D>::from_data(data.convert_dtype(self.1), (&param.lazy_device(), self.1));
                return Param::initialized(param.id, new.require_grad());
            }
            let (id, tensor, mapper) = param.consume();
            let require_grad = tensor.is_require_grad();
            // The parameter's dtype named at creation: `from_data` alone builds the device's default
            // float dtype (a bf16 parameter came back f32, and `import --dtype bf16` wrote f32).
            let dtype = tensor.dtype();
            let new = Tensor::<B, D>::from_data(data.convert_dtype(dtype), (&tensor.device(), dtype));
            let new = if require_grad { new.require_grad() } else { new };
            Param::from_mapped_value(id, new, mapper)
        }
    }
    let lazy_dtype = lazy_dtype.unwrap_or(<B::FloatElem as burn::tensor::Element>::dtype());
    Ok(map_paths(module, &mut Assign(&mut tensors, lazy_dtype)))
}

fn st_dtype(dtype: DType) -> Option<Dtype> {
    Some(match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        _ => return None,
    })
}

/// Serialises named float tensors into the safetensors format.
pub fn to_safetensors(
    tensors: &[(String, TensorData)],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, data)| {
            let dtype = st_dtype(data.dtype).expect("float parameters");
            let view = safetensors::tensor::TensorView::new(dtype, data.shape.to_vec(), data.as_bytes())
                .expect("shape and byte length agree");
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize(views, metadata).expect("serialising in-memory tensors")
}

/// Tensors by name.
pub type NamedTensors = BTreeMap<String, TensorData>;
/// A safetensors file's `__metadata__` strings.
pub type Metadata = std::collections::HashMap<String, String>;

/// Parses a safetensors file's bytes into named tensors (float dtypes only). `source_name` (usually
/// the path) appears in errors.
pub fn from_safetensors(bytes: &[u8], source_name: &str) -> Result<(NamedTensors, Metadata), WeightsError> {
    from_safetensors_releasing(bytes, source_name, |_| {})
}

/// [`from_safetensors`], `copied` handed each tensor's bytes once its values are copied out (a
/// mapped file lets those pages go: `ember_data::FileBytes::release_bytes`).
pub fn from_safetensors_releasing(
    bytes: &[u8],
    source_name: &str,
    mut copied: impl FnMut(&[u8]),
) -> Result<(NamedTensors, Metadata), WeightsError> {
    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| WeightsError::Format { source_name: source_name.into(), message: e.to_string() })?;
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| WeightsError::Format { source_name: source_name.into(), message: e.to_string() })?;
    let mut out = BTreeMap::new();
    for (name, view) in file.tensors() {
        let dtype = match view.dtype() {
            Dtype::F64 => DType::F64,
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(WeightsError::Dtype {
                    source_name: source_name.into(),
                    key: name,
                    dtype: format!("{other:?}"),
                })
            }
        };
        let data = TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype);
        copied(view.data());
        out.insert(name, data);
    }
    Ok((out, meta.metadata().clone().unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_counted_in_every_float_dtype() {
        let values = vec![1.0f32, f32::NAN, -2.5, f32::INFINITY, f32::NEG_INFINITY, 1e30, 0.0];
        let data = TensorData::new(values, [7]);
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            // 1e30 overflows f16 (but not bf16) to infinity.
            let want = if dtype == DType::F16 { 4 } else { 3 };
            assert_eq!(count_non_finite(&data.clone().convert_dtype(dtype)), want, "{dtype:?}");
        }
        assert_eq!(count_non_finite(&TensorData::new(vec![1i32, -1], [2])), 0);
    }
    use crate::config::tiny_config;
    use crate::{Decoder, ModelConfig, TestBackend};

    type B = TestBackend;

    /// A model built to be loaded holds no zeros: its weights stay unmade through a change of
    /// dtype and are replaced by the loaded values without being made (the loaded values, in the
    /// dtype asked for); norm gains are made (ones) and loaded over as before.
    #[test]
    fn an_empty_model_is_loaded_without_making_its_zeros() {
        struct Made(usize, usize);
        impl<B: Backend> ModuleVisitor<B> for Made {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0 += usize::from(param.is_initialized());
                self.1 += 1;
            }
        }
        let made = |m: &Decoder<B>| {
            let mut v = Made(0, 0);
            m.visit(&mut v);
            (v.0, v.1)
        };
        let config = tiny_config();
        let norms = 2 * config.n_layers + 1;
        let empty = Decoder::<B>::empty(&config, &Default::default()).unwrap();
        let (initialised, all) = made(&empty);
        assert_eq!(initialised, norms, "only the norm gains are made");
        let half = empty.with_param_dtype(DType::BF16);
        assert_eq!(made(&half).0, norms, "a change of dtype keeps the weights unmade");
        let source = Decoder::<B>::new(&config, 7, &Default::default()).unwrap();
        let values: BTreeMap<String, TensorData> = named_tensors::<B, _>(&source).into_iter().collect();
        let loaded = assign_as(half, values.clone(), "test", false, Some(DType::BF16)).unwrap();
        assert_eq!(made(&loaded), (all, all));
        for (name, data) in named_tensors::<B, _>(&loaded) {
            assert_eq!(data.dtype, DType::BF16, "{name}");
            assert_eq!(data, values[&name].clone().convert_dtype(DType::BF16), "{name}");
        }
        // Read before it is loaded, an unmade weight is zeros.
        let zeros = named_tensors::<B, _>(&Decoder::<B>::empty(&config, &Default::default()).unwrap());
        assert!(zeros[0].1.to_vec::<f32>().unwrap().iter().all(|&x| x == 0.0), "{}", zeros[0].0);
    }

    #[test]
    fn names_follow_the_field_paths() {
        let model = Decoder::<B>::new(&tiny_config(), 0, &Default::default()).unwrap();
        let names: Vec<String> = named_tensors::<B, _>(&model).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names[0], "embed_tokens");
        assert!(names.contains(&"layers.1.self_attn.k_proj.weight".to_string()));
        assert!(names.contains(&"layers.0.post_attention_layernorm.weight".to_string()));
        assert!(names.contains(&"lm_head.weight".to_string()));
        assert_eq!(names.len(), 1 + 2 * 9 + 1 + 1);
    }

    /// A weight is named by its field whether it is dense or stored (stored, it has no tensor: the
    /// layer's other parameters keep their names), and the attention's parts by theirs whether it
    /// is grouped or latent.
    #[test]
    fn the_kind_of_a_weight_or_an_attention_is_not_in_the_names() {
        use crate::linear::{f32_blocks, Linear, Stored, Weight};
        use crate::lora::{Lora, LoraConfig};
        let dev = Default::default();
        let mut init = crate::init::Init::new(1);
        let lora = LoraConfig { rank: 2, alpha: 4.0, dropout: 0.0, targets: vec![] };
        let dense = Linear::<B> {
            lora: Some(Lora::new(&mut init, 8, 4, &lora, &dev)),
            ..Linear::new(&mut init, 8, 4, true, 0.02, &dev)
        };
        let stored = Linear { weight: Weight::Stored(Stored::new(f32_blocks(4, 8, &[0.0; 32]))), ..dense.clone() };
        let names = |l: &Linear<B>| param_shapes::<B, _>(l).into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(names(&dense), ["weight", "bias", "lora.lora_a", "lora.lora_b"]);
        assert_eq!(names(&stored), ["bias", "lora.lora_a", "lora.lora_b"]);

        let grouped = ModelConfig { qk_norm: true, ..tiny_config() };
        let names = |c: &ModelConfig| {
            param_shapes::<B, _>(&Decoder::<B>::new(c, 0, &dev).unwrap())
                .into_iter()
                .map(|(n, _)| n)
                .collect::<Vec<_>>()
        };
        let grouped = names(&grouped);
        for name in [
            "embed_tokens",
            "layers.1.self_attn.q_proj.weight",
            "layers.1.self_attn.q_norm.weight",
            "layers.1.mlp.up_proj.weight",
        ] {
            assert!(grouped.contains(&name.to_string()), "{name}: {grouped:?}");
        }
        let mla = crate::MlaConfig { q_rank: Some(8), kv_rank: 8, nope_dim: 4, rope_dim: 4, v_dim: 4, norm_eps: 1e-6 };
        let latent = names(&ModelConfig { mla: Some(mla), ..tiny_config() });
        let want = [
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.o_proj.weight",
            "layers.0.self_attn.mla.q_a_proj.weight",
            "layers.0.self_attn.mla.q_a_norm.weight",
            "layers.0.self_attn.mla.kv_a_norm.weight",
        ];
        let attention: Vec<&str> =
            latent.iter().map(String::as_str).filter(|n| n.starts_with("layers.0.self_attn")).collect();
        assert_eq!(attention, want);
    }

    #[test]
    fn safetensors_round_trip_is_exact() {
        let dev = Default::default();
        let a = Decoder::<B>::new(&tiny_config(), 1, &dev).unwrap();
        let b = Decoder::<B>::new(&tiny_config(), 2, &dev).unwrap();
        let bytes = to_safetensors(&named_tensors::<B, _>(&a), None);
        let (tensors, _) = from_safetensors(&bytes, "a.safetensors").unwrap();
        let b = assign::<B, _>(b, tensors, "a.safetensors", false).unwrap();
        for ((na, ta), (nb, tb)) in named_tensors::<B, _>(&a).into_iter().zip(named_tensors::<B, _>(&b)) {
            assert_eq!(na, nb);
            ta.assert_eq(&tb, true);
        }
        // bf16 parameters stay bf16 (what `import --dtype bf16` saves and inference keeps).
        let half = |m: Decoder<B>| m.with_param_dtype(burn::tensor::DType::BF16);
        let bytes = to_safetensors(&named_tensors::<B, _>(&half(a)), None);
        let (tensors, _) = from_safetensors(&bytes, "a.safetensors").unwrap();
        let c = assign::<B, _>(half(b.clone()), tensors.clone(), "a.safetensors", false).unwrap();
        for (name, got) in named_tensors::<B, _>(&c) {
            assert_eq!(got.dtype, burn::tensor::DType::BF16, "{name}");
            got.assert_eq(&tensors[&name], true);
        }
    }

    #[test]
    fn errors_name_the_key_and_shapes() {
        let dev = Default::default();
        let model = Decoder::<B>::new(&tiny_config(), 1, &dev).unwrap();
        let full: BTreeMap<String, TensorData> = named_tensors::<B, _>(&model).into_iter().collect();

        let mut wrong = full.clone();
        wrong.insert("norm.weight".into(), TensorData::new(vec![1.0f32; 5], [5]));
        let e = assign::<B, _>(model.clone(), wrong, "m.safetensors", false).unwrap_err();
        assert_eq!(e.to_string(), "m.safetensors: `norm.weight`: expected shape [32], found [5]");

        let mut missing = full.clone();
        missing.remove("layers.1.mlp.up_proj.weight");
        let e = assign::<B, _>(model.clone(), missing, "m.safetensors", false).unwrap_err();
        assert_eq!(e.to_string(), "m.safetensors: missing tensor(s) layers.1.mlp.up_proj.weight");

        let mut extra = full;
        extra.insert("layers.9.bogus".into(), TensorData::new(vec![1.0f32], [1]));
        let e = assign::<B, _>(model.clone(), extra.clone(), "m.safetensors", false).unwrap_err();
        assert_eq!(e.to_string(), "m.safetensors: unexpected tensor(s) layers.9.bogus");
        assert!(assign::<B, _>(model, extra, "m.safetensors", true).is_ok());

        let e = from_safetensors(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage", "t.safetensors").unwrap_err();
        assert!(e.to_string().starts_with("t.safetensors: not a safetensors file"), "{e}");
    }
}
