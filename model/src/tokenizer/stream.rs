//! Incremental detokenization for streaming generated text.

use super::{Tokenizer, TokenizerError};

const REPLACEMENT_CHARACTER: char = '\u{FFFD}';

/// Turns ids pushed one at a time into text pieces whose concatenation equals decoding all ids
/// at once.
///
/// A token can end inside a multi-byte character (byte-level BPE splits emoji and CJK across
/// tokens); such a tail decodes to U+FFFD, so text is held back until a later token completes
/// it. Each step re-decodes only the ids since the last emitted piece, plus those of that piece
/// as context (decoders such as SentencePiece's drop a leading space only at the very start).
/// Call [`DecodeStream::finish`] at the end to flush text that was held back, e.g. when the
/// output really ends in an invalid byte sequence.
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    /// Context ids (already emitted) followed by pending ids (not yet emitted).
    ids: Vec<u32>,
    /// How many leading entries of `ids` are context.
    context_len: usize,
    /// Decoding of the context ids alone.
    context_text: String,
}

impl<'a> DecodeStream<'a> {
    pub(super) fn new(tokenizer: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            context_len: 0,
            context_text: String::new(),
        }
    }

    /// Adds one id; returns the new text when it ends on a complete character.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        self.tokenizer.check_ids(&[id])?;
        self.ids.push(id);
        let text = self.decode_window()?;
        if text.ends_with(REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        self.take_new_text(text)
    }

    /// Ends the stream, returning any text still held back.
    pub fn finish(mut self) -> Result<Option<String>, TokenizerError> {
        if self.ids.len() == self.context_len {
            return Ok(None);
        }
        let text = self.decode_window()?;
        self.take_new_text(text)
    }

    fn decode_window(&self) -> Result<String, TokenizerError> {
        self.tokenizer.decode(&self.ids, self.skip_special_tokens)
    }

    fn take_new_text(&mut self, text: String) -> Result<Option<String>, TokenizerError> {
        if text.len() <= self.context_text.len() {
            // Nothing visible yet (e.g. a skipped special token): keep the id pending.
            return Ok(None);
        }
        let Some(new_text) = text.strip_prefix(self.context_text.as_str()) else {
            return Err(TokenizerError::Decode(format!(
                "incremental decoding diverged: {text:?} does not extend {:?}",
                self.context_text
            )));
        };
        let new_text = new_text.to_string();
        // The ids just emitted become the context of the next step.
        self.ids.drain(..self.context_len);
        self.context_len = self.ids.len();
        self.context_text = self.decode_window()?;
        Ok(Some(new_text))
    }
}
