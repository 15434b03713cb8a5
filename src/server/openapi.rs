//! The OpenAPI 3.1 description served at `/openapi.json`.

use serde_json::{json, Value};

fn body(schema: Value) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": schema}}})
}

fn ok(description: &str, schema: Value) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": schema}}})
}

fn errors() -> Value {
    let e = json!({"$ref": "#/components/schemas/Error"});
    json!({"400": ok("Invalid request", e.clone()), "401": ok("Missing or wrong API key", e.clone()),
        "413": ok("Body too large", e.clone()), "429": ok("Overloaded; see Retry-After", e.clone()),
        "503": ok("Loading or shutting down; see Retry-After", e.clone()), "504": ok("Request timed out", e)})
}

fn op(summary: &str, req: Option<Value>, resp: Value, streams: bool) -> Value {
    let mut responses = errors();
    let mut ok200 = ok("Success", resp);
    if streams {
        ok200["content"]["text/event-stream"] = json!({"schema": {"type": "string", "description": "Server-sent events when `stream` is true, ending with `data: [DONE]`"}});
    }
    responses["200"] = ok200;
    let mut o = json!({"summary": summary, "responses": responses});
    if let Some(r) = req {
        o["requestBody"] = body(r);
    }
    o
}

pub fn document() -> Value {
    let num = json!({"type": "number"});
    let int = json!({"type": "integer", "minimum": 0});
    let sampling = json!({
        "model": {"type": "string"}, "max_tokens": int, "temperature": num, "top_p": num, "n": int,
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "stream": {"type": "boolean"}, "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"},
            "continuous_usage_stats": {"type": "boolean"}}},
        "seed": int, "presence_penalty": num, "frequency_penalty": num,
        "logit_bias": {"type": "object", "additionalProperties": num}, "user": {"type": "string"},
        "top_k": {"type": "integer"}, "min_p": num, "repetition_penalty": num, "ignore_eos": {"type": "boolean"},
        "stop_token_ids": {"type": "array", "items": int}, "priority": {"type": "integer"},
        "skip_special_tokens": {"type": "boolean"}, "cache_salt": {"type": "string"},
        "response_format": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": {"type": "object"}}},
        "structured_outputs": {"type": "object"}, "guided_json": {}, "guided_regex": {"type": "string"},
        "guided_choice": {"type": "array", "items": {"type": "string"}}, "guided_grammar": {"type": "string"},
        "prompt_logprobs": int, "min_tokens": int, "include_stop_str_in_output": {"type": "boolean"},
        "truncate_prompt_tokens": {"type": "integer"}, "return_token_ids": {"type": "boolean"}
    });
    let mut completion = sampling.clone();
    completion["prompt"] = json!({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": int}, {"type": "array", "items": {"type": "array", "items": int}}]});
    completion["logprobs"] = int.clone();
    completion["echo"] = json!({"type": "boolean"});
    completion["best_of"] = int.clone();
    let mut chat = sampling;
    chat["messages"] = json!({"type": "array", "items": {"type": "object", "required": ["role"],
        "properties": {"role": {"type": "string"}, "content": {"type": ["string", "array", "null"]}, "name": {"type": "string"},
            "tool_calls": {"type": "array"}, "tool_call_id": {"type": "string"}}}});
    chat["tools"] = json!({"type": "array", "items": {"type": "object"}});
    chat["tool_choice"] = json!({"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]});
    chat["parallel_tool_calls"] = json!({"type": "boolean"});
    chat["chat_template_kwargs"] = json!({"type": "object"});
    chat["logprobs"] = json!({"type": "boolean"});
    chat["top_logprobs"] = int.clone();
    chat["max_completion_tokens"] = int.clone();
    let native = json!({"max_tokens": int, "temperature": num, "top_p": num, "top_k": {"type": "integer"}, "seed": int,
        "stop": {"type": "array", "items": {"type": "string"}}, "stream": {"type": "boolean"}, "ignore_eos": {"type": "boolean"}});
    let mut generate = native.clone();
    generate["prompt"] = json!({"type": "string"});
    let mut batch = native;
    batch["prompts"] = json!({"type": "array", "items": {"type": "string"}});
    let obj = |props: Value, required: &[&str]| json!({"type": "object", "properties": props, "required": required, "additionalProperties": false});
    let result = json!({"type": "object", "properties": {"text": {"type": "string"}, "finish_reason": {"type": "string"},
        "usage": {"$ref": "#/components/schemas/Usage"}, "time_seconds": num}});
    json!({
        "openapi": "3.1.0",
        "info": {"title": "weft", "version": env!("CARGO_PKG_VERSION"), "description": "A continuous-batching LLM inference server."},
        "paths": {
            "/v1/completions": {"post": op("OpenAI completions", Some(obj(completion.clone(), &["prompt"])), json!({"type": "object"}), true)},
            "/v1/chat/completions": {"post": op("OpenAI chat completions", Some(obj(chat.clone(), &["messages"])), json!({"type": "object"}), true)},
            "/v1/completions/render": {"post": op("vLLM's render: the prompts' token ids and sampling settings, checked as /v1/completions does, without generating",
                Some(obj(completion.clone(), &["prompt"])), json!({"type": "array"}), false)},
            "/v1/chat/completions/render": {"post": op("vLLM's render: the templated conversation's token ids, checked as /v1/chat/completions does, without generating",
                Some(obj(chat.clone(), &["messages"])), json!({"type": "object"}), false)},
            "/v1/responses": {"post": op("OpenAI Responses API (function tools, previous_response_id, streamed as typed events)",
                Some(json!({"type": "object", "required": ["input"], "properties": {"input": {"type": ["string", "array"]},
                    "instructions": {"type": "string"}, "tools": {"type": "array"}, "tool_choice": {}, "text": {"type": "object"},
                    "max_output_tokens": int, "temperature": num, "top_p": num, "stream": {"type": "boolean"},
                    "store": {"type": "boolean"}, "previous_response_id": {"type": "string"}}})),
                json!({"type": "object"}), true)},
            "/v1/responses/{id}": {"get": op("A stored response (404 once expired or deleted)", None, json!({"type": "object"}), false),
                "delete": op("Forget a stored response", None, json!({"type": "object"}), false)},
            "/v1/messages": {"post": op("Anthropic Messages API (errors in Anthropic's shape; x-api-key accepted)",
                Some(json!({"type": "object", "required": ["messages", "max_tokens"], "properties": {
                    "messages": {"type": "array"}, "system": {"type": ["string", "array"]}, "max_tokens": int,
                    "tools": {"type": "array"}, "tool_choice": {"type": "object"}, "stop_sequences": {"type": "array"},
                    "temperature": num, "top_p": num, "top_k": int, "stream": {"type": "boolean"}, "thinking": {"type": "object"}}})),
                json!({"type": "object"}), true)},
            "/v1/messages/count_tokens": {"post": op("The prompt's length in tokens, as /v1/messages renders it",
                Some(json!({"type": "object", "required": ["messages"]})),
                json!({"type": "object", "properties": {"input_tokens": int}}), false)},
            "/v1/embeddings": {"post": op("OpenAI embeddings, pooled as the model says and L2-normalised",
                Some(json!({"type": "object", "required": ["input"], "properties": {"input": {}, "model": {"type": "string"},
                    "encoding_format": {"enum": ["float", "base64"]}, "dimensions": int, "truncate_prompt_tokens": int}})),
                json!({"type": "object"}), false)},
            "/v1/models": {"get": op("The served model", None, json!({"type": "object"}), false)},
            "/v1/models/{id}": {"get": op("The model, under any name it is served as (404 otherwise)", None, json!({"type": "object"}), false)},
            "/version": {"get": op("The server's version", None, json!({"type": "object"}), false)},
            "/tokenize": {"post": op("Text, or chat messages as the chat endpoint renders them, to token ids",
                Some(obj(json!({"model": {"type": "string"}, "prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"},
                    "messages": {"type": "array", "items": {"type": "object"}}, "add_generation_prompt": {"type": "boolean"},
                    "chat_template_kwargs": {"type": "object"}}), &[])),
                json!({"type": "object", "properties": {"tokens": {"type": "array", "items": int}, "count": int, "max_model_len": int}}), false)},
            "/detokenize": {"post": op("Token ids to text", Some(obj(json!({"model": {"type": "string"}, "tokens": {"type": "array", "items": int}}), &["tokens"])),
                json!({"type": "object", "properties": {"prompt": {"type": "string"}}}), false)},
            "/generate": {"post": op("Generate from one prompt", Some(obj(generate, &["prompt"])), result.clone(), true)},
            "/generate/batch": {"post": op("Generate from many prompts, batched together", Some(obj(batch, &["prompts"])),
                json!({"type": "object", "properties": {"results": {"type": "array", "items": result}, "total_prompts": int,
                    "total_time_seconds": num, "avg_time_per_prompt": num}}), false)},
            "/health": {"get": {"summary": "200 once the model is loaded and warmed up; 503 while loading or shutting down",
                "responses": {"200": {"description": "Ready"}, "503": {"description": "Not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (weft: prefix, vLLM names)",
                "responses": {"200": {"description": "Text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3.1"}}}}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
                    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
                "Usage": {"type": "object", "properties": {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int,
                    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": int}}}}
            }
        },
        "security": [{"bearer": []}, {}]
    })
}
