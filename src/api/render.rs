//! vLLM's render endpoints (`/v1/completions/render`, `/v1/chat/completions/render`): a
//! request checked, templated and tokenized exactly as its generation route does, answered
//! without generating — what a frontend that tokenizes for the engine, or a prefix-aware
//! router (llm-d's precise prefix-cache scorer), asks for. The answer is vLLM's
//! `GenerateRequest`: the token ids and the sampling settings they would run with.

use super::openai::{ChatRequest, CompletionRequest};
use super::ApiError;
use crate::engine::{EngineHandle, Request};
use serde_json::{json, Value};

/// One prompt as the engine would take it.
fn generate_request(request_id: &str, model: &str, r: &Request, stream: bool) -> Value {
    let s = &r.sampling;
    json!({
        "request_id": request_id,
        "token_ids": r.prompt,
        "features": null,
        "sampling_params": {
            "n": r.n,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty,
            "seed": s.seed,
            "max_tokens": r.stop.max_tokens,
            "min_tokens": r.stop.min_tokens,
            "stop": r.stop.stop_strings,
            "stop_token_ids": r.stop.stop_token_ids,
            "ignore_eos": r.stop.ignore_eos,
            "logprobs": s.logprobs,
            "prompt_logprobs": r.prompt_logprobs,
            "skip_special_tokens": r.skip_special_tokens,
        },
        "model": model,
        "stream": stream,
        "cache_salt": r.cache_salt,
        "priority": r.priority,
    })
}

/// `/v1/completions/render`: one `GenerateRequest` per prompt, in a list.
pub async fn completions(engine: &EngineHandle, req: &CompletionRequest, id: &str) -> Result<Value, ApiError> {
    let requests = req.prepare(engine).await?;
    let model = &engine.model().name;
    let one = requests.len() == 1;
    let mut out = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        engine.check(r)?;
        let rid = if one { id.to_string() } else { format!("{id}-{i}") };
        out.push(generate_request(&rid, model, r, req.gen.streaming()));
    }
    Ok(Value::Array(out))
}

/// `/v1/chat/completions/render`: the conversation's `GenerateRequest`.
pub async fn chat(engine: &EngineHandle, req: &ChatRequest, id: &str) -> Result<Value, ApiError> {
    let (r, _) = req.prepare(engine).await?;
    engine.check(&r)?;
    Ok(generate_request(id, &engine.model().name, &r, req.gen.streaming()))
}
