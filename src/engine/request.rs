//! What goes into the engine and what comes back out.

use crate::grammar::Constraint;
use crate::sampling::{PromptLogprob, SamplingParams, StopCondition, TokenLogprob};

/// A generation request, already tokenized.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopCondition,
    /// Independent samples; they share the prompt's KV blocks.
    pub n: usize,
    /// Lower runs first.
    pub priority: i32,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
    /// Requests with different salts never share cached KV blocks (tenant isolation).
    pub cache_salt: Option<String>,
    /// Structured output: the grammar every sample's text must follow (a fresh matcher,
    /// which each sample copies).
    pub constraint: Option<Constraint>,
    /// Score the prompt: each prompt token's log-probability (after the first) with this
    /// many alternatives, from the prefill's own rows.
    pub prompt_logprobs: Option<usize>,
    /// Generate nothing: answer the prompt's embedding, pooled as the model says (the last
    /// token's when it says nothing) from the final hidden states, L2-normalised.
    pub embed: bool,
}

impl Request {
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Request {
            prompt,
            sampling: SamplingParams::default(),
            stop: StopCondition { max_tokens, ..Default::default() },
            n: 1,
            priority: 0,
            skip_special_tokens: true,
            cache_salt: None,
            constraint: None,
            prompt_logprobs: None,
            embed: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Cancelled by the client.
    Abort,
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache instead of being computed.
    pub cached_tokens: usize,
}

impl Usage {
    /// Adds a finished sample of the same request: its prompt counts once, completions add up.
    pub fn add_sample(&mut self, sample: &Usage) {
        self.prompt_tokens = sample.prompt_tokens;
        self.cached_tokens = self.cached_tokens.max(sample.cached_tokens);
        self.completion_tokens += sample.completion_tokens;
    }

    /// Adds another request's usage (the prompts of one multi-prompt call).
    pub fn add_request(&mut self, other: &Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
        self.completion_tokens += other.completion_tokens;
    }
}

/// One step of a request's progress. `index` tells the samples of an `n > 1` request apart.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token {
        index: usize,
        id: u32,
        /// Text this token completes (may be empty: a partial character or held-back stop text).
        text: String,
        logprobs: Option<(TokenLogprob, Vec<TokenLogprob>)>,
        /// Prompt tokens of this sample found in the prefix cache (as its final usage says).
        cached_tokens: usize,
    },
    /// Scores of prompt tokens (`prompt_logprobs`), in order, starting with the second
    /// token; they come before the request's first token.
    PromptLogprobs { logprobs: Vec<PromptLogprob> },
    /// A sample ended; `text` is output held back until now (for example before a stop
    /// string that did not complete); `stop` the stop string that ended it, if one did.
    /// After the last sample's event the stream closes.
    Finished { index: usize, reason: FinishReason, text: String, usage: Usage, stop: Option<String> },
    /// An embedding request's vector; its `Finished` follows.
    Embedding { vector: Vec<f32> },
    /// The request failed as a whole; the stream closes.
    Error { message: String },
}
