//! Structured output: a request's constraint (a JSON schema, a regular expression, a list of
//! choices, a Lark grammar) compiled by llguidance into a matcher that says, before each
//! token, which tokens keep the output inside the grammar. The compiler is built once per
//! model (its token trie is the costly part); each sequence owns a matcher.

use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, bail, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;

/// The set of tokens a constrained sequence may take next (one bit per token id; ids past
/// the tokenizer's vocabulary are never allowed).
pub type TokenMask = SimpleVob;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    JsonSchema(Value),
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// llguidance's Lark dialect (vLLM's `guided_grammar`).
    Lark(String),
}

impl Grammar {
    fn top_level(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(bounded_whitespace(s.clone())),
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(bounded_whitespace(json!({"type": "object"}))),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Choice(choices) => {
                if choices.is_empty() {
                    bail!("the list of choices is empty");
                }
                // Lark string literals take JSON's escapes.
                let alts: Vec<String> = choices.iter().map(|c| Value::from(c.as_str()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// Whitespace between JSON tokens, as llama.cpp's schema grammars allow it: one space, or one or
/// two line breaks and at most 20 spaces or tabs of indentation. Pretty-printed JSON fits; runs
/// of blank lines do not (a small model that likes newlines would otherwise spend `max_tokens`
/// on them, grammar or not). A schema with its own `x-guidance` options keeps them.
fn bounded_whitespace(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    schema
}

const JSON_WHITESPACE: &str = r"\x20|(\x0D?\x0A){1,2}[\x20\x09]{0,20}";

/// Compiles grammars against one model's vocabulary.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl GrammarCompiler {
    /// Builds the token trie from the tokenizer's vocabulary (each token's bytes; special
    /// tokens marked so that text can never produce them). Its end-of-sequence tokens are
    /// the model's EOS ids, which the mask allows wherever the grammar may end.
    pub fn new(tok: &Tokenizer) -> Result<Self> {
        let Some(&eos) = tok.eos_ids.first() else {
            bail!("this model has no end-of-sequence token, which structured output needs to end");
        };
        let words = llguidance::token_bytes_from_tokenizer_json(&tok.to_json()?)?;
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&tok.eos_ids);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(GrammarCompiler { factory })
    }

    /// A fresh matcher for `grammar`; an error says what is wrong with the grammar.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint> {
        let parser = self.factory.create_parser(grammar.top_level()?)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            bail!("{e}");
        }
        Ok(Constraint { matcher })
    }
}

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
}

impl Constraint {
    /// The tokens allowed next: only EOS once the grammar is complete.
    pub fn allowed(&mut self) -> Result<TokenMask> {
        let mask = self.matcher.compute_mask_or_eos()?;
        if mask.is_zero() {
            return Err(anyhow!("the grammar allows no token here"));
        }
        Ok(mask)
    }

    /// Advances past a sampled token.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token)
    }

    /// The output is complete: the grammar allows nothing more.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// A copy that goes on independently (a request's prototype, cloned for each sample).
impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint { matcher: self.matcher.deep_clone() }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("done", &self.is_done()).finish()
    }
}
