//! The data of a training config: a token stream cut into windows (`format = "text"`), or packed
//! fine-tuning examples (`format = "jsonl"`), with the tokenizer that made them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_data::fetch::{locate, Locations};
use ember_data::finetune::{encode_of_file, read_jsonl, Body, ChatTemplate, PackedExamples, Record};
use ember_data::prepare::prepare_cached;
use ember_data::{DataError, Examples, Manifest, TokenWindows, Tokenizer, TokenizerSpec, Window};

use crate::config::{DataConfig, DataFormat, TrainConfig};
use crate::error::{InvalidConfig, TrainError};
use crate::init::ResolvedInit;

/// The text file a data config names, found or downloaded, and its validation fraction.
pub(crate) fn text_source(config: &DataConfig, locations: &Locations) -> Result<(PathBuf, f64), TrainError> {
    // A separate validation file: the training file is read whole.
    let fraction = |default: f64| if config.val_path.is_some() { 0.0 } else { config.val_fraction.unwrap_or(default) };
    match (&config.dataset, &config.path) {
        (Some(name), _) => {
            let manifest = Manifest::built_in(name)?;
            let path = locate(&manifest, locations)?;
            Ok((path, fraction(manifest.val_fraction)))
        }
        (None, Some(path)) => {
            use std::io::{Error, ErrorKind};
            let refused = match std::fs::metadata(path) {
                Ok(m) if m.is_file() => None,
                Ok(m) if m.is_dir() => {
                    Some(Error::new(ErrorKind::InvalidInput, "data.path: a directory, not a text or JSONL file"))
                }
                Ok(m) => {
                    let kind = ember_data::special_file(m.file_type()).unwrap_or("a special file");
                    let message = format!("data.path: not a regular file ({kind}): ember reads the file twice");
                    Some(Error::new(ErrorKind::InvalidInput, message))
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    Some(Error::new(ErrorKind::NotFound, "data.path: no such file"))
                }
                Err(e) => Some(e),
            };
            if let Some(err) = refused {
                return Err(TrainError::Io { path: path.clone(), err });
            }
            Ok((path.clone(), fraction(0.1)))
        }
        // Validation refuses this; a caller that skipped it gets the same error.
        (None, None) => Err(TrainError::Invalid { path: PathBuf::from("[data]"), error: InvalidConfig::NoData }),
    }
}

/// Train and validation examples with their tokenizer.
pub struct LoadedData {
    pub tokenizer: Tokenizer,
    /// The folder of a pretrained model's tokenizer (its chat template travels to checkpoints).
    pub tokenizer_dir: Option<PathBuf>,
    pub train: Examples,
    pub val: Examples,
    /// Positions per row: `train.seq_len`, or where the config leaves it out, its default for this
    /// data ([`TrainConfig::default_seq_len`]).
    pub seq_len: usize,
    /// Fine-tuning data: the prompt of the first held-out example, as the model reads it (a chat's
    /// messages up to its last user turn through the chat template, with the generation prompt; a
    /// completion's prompt), for the evaluation samples. Encoded with special tokens.
    pub held_out_prompt: Option<String>,
    /// Reinforcement learning: the prompts with their rows (the rows above hold their tokens).
    pub prompts: Option<crate::rl::Prompts>,
    /// Where the training rows come from, for the record in a run's checkpoints.
    pub origin: DataOrigin,
}

/// The training data's file (a built-in dataset's, found or downloaded) and, for a token stream,
/// its training shard.
#[derive(Debug, Clone, Default)]
pub struct DataOrigin {
    pub source: PathBuf,
    pub train_shard: Option<Arc<ember_data::TokenShard>>,
    /// `data.val_path`: the validation file, where the run has one of its own.
    pub val_file: Option<PathBuf>,
}

impl DataOrigin {
    /// The record of what a run of this data reads (the file's digest and rows, a token stream's
    /// training shard), hashing all of it: only training runs ask.
    pub(crate) fn record(&self) -> Result<crate::checkpoint::DataRecord, TrainError> {
        let shards: Vec<_> =
            self.train_shard.iter().map(|s| (ember_data::prepare::TRAIN_FILE.to_string(), s.clone())).collect();
        crate::checkpoint::DataRecord::of(&self.source, shards.is_empty(), &shards)
    }

    /// The record of the validation file, where the run has one of its own.
    pub(crate) fn record_val(&self) -> Result<Option<crate::checkpoint::DataRecord>, TrainError> {
        let jsonl = self.train_shard.is_none();
        self.val_file.as_ref().map(|path| crate::checkpoint::DataRecord::of(path, jsonl, &[])).transpose()
    }
}

