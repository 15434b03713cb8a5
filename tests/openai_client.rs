//! The drop-in items through a real client (async-openai), as a user switching base URLs
//! would meet them: served names and the models API, fields weft ignores, tool calls
//! streamed and sent back, and scored prompts (echo + logprobs + max_tokens 0).

mod common;

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::{
    ChatCompletionMessageToolCall, ChatCompletionMessageToolCalls, ChatCompletionRequestAssistantMessageArgs,
    ChatCompletionRequestMessage, ChatCompletionRequestToolMessageArgs, ChatCompletionRequestUserMessageArgs,
    ChatCompletionTool, ChatCompletionToolChoiceOption, ChatCompletionTools, CreateChatCompletionRequest,
    CreateChatCompletionRequestArgs, FinishReason, FunctionCall, FunctionObject, PredictionContent,
    PredictionContentContent, ReasoningEffort, ServiceTier, ToolChoiceOptions,
};
use async_openai::types::completions::CreateCompletionRequestArgs;
use async_openai::Client;
use common::server::Server;
use common::weather_schema as weather;
use serde_json::{json, Value};
use tokio_stream::StreamExt;

fn user(text: &str) -> ChatCompletionRequestMessage {
    ChatCompletionRequestUserMessageArgs::default().content(text).build().unwrap().into()
}

fn tool_request(messages: Vec<ChatCompletionRequestMessage>) -> CreateChatCompletionRequest {
    let tool = ChatCompletionTools::Function(ChatCompletionTool {
        function: FunctionObject {
            name: "get_weather".into(),
            description: Some("Weather in a city".into()),
            parameters: Some(weather()),
            strict: Some(true),
        },
    });
    CreateChatCompletionRequestArgs::default()
        .model("qwen-tiny")
        .messages(messages)
        .tools(vec![tool])
        .tool_choice(ChatCompletionToolChoiceOption::Mode(ToolChoiceOptions::Required))
        .parallel_tool_calls(false)
        .max_tokens(200u32)
        .seed(5)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_drop_in() {
    if common::shared_models().is_none() {
        return;
    }
    let s = Server::start("tiny-qwen2", &["--served-model-name", "qwen-tiny", "gpt-4o-mini"]).await;
    let client = Client::with_config(OpenAIConfig::new().with_api_base(format!("{}/v1", s.base)));

    // Served names: listed, retrievable, accepted; another model is OpenAI's 404.
    let models = client.models().list().await.unwrap();
    assert_eq!(models.data[0].id, "qwen-tiny");
    assert_eq!(client.models().retrieve("gpt-4o-mini").await.unwrap().id, "gpt-4o-mini");
    let mut wrong = tool_request(vec![user("Hi")]);
    wrong.model = "gpt-5".into();
    match client.chat().create(wrong).await {
        Err(OpenAIError::ApiError(e)) => {
            assert_eq!((e.status_code.as_u16(), e.api_error.code.as_deref()), (404, Some("model_not_found")))
        }
        other => panic!("expected a 404: {other:?}"),
    }

    // Fields that mean nothing here are accepted and ignored.
    let plain = CreateChatCompletionRequestArgs::default()
        .model("gpt-4o-mini")
        .messages(vec![user("Hi")])
        .max_tokens(3u32)
        .store(true)
        .metadata(json!({"team": "a"}))
        .service_tier(ServiceTier::Auto)
        .reasoning_effort(ReasoningEffort::Low)
        .prediction(PredictionContent::Content(PredictionContentContent::Text("Hello".into())))
        .build()
        .unwrap();
    let resp = client.chat().create(plain).await.unwrap();
    assert_eq!(resp.usage.unwrap().completion_tokens, 3);

    // Tool calls, streamed: the first chunk of a call carries its id and name, the arguments
    // follow in pieces; put together they equal the unstreamed answer.
    let req = tool_request(vec![user("Weather in Oslo?")]);
    let whole = client.chat().create(req.clone()).await.unwrap();
    assert_eq!(whole.choices[0].finish_reason, Some(FinishReason::ToolCalls));
    let Some(ChatCompletionMessageToolCalls::Function(call)) =
        whole.choices[0].message.tool_calls.as_ref().and_then(|c| c.first())
    else {
        panic!("no call: {whole:?}");
    };
    assert_eq!(call.function.name, "get_weather");
    let args: Value = serde_json::from_str(&call.function.arguments).unwrap();
    assert!(jsonschema::validator_for(&weather()).unwrap().is_valid(&args), "{args}");
    let mut stream = client.chat().create_stream(req).await.unwrap();
    let (mut id, mut name, mut arguments, mut pieces, mut finish) = (None, None, String::new(), 0, None);
    while let Some(chunk) = stream.next().await {
        for c in chunk.unwrap().choices {
            for d in c.delta.tool_calls.unwrap_or_default() {
                assert_eq!(d.index, 0);
                id = id.or(d.id);
                let f = d.function.unwrap();
                name = name.or(f.name);
                let piece = f.arguments.unwrap_or_default();
                pieces += usize::from(!piece.is_empty());
                arguments += &piece;
            }
            finish = finish.or(c.finish_reason);
        }
    }
    assert_eq!(finish, Some(FinishReason::ToolCalls));
    assert_eq!((name.as_deref(), arguments.as_str()), (Some("get_weather"), call.function.arguments.as_str()));
    assert!(pieces > 1 && id.is_some(), "{pieces} argument pieces, id {id:?}");
    let args: Value = serde_json::from_str(&arguments).unwrap();
    assert!(jsonschema::validator_for(&weather()).unwrap().is_valid(&args), "{args}");

    // The call and its result go back as the SDK builds them (assistant content absent).
    let assistant = ChatCompletionRequestAssistantMessageArgs::default()
        .tool_calls(vec![ChatCompletionMessageToolCalls::Function(ChatCompletionMessageToolCall {
            id: call.id.clone(),
            function: FunctionCall { name: "get_weather".into(), arguments: call.function.arguments.clone() },
        })])
        .build()
        .unwrap();
    let result = ChatCompletionRequestToolMessageArgs::default()
        .content("{\"temp\": 3}")
        .tool_call_id(call.id.clone())
        .build()
        .unwrap();
    let mut follow = tool_request(vec![user("Weather in Oslo?"), assistant.into(), result.into()]);
    follow.tool_choice = Some(ChatCompletionToolChoiceOption::Mode(ToolChoiceOptions::None));
    follow.max_completion_tokens = Some(4);
    let resp = client.chat().create(follow).await.unwrap();
    assert!(resp.usage.unwrap().prompt_tokens > whole.usage.unwrap().prompt_tokens);

    // lm-evaluation-harness's scoring request: the prompt's logprobs, nothing generated.
    let score = CreateCompletionRequestArgs::default()
        .model("qwen-tiny")
        .prompt("Paris is the capital of France.")
        .echo(true)
        .logprobs(1u8)
        .max_tokens(0u32)
        .build()
        .unwrap();
    let resp = client.completions().create(score).await.unwrap();
    let lp = resp.choices[0].logprobs.as_ref().unwrap();
    assert!(lp.token_logprobs[0].is_none() && lp.token_logprobs.len() > 3);
    assert!(lp.token_logprobs[1..].iter().all(|x| x.is_some_and(|x| x <= 0.0)));
    assert_eq!(lp.tokens.concat(), "Paris is the capital of France.");
    assert_eq!(resp.usage.unwrap().completion_tokens, 0);
    s.assert_idle().await;
}
