//! Text of generated ids as they come, one id at a time: the detokenizer of `sample`, `chat` and
//! the server's streams.

use crate::error::{DataError, Result};
use crate::tokenizer::Tokenizer;

/// Ids of the prompt kept as left context of a [`DecodeStream`]: enough for a decoder that looks at
/// neighbours (SentencePiece's leading-space strip, a character split over byte tokens) to decode the
/// first new token as it reads after the prompt. vLLM's detokenizer keeps 5 for the same reason.
pub(crate) const STREAM_CONTEXT: usize = 5;

/// New ids a [`DecodeStream`] waits for before it hands out their text even though it still ends in
/// U+FFFD or has not grown: a UTF-8 character spans at most 4 byte tokens, so 8 only gives up on
/// ids that are invalid or decode to nothing (special tokens), and it bounds every decode window.
pub(crate) const STREAM_MAX_PENDING: usize = 8;

/// Text of generated ids, one id at a time, in O(1) decoding work per id.
///
/// Decoding the whole output again for every new id costs O(N²) for N ids, and diffing the new
/// decode against the old breaks on decoders whose output is not a prefix-stable function of the ids
/// (a `Strip` or `Replace` after `Fuse` can make the text of `n + 1` ids shorter than that of `n`).
/// This is the prefix-offset / read-offset scheme of vLLM's detokenizer and Hugging Face's
/// `TextStreamer`: only a window is decoded, `ids[prefix..]`, and the text it adds to `ids[prefix..read]`
/// (already handed out) is the new text. Once new text is handed out the window moves up to the ids
/// just read, so it never holds more than `STREAM_MAX_PENDING` ids past the last read point plus the
/// previous chunk's ids. New text is held back while it ends in U+FFFD (a multi-byte character cut
/// between byte tokens) or has not grown, up to `STREAM_MAX_PENDING` ids.
///
/// For prefix-stable decoders (byte-level BPE, SentencePiece, char-level) the concatenated pieces
/// equal the one-shot [`Tokenizer::decode_skipping_special`] of all the ids. For the others, text
/// already handed out cannot be taken back: the stream hands out what differs from it, and never
/// slices a string off a character boundary.
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    /// The window: ids from the prefix offset on (the ids before it are dropped).
    ids: Vec<u32>,
    /// Ids of `ids` whose text has been handed out (or is the prompt).
    read: usize,
    /// Text of `ids[..read]`, decoded alone.
    prefix_text: String,
    /// Ids passed to the tokenizer's decoder so far: the cost, which tests check is linear.
    decoded_ids: usize,
}

impl Tokenizer {
    /// An incremental decoder for the ids that follow `context` (a prompt, or nothing): see
    /// [`DecodeStream`]. Special tokens (`<|im_end|>`, `</s>`) decode to nothing.
    pub fn decode_stream(&self, context: &[u32]) -> DecodeStream<'_> {
        DecodeStream::new(self, context)
    }
}

impl<'a> DecodeStream<'a> {
    fn new(tokenizer: &'a Tokenizer, context: &[u32]) -> Self {
        let ids = context[context.len().saturating_sub(STREAM_CONTEXT)..].to_vec();
        let mut stream = Self { tokenizer, read: ids.len(), ids, prefix_text: String::new(), decoded_ids: 0 };
        // A prompt that does not decode leaves no context: the first ids then read as a start of text.
        match stream.decode_window(stream.read) {
            Ok(text) => stream.prefix_text = text,
            Err(_) => {
                stream.ids.clear();
                stream.read = 0;
            }
        }
        stream
    }

    /// Adds an id; returns the text that is now final (often empty while a character is incomplete).
    pub fn step(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.decode_window(self.ids.len())?;
        let pending = self.ids.len() - self.read;
        if (text.len() > self.prefix_text.len() && !text.ends_with('\u{fffd}')) || pending >= STREAM_MAX_PENDING {
            self.advance(text)
        } else {
            Ok(String::new())
        }
    }

    /// The text of ids still held back (an incomplete character, as U+FFFD), once the ids are over.
    pub fn finish(&mut self) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let text = self.decode_window(self.ids.len())?;
        self.advance(text)
    }

    /// Ids decoded so far, all windows together.
    pub fn decoded_ids(&self) -> usize {
        self.decoded_ids
    }

    /// Hands out what `text` (the decode of the whole window) adds to the prefix text, and moves the
    /// window to start at the ids just read.
    fn advance(&mut self, text: String) -> Result<String> {
        let new = match text.strip_prefix(self.prefix_text.as_str()) {
            Some(rest) => rest.to_string(),
            // The decoder rewrote the prefix text: hand out what differs from it, from a character
            // boundary of both (the common prefix is measured in whole characters).
            None => {
                let common: usize = text
                    .chars()
                    .zip(self.prefix_text.chars())
                    .take_while(|(a, b)| a == b)
                    .map(|(a, _)| a.len_utf8())
                    .sum();
                text[common..].to_string()
            }
        };
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.prefix_text = self.decode_window(self.read)?;
        Ok(new)
    }

    /// The text of `ids[..end]`.
    ///
    /// The `tokenizers` crate's `Strip` decoder panics on short texts made only of the stripped
    /// character (`stop` past the start of the text; `start + stop` past its end), and a window is
    /// often such a text: the panic is caught here and becomes an error naming the ids, so that a
    /// user's tokenizer.json cannot take down `ember sample` or a training run's evaluation sample.
    /// An empty window is the empty text without calling the decoder at all.
    fn decode_window(&mut self, end: usize) -> Result<String> {
        if end == 0 {
            return Ok(String::new());
        }
        self.decoded_ids += end;
        let ids = &self.ids[..end];
        let tokenizer = self.tokenizer;
        std::panic::catch_unwind(|| tokenizer.decode_skipping_special(ids)).unwrap_or_else(|_| {
            Err(DataError::Tokenizer(format!("decoding ids {ids:?}: the tokenizer's decoder panicked")))
        })
    }
}