/// Tokenizer spec of a config: `data.tokenizer`, else the `init_from` model's (`init`, the source
/// opened), else `char`.
fn tokenizer_spec(
    config: &TrainConfig,
    init: Option<&ResolvedInit>,
) -> Result<(TokenizerSpec, Option<PathBuf>), TrainError> {
    if let Some(t) = &config.data.tokenizer {
        return Ok((t.parse()?, None));
    }
    match init {
        Some(init) => {
            let dir = init.tokenizer_dir()?;
            Ok((TokenizerSpec::File(dir.join("tokenizer.json")), Some(dir)))
        }
        None => Ok((TokenizerSpec::Char, None)),
    }
}

/// Loads (and caches the token shards of) the data of `config`, in windows of `train.seq_len` (or
/// where the config leaves it out, its default for this data: [`LoadedData::seq_len`]); `init` is
/// its `init_from` source, opened.
pub fn load(
    config: &TrainConfig,
    init: Option<&ResolvedInit>,
    locations: &Locations,
) -> Result<LoadedData, TrainError> {
    let (path, val_fraction) = text_source(&config.data, locations)?;
    let (spec, tokenizer_dir) = tokenizer_spec(config, init)?;
    let mut loaded = match config.data.format() {
        DataFormat::Text => load_text(config, &path, val_fraction, &spec, tokenizer_dir, locations),
        DataFormat::Jsonl => {
            let (tokenizer, template) = jsonl_tokenizer(&spec, tokenizer_dir.as_deref())?;
            let val_path = config.data.val_path.as_deref();
            let file = JsonlFile { path: &path, val_fraction, val_path, tokenizer, template, tokenizer_dir };
            match (&config.preference, &config.rl) {
                (_, Some(rl)) => load_prompts(config, rl.max_new_tokens, file),
                (Some(_), None) => load_preference(config, file),
                (None, None) => load_jsonl(config, file),
            }
        }
    }?;
    loaded.origin.source = path;
    loaded.origin.val_file = config.data.val_path.clone();
    Ok(loaded)
}

/// A JSONL file of examples or pairs: its held-out fraction (or its validation file), its
/// tokenizer and chat template.
struct JsonlFile<'a> {
    path: &'a Path,
    val_fraction: f64,
    /// `data.val_path`: the held-out records are this file's, the training file is used whole.
    val_path: Option<&'a Path>,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    tokenizer_dir: Option<PathBuf>,
}

impl<'a> JsonlFile<'a> {
    /// The records (`what`) read by `read`, the held-out ones last, and how many those are:
    /// `val_fraction` of the file's, or all of `data.val_path`'s.
    fn records<T>(
        &self,
        read: impl Fn(&Path) -> Result<Vec<T>, DataError>,
        what: &str,
    ) -> Result<(Vec<T>, usize), TrainError> {
        let mut records = read(self.path)?;
        let Some(val_path) = self.val_path else {
            let n_val = held_out(records.len(), self.val_fraction, self.path, what)?;
            return Ok((records, n_val));
        };
        let val = read(val_path)?;
        for (path, n) in [(self.path, records.len()), (val_path, val.len())] {
            if n == 0 {
                return Err(DataError::Jsonl { path: path.into(), line: 0, message: format!("holds no {what}") }.into());
            }
        }
        let n_val = val.len();
        records.extend(val);
        Ok((records, n_val))
    }

    /// The file the held-out records come from: `data.val_path`, or the training file.
    fn val_source(&self) -> &'a Path {
        self.val_path.unwrap_or(self.path)
    }
}

/// `train.seq_len`, or where the file left it out the default for rows of `longest` tokens (the
/// log says what they are: `note`).
fn seq_len_or_longest(config: &TrainConfig, longest: usize, note: impl FnOnce() -> String) -> usize {
    config.train.seq_len.unwrap_or_else(|| {
        let t = config.default_seq_len(Some(longest));
        tracing::info!("train.seq_len left out: {t} ({})", note());
        t
    })
}

