//! Caps on every request size a client controls, checked before a request enters the
//! engine, so that no single request can make a step slow or memory grow without bound.

/// Per-request caps; each has a command-line flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Samples per request (`n`).
    pub max_n: usize,
    /// Stop strings per request.
    pub max_stop_strings: usize,
    /// Bytes in one stop string.
    pub max_stop_string_bytes: usize,
    /// Entries in `stop_token_ids`.
    pub max_stop_token_ids: usize,
    /// Entries in `logit_bias`.
    pub max_logit_bias: usize,
    /// Alternatives per token in `logprobs` / `top_logprobs` (OpenAI allows 20).
    pub max_logprobs: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_n: 32,
            max_stop_strings: 16,
            max_stop_string_bytes: 256,
            max_stop_token_ids: 64,
            max_logit_bias: 300,
            max_logprobs: 20,
        }
    }
}
