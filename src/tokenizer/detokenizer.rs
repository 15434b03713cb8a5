//! Streaming detokenization: text deltas that concatenate to exactly the full decode.
//!
//! Decoding tokens one by one is wrong for three reasons: a token can end inside a UTF-8
//! character (byte-level BPE, byte fallback); SentencePiece decoders strip a leading space
//! only at the start of a text; and a byte-fallback decoder turns a whole run of byte
//! tokens into U+FFFD when the run is not valid UTF-8, so a byte that decoded as a letter
//! can become U+FFFD when the next byte arrives. So each step decodes a short window of
//! recent tokens twice, with and without the new ones, and emits the difference once it is
//! whole and no run of byte tokens is still open.

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
        if tok.is_byte_token(id) {
            return Ok(String::new());
        }
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        let delta = after_common_prefix(&before, &after);
        if delta.is_empty() || delta.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = delta.to_owned();
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
        Ok(after_common_prefix(&before, &after).to_owned())
    }
}

/// `after` past `before`. (Should the decoder ever rewrite text already emitted, this goes
/// on from where the two agree, so the stream never stalls.)
fn after_common_prefix<'a>(before: &str, after: &'a str) -> &'a str {
    if let Some(rest) = after.strip_prefix(before) {
        return rest;
    }
    let common: usize = before.chars().zip(after.chars()).take_while(|(a, b)| a == b).map(|(a, _)| a.len_utf8()).sum();
    &after[common..]
}