/// Preference pairs, tokenized as TRL does, one row of two documents each
/// ([`ember_data::preference`]); the held-out pairs are the file's last, or `data.val_path`'s.
fn load_preference(config: &TrainConfig, file: JsonlFile<'_>) -> Result<LoadedData, TrainError> {
    use ember_data::preference::{encode_pairs_of_file, read_preference_jsonl, Turns};
    let (records, n_val) = file.records(read_preference_jsonl, "preference pairs")?;
    let JsonlFile { path, val_path, tokenizer, template, tokenizer_dir, .. } = file;
    // The file each pair was read from (errors name it, and the pair's line there): the training
    // file, then `data.val_path` where the held-out pairs are its.
    let n_train = records.len() - n_val;
    let source = |i: usize| if i < n_train { path } else { val_path.unwrap_or(path) };
    let encode = |range: std::ops::Range<usize>| {
        encode_pairs_of_file(source(range.start), &records[range], &tokenizer, template.as_ref())
    };
    let mut pairs = encode(0..n_train)?;
    pairs.extend(encode(n_train..records.len())?);
    let longest = pairs.iter().map(|p| p.len()).max().unwrap_or(0);
    // `default_seq_len` counts a row's `seq_len + 1` tokens; a pair row holds `len`.
    let seq_len = seq_len_or_longest(config, longest + 1, || format!("the longest pair takes {longest} positions"));
    let pad = tokenizer.eos_id().unwrap_or(0);
    let mut rows = Vec::with_capacity(pairs.len());
    for (i, pair) in pairs.iter().enumerate() {
        // The pair's line in its file (blank lines counted), not its index.
        let row = pair.row(seq_len, pad).ok_or_else(|| DataError::Jsonl {
            path: source(i).into(),
            line: records[i].line,
            message: format!(
                "the pair takes {} positions (the prompt twice and both answers), more than train.seq_len = {seq_len}",
                pair.len()
            ),
        })?;
        rows.push(row);
    }
    let val = rows.split_off(rows.len() - n_val);
    tracing::info!(
        train_pairs = rows.len(),
        val_pairs = val.len(),
        seq_len,
        "preference pairs from {}",
        path.display()
    );
    // None held out (`val_fraction = 0`): no prompt.
    let held_out_prompt = records.get(n_train).and_then(|r| match &r.prompt {
        Turns::Text(p) => Some(p.clone()),
        Turns::Chat(m) => template.as_ref().and_then(|t| t.render(m, true).ok()),
    });
    Ok(LoadedData {
        tokenizer,
        tokenizer_dir,
        train: Arc::new(PackedExamples::from_rows(rows)),
        val: Arc::new(PackedExamples::from_rows(val)),
        seq_len,
        held_out_prompt,
        prompts: None,
        origin: Default::default(),
    })
}

/// Prompts for reinforcement learning ([`ember_data::prompts`]), the held-out ones the file's
/// last. Each is a row of its tokens (no targets: the answers are sampled); `train.seq_len` left
/// out is the longest prompt and `max_new_tokens`.
fn load_prompts(config: &TrainConfig, max_new_tokens: usize, file: JsonlFile<'_>) -> Result<LoadedData, TrainError> {
    use ember_data::prompts::{encode_prompts, read_prompt_jsonl};
    let (records, n_val) = file.records(read_prompt_jsonl, "prompts")?;
    let (train_records, val_records) = records.split_at(records.len() - n_val);
    let val_file = file.val_source();
    let JsonlFile { path, tokenizer, template, tokenizer_dir, .. } = file;
    let train = encode_prompts(train_records, &tokenizer, template.as_ref(), path)?;
    let val = encode_prompts(val_records, &tokenizer, template.as_ref(), val_file)?;
    let longest = train.iter().chain(&val).map(|p| p.ids.len()).max().unwrap_or(0);
    let seq_len = config.train.seq_len.unwrap_or(longest + max_new_tokens);
    let rows = |prompts: &[ember_data::prompts::Prompt]| -> Examples {
        let rows = prompts
            .iter()
            .map(|p| Window { input: p.ids.clone(), target: vec![-1; p.ids.len()], docs: None })
            .collect();
        Arc::new(PackedExamples::from_rows(rows))
    };
    tracing::info!(train_prompts = train.len(), val_prompts = val.len(), longest, "prompts from {}", path.display());
    let held_out_prompt = val.first().map(|p| p.text.clone());
    Ok(LoadedData {
        train: rows(&train),
        val: rows(&val),
        prompts: Some(crate::rl::Prompts { train, val }),
        tokenizer,
        tokenizer_dir,
        seq_len,
        held_out_prompt,
        origin: Default::default(),
    })
}

