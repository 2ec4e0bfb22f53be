//! The data of a training config: a token stream cut into windows (`format = "text"`), or packed
//! fine-tuning examples (`format = "jsonl"`), with the tokenizer that made them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_data::fetch::{locate, Locations};
use ember_data::finetune::{encode, read_jsonl, ChatTemplate, PackedExamples, Record};
use ember_data::prepare::prepare_cached;
use ember_data::{DataError, Examples, Manifest, TokenWindows, Tokenizer, TokenizerSpec, Window};

use crate::config::{DataConfig, DataFormat, TrainConfig};
use crate::error::{InvalidConfig, TrainError};
use crate::init::ResolvedInit;

/// The text file a data config names, found or downloaded, and its validation fraction.
pub(crate) fn text_source(config: &DataConfig, locations: &Locations) -> Result<(PathBuf, f64), TrainError> {
    match (&config.dataset, &config.path) {
        (Some(name), _) => {
            let manifest = Manifest::built_in(name)?;
            let path = locate(&manifest, locations)?;
            Ok((path, config.val_fraction.unwrap_or(manifest.val_fraction)))
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
            Ok((path.clone(), config.val_fraction.unwrap_or(0.1)))
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
    match config.data.format() {
        DataFormat::Text => load_text(config, &path, val_fraction, &spec, tokenizer_dir, locations),
        DataFormat::Jsonl => {
            let (tokenizer, template) = jsonl_tokenizer(&spec, tokenizer_dir.as_deref())?;
            let file = JsonlFile { path: &path, val_fraction, tokenizer, template, tokenizer_dir };
            match (&config.preference, &config.rl) {
                (_, Some(rl)) => load_prompts(config, rl.max_new_tokens, file),
                (Some(_), None) => load_preference(config, file),
                (None, None) => load_jsonl(config, file),
            }
        }
    }
}

/// A JSONL file of examples or pairs: its held-out fraction, its tokenizer and chat template.
struct JsonlFile<'a> {
    path: &'a Path,
    val_fraction: f64,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    tokenizer_dir: Option<PathBuf>,
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
/// ([`ember_data::preference`]); the held-out pairs are the file's last.
fn load_preference(config: &TrainConfig, file: JsonlFile<'_>) -> Result<LoadedData, TrainError> {
    use ember_data::preference::{encode_pairs, read_preference_jsonl, Turns};
    let JsonlFile { path, val_fraction, tokenizer, template, tokenizer_dir } = file;
    let records = read_preference_jsonl(path)?;
    let n_val = held_out(records.len(), val_fraction, path, "preference pairs")?;
    let pairs = encode_pairs(&records, &tokenizer, template.as_ref())?;
    let longest = pairs.iter().map(|p| p.len()).max().unwrap_or(0);
    // `default_seq_len` counts a row's `seq_len + 1` tokens; a pair row holds `len`.
    let seq_len = seq_len_or_longest(config, longest + 1, || format!("the longest pair takes {longest} positions"));
    let pad = tokenizer.eos_id().unwrap_or(0);
    let mut rows = Vec::with_capacity(pairs.len());
    for (i, pair) in pairs.iter().enumerate() {
        let row = pair.row(seq_len, pad).ok_or_else(|| DataError::Jsonl {
            path: path.into(),
            line: i + 1,
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
    let held_out_prompt = match &records[records.len() - n_val].prompt {
        Turns::Text(p) => Some(p.clone()),
        Turns::Chat(m) => template.as_ref().and_then(|t| t.render(m, true).ok()),
    };
    Ok(LoadedData {
        tokenizer,
        tokenizer_dir,
        train: Arc::new(PackedExamples::from_rows(rows)),
        val: Arc::new(PackedExamples::from_rows(val)),
        seq_len,
        held_out_prompt,
        prompts: None,
    })
}

/// Prompts for reinforcement learning ([`ember_data::prompts`]), the held-out ones the file's
/// last. Each is a row of its tokens (no targets: the answers are sampled); `train.seq_len` left
/// out is the longest prompt and `max_new_tokens`.
fn load_prompts(config: &TrainConfig, max_new_tokens: usize, file: JsonlFile<'_>) -> Result<LoadedData, TrainError> {
    use ember_data::prompts::{encode_prompts, read_prompt_jsonl};
    let JsonlFile { path, val_fraction, tokenizer, template, tokenizer_dir } = file;
    let records = read_prompt_jsonl(path)?;
    let n_val = held_out(records.len(), val_fraction, path, "prompts")?;
    let mut train = encode_prompts(&records, &tokenizer, template.as_ref())?;
    let longest = train.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let seq_len = config.train.seq_len.unwrap_or(longest + max_new_tokens);
    let val = train.split_off(train.len() - n_val);
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
        prompts: Some(crate::rl::Prompts { train, val, file: path.to_path_buf() }),
        tokenizer,
        tokenizer_dir,
        seq_len,
        held_out_prompt,
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
    let train: Examples = Arc::new(TokenWindows::new(Arc::new(data.train), seq_len, "train")?);
    let val: Examples = Arc::new(TokenWindows::new(Arc::new(data.val), seq_len, "val")?);
    let tokenizer = with_model_eos(data.tokenizer, tokenizer_dir.as_deref());
    Ok(LoadedData { tokenizer, tokenizer_dir, train, val, seq_len, held_out_prompt: None, prompts: None })
}

/// Fine-tuning examples, encoded (chat messages through the model's template) and packed into rows.
fn load_jsonl(config: &TrainConfig, file: JsonlFile<'_>) -> Result<LoadedData, TrainError> {
    let JsonlFile { path, val_fraction, tokenizer, template, tokenizer_dir } = file;
    let records = read_jsonl(path)?;
    let n_val = held_out(records.len(), val_fraction, path, "examples")?;
    let examples = encode(&records, &tokenizer, template.as_ref())?;
    let (train_ex, val_ex) = examples.split_at(examples.len() - n_val);
    let longest = examples.iter().map(|e| e.ids.len()).max().unwrap_or(0);
    let seq_len = seq_len_or_longest(config, longest, || format!("the longest example has {longest} tokens"));
    let packing = Packing { seq_len, mode: config.data.packing(), truncate: config.data.truncate };
    let train = packing.pack(train_ex, &tokenizer, path, 0)?;
    let val = packing.pack(val_ex, &tokenizer, path, train_ex.len())?;
    for (split, set) in [("train", &train), ("val", &val)] {
        if burn::data::dataset::Dataset::len(set) == 0 {
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
    let held_out_prompt = prompt_of(&records[records.len() - n_val], template.as_ref());
    Ok(LoadedData {
        tokenizer,
        tokenizer_dir,
        train: Arc::new(train),
        val: Arc::new(val),
        seq_len,
        held_out_prompt,
        prompts: None,
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
/// and one fewer than all; fewer than 2 records is an error.
fn held_out(n: usize, val_fraction: f64, path: &Path, what: &str) -> Result<usize, TrainError> {
    if n < 2 {
        let message = format!("need at least 2 {what} (train and val)");
        return Err(DataError::Jsonl { path: path.into(), line: n, message }.into());
    }
    Ok(((n as f64 * val_fraction).round() as usize).clamp(1, n - 1))
}

/// What the model reads before the answer of `record`: a chat's messages up to its last user turn
/// through `template`, with the generation prompt; a completion's prompt. `None` for text (no
/// prompt), a chat without a user turn, or a template that fails on the shortened conversation.
fn prompt_of(record: &Record, template: Option<&ChatTemplate>) -> Option<String> {
    match record {
        Record::Text(_) => None,
        Record::Completion { prompt, .. } => Some(prompt.clone()),
        Record::Chat(messages) => {
            let last_user = messages.iter().rposition(|m| m.role == "user")?;
            template?
                .render(&messages[..=last_user], true)
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
    /// Packs `examples` of the file `path`, whose first is example `offset + 1` of the file; an
    /// example too long for a row is an error naming the file and the example.
    pub(crate) fn pack(
        &self,
        examples: &[ember_data::finetune::Example],
        tokenizer: &Tokenizer,
        path: &Path,
        offset: usize,
    ) -> Result<PackedExamples, TrainError> {
        let pad = tokenizer.eos_id().unwrap_or(0);
        PackedExamples::new(examples, self.seq_len, pad, self.mode, self.truncate).map_err(|e| match e {
            DataError::ExampleTooLong { index, tokens, window } => TrainError::Config {
                path: path.into(),
                key: Some("data.truncate".into()),
                message: DataError::ExampleTooLong { index: index + offset, tokens, window }.to_string(),
            },
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
    let examples = encode(&records, tokenizer, template.as_ref())?;
    let packing = Packing { seq_len, mode: ember_data::finetune::Packing::Documents, truncate: false };
    Ok((packing.pack(&examples, tokenizer, path, 0)?, examples.len()))
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
    let data = prepare_cached(&path, &spec, val_fraction, &locations.cache_dir.join("prepared"))?;
    Ok(if split == "train" { data.train.tokens } else { data.val.tokens })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_data::finetune::Message;

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
        let m = |role: &str, content: &str| Message { role: role.into(), content: content.into() };
        let chat = Record::Chat(vec![
            m("system", "Be brief."),
            m("user", "Capital of France?"),
            m("assistant", "Paris."),
            m("user", "And of Italy?"),
            m("assistant", "Rome."),
        ]);
        assert_eq!(
            prompt_of(&chat, Some(&template)).as_deref(),
            Some("<system>Be brief.\n<user>Capital of France?\n<assistant>Paris.\n<user>And of Italy?\n<assistant>")
        );
        let completion = Record::Completion { prompt: "Q: 2+2?\nA:".into(), completion: " 4".into() };
        assert_eq!(prompt_of(&completion, None).as_deref(), Some("Q: 2+2?\nA:"));
        assert_eq!(prompt_of(&Record::Text("plain".into()), None), None);
        assert_eq!(prompt_of(&Record::Chat(vec![m("assistant", "Hi.")]), Some(&template)), None);
    }
}
