//! Streaming detokenization: text deltas that concatenate to exactly the full decode.
//!
//! Decoding tokens one by one is wrong for two reasons: a token can end inside a UTF-8
//! character (byte-level BPE, byte fallback), and SentencePiece decoders strip a leading
//! space only at the start of a text. So each step decodes a short window of recent tokens
//! twice, with and without the new ones, and emits the difference once it is whole.

use super::Tokenizer;
use anyhow::Result;

/// Tokens of context kept in front of the unread ones.
const WINDOW: usize = 6;

pub struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the window that gives new text its context.
    prefix: usize,
    /// First token whose text has not been emitted.
    read: usize,
    skip_special_tokens: bool,
}

impl Detokenizer {
    /// `prompt` gives the first generated tokens their context (leading spaces, merges).
    pub fn new(prompt: &[u32], skip_special_tokens: bool) -> Self {
        let keep = prompt.len().saturating_sub(WINDOW);
        let ids = prompt[keep..].to_vec();
        let n = ids.len();
        Detokenizer { ids, prefix: 0, read: n, skip_special_tokens }
    }

    /// Adds a token; returns the text it completes (empty while a character is still
    /// incomplete).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        let delta = match after.get(before.len()..) {
            Some(d) if !d.is_empty() && !d.ends_with('\u{FFFD}') => d.to_owned(),
            _ => return Ok(String::new()),
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        if self.prefix > 4 * WINDOW {
            self.ids.drain(..self.prefix);
            self.read -= self.prefix;
            self.prefix = 0;
        }
        Ok(delta)
    }

    /// Text held back at the end of generation (an incomplete character), decoded as is.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        self.read = self.ids.len();
        Ok(after.get(before.len()..).unwrap_or("").to_owned())
    }
}