/// A token stream (tokenized once, cached as shards) cut into windows.
fn load_text(
    config: &TrainConfig,
    path: &Path,
    val_fraction: f64,
    spec: &TokenizerSpec,
    tokenizer_dir: Option<PathBuf>,
    locations: &Locations,
) -> Result<LoadedData, TrainError> {
    let root: &Path = &locations.cache_dir.join("prepared");
    let data = prepare_cached(path, spec, val_fraction, root)?;
    // Shards (cached ones too) are checked against the tokenizer that will be trained with:
    // an id past its vocabulary would index past the embedding table.
    let vocab = data.tokenizer.vocab_size();
    for (file, shard) in [(ember_data::prepare::TRAIN_FILE, &data.train), (ember_data::prepare::VAL_FILE, &data.val)] {
        if let Some(&id) = shard.tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(DataError::Shard {
                path: data.dir.join(file),
                message: format!(
                    "holds token id {id}, past the tokenizer's vocabulary of {vocab}; delete {} to prepare the data again",
                    data.dir.display()
                ),
            }
            .into());
        }
    }
    let seq_len = config.train.seq_len.unwrap_or_else(|| config.default_seq_len(None));
    let train_shard = Arc::new(data.train);
    let train: Examples = Arc::new(TokenWindows::new(train_shard.clone(), seq_len, "train")?);
    let val: Examples = match (&config.data.val_path, val_fraction) {
        (Some(val_path), _) => {
            // The validation text through the training tokenizer, which must not depend on the
            // text it reads (a char or trained BPE vocabulary is the training file's own).
            if !matches!(spec, TokenizerSpec::File(_)) {
                let message = format!(
                    "data.val_path with text data needs a tokenizer.json (data.tokenizer or init_from's), not {spec}: \
                     a {spec} vocabulary is built from the training file; use data.val_fraction instead"
                );
                return Err(TrainError::Config { path: val_path.clone(), key: Some("data.val_path".into()), message });
            }
            let held = prepare_cached(val_path, spec, 0.0, root)?;
            Arc::new(TokenWindows::new(Arc::new(held.train), seq_len, "val")?)
        }
        (None, f) if f == 0.0 => Arc::new(PackedExamples::from_rows(Vec::new())),
        (None, _) => Arc::new(TokenWindows::new(Arc::new(data.val), seq_len, "val")?),
    };
    let tokenizer = with_model_eos(data.tokenizer, tokenizer_dir.as_deref());
    let origin = DataOrigin { source: path.to_path_buf(), train_shard: Some(train_shard), val_file: None };
    Ok(LoadedData { tokenizer, tokenizer_dir, train, val, seq_len, held_out_prompt: None, prompts: None, origin })
}

/// Fine-tuning examples, encoded (chat messages through the model's template) and packed into rows.
fn load_jsonl(config: &TrainConfig, file: JsonlFile<'_>) -> Result<LoadedData, TrainError> {
    let (records, n_val) = file.records(read_jsonl, "examples")?;
    let n_train = records.len() - n_val;
    let val_file = file.val_source();
    let JsonlFile { path, tokenizer, template, tokenizer_dir, .. } = file;
    // Errors name the file each record was read from, and its line there.
    let (train_rec, val_rec) = records.split_at(n_train);
    let mut examples = encode_of_file(path, train_rec, &tokenizer, template.as_ref())?;
    examples.extend(encode_of_file(val_file, val_rec, &tokenizer, template.as_ref())?);
    let (train_ex, val_ex) = examples.split_at(n_train);
    let longest = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    let seq_len = seq_len_or_longest(config, longest, || format!("the longest example has {longest} tokens"));
    let packing = Packing { seq_len, mode: config.data.packing(), truncate: config.data.truncate };
    let train = packing.pack(train_ex, train_rec, &tokenizer, path)?;
    let val = packing.pack(val_ex, val_rec, &tokenizer, val_file)?;
    // No validation (`val_fraction = 0`) leaves the val split empty.
    for (split, set, wanted) in [("train", &train, true), ("val", &val, n_val > 0)] {
        if wanted && burn::data::dataset::Dataset::len(set) == 0 {
            return Err(DataError::TooShort { split: split.into(), tokens: 0, needed: 1 }.into());
        }
    }
    tracing::info!(
        train_examples = train_ex.len(),
        val_examples = val_ex.len(),
        train_scored_tokens = train.scored_tokens(),
        train_rows = burn::data::dataset::Dataset::len(&train),
        packing = %packing.mode,
        "packed fine-tuning examples from {}",
        path.display()
    );
    let first_held_out = records.get(records.len() - n_val);
    let held_out_prompt = first_held_out.and_then(|r| prompt_of(r, template.as_ref()));
    Ok(LoadedData {
        tokenizer,
        tokenizer_dir,
        train: Arc::new(train),
        val: Arc::new(val),
        seq_len,
        held_out_prompt,
        prompts: None,
        origin: Default::default(),
    })
}

