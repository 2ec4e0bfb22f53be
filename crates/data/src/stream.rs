//! Text of a growing sequence for streaming: decoded incrementally, cut at stop strings, with the
//! tail that could still begin a stop string held back until it is known not to.

use crate::detokenize::DecodeStream;
use crate::tokenizer::Tokenizer;
use crate::DataError;

/// The text of one sequence as it grows: decoded incrementally (O(1) work per token, whatever the
/// tokenizer's decoder does), with the tail that could still be the start of a stop string held back.
pub struct TextStream<'a> {
    decoder: DecodeStream<'a>,
    /// Ids that end the sequence (end of text, end of turn); never printed.
    ends: Vec<u32>,
    stops: Vec<String>,
    /// Decoded text not handed out yet: the longest tail that is a prefix of some stop string.
    held: String,
    /// The sequence is over (end-of-text, a stop string, or a decoding error); nothing more comes out.
    stopped: bool,
    error: Option<DataError>,
}

impl<'a> TextStream<'a> {
    /// A stream for the tokens after `prompt`, which is the decoder's left context.
    pub fn new(tokenizer: &'a Tokenizer, prompt: &[u32], stops: Vec<String>, ends: &[u32]) -> Self {
        Self {
            decoder: tokenizer.decode_stream(prompt),
            ends: ends.to_vec(),
            stops,
            held: String::new(),
            stopped: false,
            error: None,
        }
    }

    /// Adds a token; returns the text that is now final, and whether the sequence is over.
    pub fn push(&mut self, id: u32) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        if self.ends.contains(&id) {
            return (self.finish(), true);
        }
        match self.decoder.step(id) {
            Ok(chunk) => {
                let out = self.accept(&chunk, false);
                (out, self.stopped)
            }
            Err(e) => {
                self.error = Some(e);
                self.stopped = true;
                (std::mem::take(&mut self.held), true)
            }
        }
    }

    /// The rest, once the sequence is over: held-back text and an incomplete last character.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return std::mem::take(&mut self.held);
        }
        let out = match self.decoder.finish() {
            Ok(chunk) => self.accept(&chunk, true),
            Err(e) => {
                self.error = Some(e);
                std::mem::take(&mut self.held)
            }
        };
        self.stopped = true;
        out
    }

    /// Appends decoded text; returns what can be handed out. Only the held tail (shorter than the
    /// longest stop string) and the new chunk are searched, so stops cost O(1) per token too; a stop
    /// string cannot start in text already handed out, since that text was not a prefix of one.
    fn accept(&mut self, chunk: &str, last: bool) -> String {
        self.held.push_str(chunk);
        if let Some(cut) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.held.truncate(cut);
            self.stopped = true;
            return std::mem::take(&mut self.held);
        }
        if last {
            return std::mem::take(&mut self.held);
        }
        let held = &self.held;
        let keep_from = held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&held[i..])))
            .unwrap_or(held.len());
        let rest = self.held.split_off(keep_from);
        std::mem::replace(&mut self.held, rest)
    }

    /// The decoding error that ended the sequence, if one did (taken: asked once).
    pub fn take_error(&mut self) -> Option<DataError> {
        self.error.take()
    }

    /// Whether the sequence is over.
    pub fn stopped(&self) -> bool {
        self.stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Tokenizer {
        Tokenizer::train_char("abcdefgh xyz.")
    }

    fn ids(t: &Tokenizer, s: &str) -> Vec<u32> {
        t.encode(s).unwrap()
    }

    /// Everything a stream hands out for `text`, token by token, and whether it stopped early.
    fn run(t: &Tokenizer, text: &str, stops: &[&str]) -> (Vec<String>, bool) {
        let mut stream = TextStream::new(t, &[], stops.iter().map(|s| s.to_string()).collect(), &[]);
        let mut out = Vec::new();
        for id in ids(t, text) {
            let (chunk, done) = stream.push(id);
            out.push(chunk);
            if done {
                return (out, true);
            }
        }
        out.push(stream.finish());
        (out, false)
    }

    #[test]
    fn text_is_cut_at_the_first_stop_string_and_held_back_only_while_it_could_start_one() {
        let t = tokenizer();
        let (chunks, stopped) = run(&t, "abc xyz def", &["xyz"]);
        assert!(stopped);
        assert_eq!(chunks.concat(), "abc ");
        // "x" could begin "xyz": held back until the stop is seen, never handed out.
        assert!(chunks.iter().all(|c| !c.contains('x')), "{chunks:?}");
        let (chunks, stopped) = run(&t, "abc xa", &["xyz"]);
        assert!(!stopped);
        assert_eq!(chunks.concat(), "abc xa", "a false start is released");
        let (chunks, _) = run(&t, "hgf. abc", &[".", "fe"]);
        assert_eq!(chunks.concat(), "hgf");
    }

    #[test]
    fn an_end_id_ends_the_stream_and_is_never_printed() {
        let t = tokenizer();
        let end = ids(&t, "z")[0];
        let mut stream = TextStream::new(&t, &[], vec![], &[end]);
        let mut text = String::new();
        for id in ids(&t, "abzcd") {
            let (chunk, done) = stream.push(id);
            text.push_str(&chunk);
            if done {
                break;
            }
        }
        assert_eq!(text, "ab");
        assert!(stream.stopped() && stream.take_error().is_none());
    }
}