/// The tokenizer of JSONL data (a tokenizer.json, with its model's end-of-sequence token) and the
/// model's chat template, where its folder `dir` has one.
fn jsonl_tokenizer(spec: &TokenizerSpec, dir: Option<&Path>) -> Result<(Tokenizer, Option<ChatTemplate>), TrainError> {
    let tokenizer = match spec {
        TokenizerSpec::File(p) => with_model_eos(Tokenizer::from_file(p)?, dir),
        other => return Err(DataError::TokenizerSpec(format!("{other} (jsonl data needs a tokenizer.json)")).into()),
    };
    let template = match dir {
        Some(dir) => ChatTemplate::from_dir(dir)?,
        None => None,
    };
    Ok((tokenizer, template))
}

/// How many of the file's `n` records (`what`) are held out: `val_fraction` of them, at least one
/// and one fewer than all; fewer than 2 records is an error. None with a `val_fraction` of 0 (no
/// validation).
fn held_out(n: usize, val_fraction: f64, path: &Path, what: &str) -> Result<usize, TrainError> {
    if val_fraction == 0.0 {
        if n == 0 {
            return Err(DataError::Jsonl { path: path.into(), line: 0, message: format!("holds no {what}") }.into());
        }
        return Ok(0);
    }
    if n < 2 {
        let message = format!("need at least 2 {what} (train and val)");
        return Err(DataError::Jsonl { path: path.into(), line: n, message }.into());
    }
    Ok(((n as f64 * val_fraction).round() as usize).clamp(1, n - 1))
}

/// What the model reads before the answer of `record`: a chat's messages up to its last user turn
/// through `template`, with the row's `tools` (as fine-tuning renders it) and the generation
/// prompt; a completion's prompt. `None` for text (no prompt), a chat without a user turn, or a
/// template that fails on the shortened conversation.
fn prompt_of(record: &Record, template: Option<&ChatTemplate>) -> Option<String> {
    match &record.body {
        Body::Text(_) => None,
        Body::Completion { prompt, .. } => Some(prompt.clone()),
        Body::Chat(messages) => {
            let last_user = messages.iter().rposition(|m| m.role == "user")?;
            template?
                .render_conversation(&messages[..=last_user], &record.tools, true)
                .inspect_err(|e| tracing::warn!("no held-out prompt for the evaluation samples: {e}"))
                .ok()
        }
    }
}

/// How a run packs its JSONL examples into rows.
#[derive(Debug, Clone, Copy)]
pub struct Packing {
    pub seq_len: usize,
    pub mode: ember_data::finetune::Packing,
    pub truncate: bool,
}

impl Packing {
    /// Packs `examples`, those of `records` of the file `path`; an example too long for a row is
    /// an error naming the file and the record's line there.
    pub(crate) fn pack(
        &self,
        examples: &[ember_data::finetune::Example],
        records: &[Record],
        tokenizer: &Tokenizer,
        path: &Path,
    ) -> Result<PackedExamples, TrainError> {
        let pad = tokenizer.eos_id().unwrap_or(0);
        PackedExamples::new(examples, self.seq_len, pad, self.mode, self.truncate).map_err(|e| match e {
            // `index` counts from 1.
            DataError::ExampleTooLong { index, tokens, window } => DataError::Jsonl {
                path: path.into(),
                line: records.get(index.wrapping_sub(1)).map_or(0, |r| r.line),
                message: format!(
                    "the example has {tokens} tokens, more than the {window} a row of train.seq_len + 1 holds; \
                     raise train.seq_len, or set data.truncate = true to cut long examples"
                ),
            }
            .into(),
            other => other.into(),
        })
    }
}

/// Fine-tuning examples of a JSONL file, tokenized with `tokenizer` (chat messages through the
/// template in `template_dir`) and packed as documents into rows of `seq_len`: what `ember eval
/// --data FILE.jsonl` scores. Returns the rows and the number of examples.
pub fn jsonl_examples(
    path: &Path,
    tokenizer: &Tokenizer,
    template_dir: &Path,
    seq_len: usize,
) -> Result<(PackedExamples, usize), TrainError> {
    let records = read_jsonl(path)?;
    let template = ChatTemplate::from_dir(template_dir)?;
    let examples = encode_of_file(path, &records, tokenizer, template.as_ref())?;
    let packing = Packing { seq_len, mode: ember_data::finetune::Packing::Documents, truncate: false };
    Ok((packing.pack(&examples, &records, tokenizer, path)?, examples.len()))
}

/// The tokenizer with its model's own end-of-sequence token, where its folder names one.
fn with_model_eos(tokenizer: Tokenizer, dir: Option<&Path>) -> Tokenizer {
    match dir {
        Some(dir) => tokenizer.with_model_eos(dir),
        None => tokenizer,
    }
}

/// The token stream of a split of a text config (for `ember eval --data train|val`); `init` is its
/// `init_from` source, opened.
pub fn split_tokens(
    config: &TrainConfig,
    init: Option<&ResolvedInit>,
    locations: &Locations,
    split: &str,
) -> Result<Vec<u32>, TrainError> {
    let (path, val_fraction) = text_source(&config.data, locations)?;
    if config.data.format() == DataFormat::Jsonl {
        return Err(TrainError::Config {
            path,
            key: Some("data.format".into()),
            message: "a split's token stream needs a text corpus; this config's data is JSONL examples".into(),
        });
    }
    let (spec, _) = tokenizer_spec(config, init)?;
    let root = locations.cache_dir.join("prepared");
    if let (Some(val_path), "val") = (&config.data.val_path, split) {
        return Ok(prepare_cached(val_path, &spec, 0.0, &root)?.train.tokens);
    }
    let data = prepare_cached(&path, &spec, val_fraction, &root)?;
    Ok(if split == "train" { data.train.tokens } else { data.val.tokens })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_data::finetune::{Message, ToolCall};

    #[test]
    fn the_held_out_prompt_is_the_conversation_up_to_its_last_user_turn() {
        let template = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}\
             {% if add_generation_prompt %}<assistant>{% endif %}"
                .into(),
            String::new(),
            "</s>".into(),
        )
        .unwrap();
        let m = |role: &str, content: &str| Message::new(role, content);
        let chat = Body::Chat(vec![
            m("system", "Be brief."),
            m("user", "Capital of France?"),
            m("assistant", "Paris."),
            m("user", "And of Italy?"),
            m("assistant", "Rome."),
        ])
        .into();
        assert_eq!(
            prompt_of(&chat, Some(&template)).as_deref(),
            Some("<system>Be brief.\n<user>Capital of France?\n<assistant>Paris.\n<user>And of Italy?\n<assistant>")
        );
        let completion = Body::Completion { prompt: "Q: 2+2?\nA:".into(), completion: " 4".into() }.into();
        assert_eq!(prompt_of(&completion, None).as_deref(), Some("Q: 2+2?\nA:"));
        assert_eq!(prompt_of(&Body::Text("plain".into()).into(), None), None);
        assert_eq!(prompt_of(&Body::Chat(vec![m("assistant", "Hi.")]).into(), Some(&template)), None);
    }

    /// A tool-calling row's held-out prompt shows its tools, as its training rendering does.
    #[test]
    fn the_held_out_prompt_of_a_tool_calling_row_has_its_tools() {
        let template = ChatTemplate::new(
            "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}\
             {% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}\
             {% if add_generation_prompt %}<assistant>{% endif %}"
                .into(),
            String::new(),
            "</s>".into(),
        )
        .unwrap();
        let call =
            ToolCall { id: "c1".into(), name: "get_weather".into(), arguments: serde_json::json!({"city": "Paris"}) };
        let record = Record {
            tools: vec![serde_json::json!({"type": "function", "function": {"name": "get_weather"}})],
            ..Body::Chat(vec![
                Message::new("user", "Weather in Paris?"),
                Message::calls("", vec![call]),
                Message::tool_result("c1", "21 C"),
                Message::new("assistant", "It is 21 C."),
            ])
            .into()
        };
        let prompt = prompt_of(&record, Some(&template)).unwrap();
        // The toy template names no call format, so the tools come as ember's default text (the
        // server's rendering for such templates), at the head of the prompt.
        assert!(prompt.contains("\"name\": \"get_weather\"") && prompt.starts_with("<system>"), "{prompt}");
        assert!(prompt.ends_with("<user>Weather in Paris?\n<assistant>"), "{prompt}");
        let Body::Chat(messages) = &record.body else { unreachable!() };
        let trained = template.render_conversation(messages, &record.tools, false).unwrap();
        assert!(trained.starts_with(prompt.strip_suffix("<assistant>").unwrap()), "{trained}");
    }
}
