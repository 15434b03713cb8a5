#!/usr/bin/env python3
"""weft driven from outside by the clients people use: the official `openai` SDK (chat,
completions, embeddings, the Responses API streamed and not, tools, previous_response_id), the
`anthropic` SDK (messages streamed and not, a tool-use round trip, count_tokens) and
LangChain (bind_tools, with_structured_output by function calling, the Responses API), on
SmolLM2 (no tool format in its template: weft's own) and tiny-qwen2 (Hermes tools).

Run by .ci/run in a virtual environment made from scripts/clients-requirements.txt:
    python scripts/clients.py --weft target/release/weft
Prints a table client x scenario per model; exits non-zero if any scenario failed.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import anthropic
import jsonschema
import openai
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

MODELS = os.environ.get("WEFT_SHARED_MODELS", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models"))
FIXTURES = {
    "smollm2": "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    "tiny-qwen2": "tiny-qwen2",
}

WEATHER = {
    "type": "object",
    # Bounded, so that a random-weight model's call always closes within max_tokens.
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": WEATHER}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                  "parameters": WEATHER, "strict": True}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}


class Weather(BaseModel):
    """Weather in a city."""

    # additionalProperties: false, so that a sampled call cannot grow extra keys until
    # max_tokens (the schema allows them otherwise, and the grammar with it).
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=24)
    unit: str = Field(pattern="^[cf]$")


def start(weft, model):
    """`weft serve` on a free port; returns (process, base url)."""
    path = os.path.join(MODELS, FIXTURES[model])
    if not os.path.exists(path):
        sys.exit(f"missing fixture {path}")
    proc = subprocess.Popen([weft, "serve", "--port", "0", "--kv-cache-memory", "256M", "--model", path],
                            stderr=subprocess.PIPE, text=True)
    base = None
    for line in proc.stderr:
        m = re.match(r"weft: listening on (\S+)", line)
        if m:
            base = m.group(1)
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health") as r:
                if r.status == 200:
                    return proc, base
        except Exception:
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"weft serve {model} never became healthy")


def scenarios(base):
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    an = anthropic.Anthropic(base_url=base, api_key="none")
    served = oa.models.list().data[0].id

    def chat():
        r = oa.chat.completions.create(model=served, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert r.choices[0].message.content and r.usage.completion_tokens > 0

    def chat_stream():
        text = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True) if c.choices)
        assert text

    def completions():
        r = oa.completions.create(model=served, prompt="Once upon a time", max_tokens=8)
        assert r.choices[0].text

    def embeddings():
        r = oa.embeddings.create(model=served, input=["Hello", "The cat sat on the mat"])
        assert len(r.data) == 2 and r.usage.prompt_tokens > 0
        assert abs(sum(x * x for x in r.data[0].embedding) - 1.0) < 1e-4
        # The SDK asks for base64 by default when numpy is absent: both decode the same.
        f = oa.embeddings.create(model=served, input="Hello", encoding_format="float").data[0].embedding
        assert max(abs(a - b) for a, b in zip(f, r.data[0].embedding)) < 1e-6

    def responses():
        # Greedy, as `messages`: sampled, the model could end its answer inside the 8 tokens.
        r = oa.responses.create(model=served, input="Say hi.", instructions="Be brief.", max_output_tokens=8,
                                temperature=0)
        assert r.status == "incomplete" and r.output_text and r.usage.output_tokens == 8, r
        assert oa.responses.retrieve(r.id).output_text == r.output_text

    def responses_stream():
        # Cut off by max_output_tokens, the stream ends in `response.incomplete`, as OpenAI's
        # (greedy, so that the answer cannot end first).
        deltas, kinds, final = [], [], None
        for e in oa.responses.create(model=served, input="Say hi.", max_output_tokens=8, temperature=0, stream=True):
            kinds.append(e.type)
            if e.type == "response.output_text.delta":
                deltas.append(e.delta)
            if e.type == "response.incomplete":
                final = e.response
        assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
        assert final.output_text == "".join(deltas) and final.output_text
        assert final.incomplete_details.reason == "max_output_tokens"

    def responses_tools():
        r = oa.responses.create(model=served, input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                tool_choice="required", max_output_tokens=120, temperature=0)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and calls[0].name == "get_weather", r.output
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        # The result goes back by previous_response_id and a function_call_output item.
        r2 = oa.responses.create(model=served, previous_response_id=r.id, max_output_tokens=8, tools=[RESPONSES_TOOL],
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
        assert r2.output and r2.usage.input_tokens > r.usage.input_tokens

    def responses_stream_tools():
        args = []
        with oa.responses.stream(model=served, input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120) as s:
            for e in s:
                if e.type == "response.function_call_arguments.delta":
                    args.append(e.delta)
            final = s.get_final_response()
        call = [o for o in final.output if o.type == "function_call"][0]
        assert call.arguments == "".join(args)
        jsonschema.validate(json.loads(call.arguments), WEATHER)

    def responses_store():
        r = oa.responses.create(model=served, input="Hi", max_output_tokens=4, store=False)
        try:
            oa.responses.create(model=served, input="Again", previous_response_id=r.id, max_output_tokens=4)
            raise AssertionError("an unstored response was found")
        except openai.NotFoundError as e:
            assert e.body["code"] == "previous_response_not_found", e.body

    def responses_schema():
        r = oa.responses.create(model=served, input="Weather in Paris as JSON.", max_output_tokens=120,
                                text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER,
                                                 "strict": True}})
        jsonschema.validate(json.loads(r.output_text), WEATHER)

    def schema_tries():
        # `required` and a named function always give a call that validates, whatever the seed.
        for seed in range(20):
            choice = "required" if seed % 2 else {"type": "function", "function": {"name": "get_weather"}}
            r = oa.chat.completions.create(model=served, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=[CHAT_TOOL], tool_choice=choice, seed=seed, temperature=1.0,
                                           max_tokens=120, parallel_tool_calls=False)
            calls = r.choices[0].message.tool_calls
            assert calls, r
            jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)

    def messages():
        # Greedy (this SDK no longer names `temperature`): sampled, the model could end its
        # answer inside the 8 tokens.
        m = an.messages.create(model="claude-sonnet-4-6", max_tokens=8, system="Be brief.",
                               messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0})
        assert m.content[0].type == "text" and m.stop_reason == "max_tokens" and m.usage.output_tokens == 8

    def messages_stream():
        with an.messages.stream(model="claude-haiku-4-5", max_tokens=8,
                                messages=[{"role": "user", "content": "Hi"}]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert text and final.content[0].text == text and final.usage.input_tokens > 0

    def messages_tools():
        # One call (a sampled run of parallel calls can reach max_tokens first).
        m = an.messages.create(model="claude", max_tokens=120, tools=[ANTHROPIC_TOOL], extra_body={"temperature": 0},
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": "Weather in Paris?"}])
        use = [b for b in m.content if b.type == "tool_use"]
        assert use and m.stop_reason == "tool_use", m
        jsonschema.validate(use[0].input, WEATHER)
        back = an.messages.create(model="claude", max_tokens=8, tools=[ANTHROPIC_TOOL], messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": m.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "sunny"}]}])
        assert back.content

    def messages_stream_tools():
        with an.messages.stream(model="claude", max_tokens=120, tools=[ANTHROPIC_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
            final = s.get_final_message()
        use = [b for b in final.content if b.type == "tool_use"]
        assert use and final.stop_reason == "tool_use", final
        jsonschema.validate(use[0].input, WEATHER)

    def count_tokens():
        n = an.messages.count_tokens(model="claude", messages=[{"role": "user", "content": "Hi"}])
        assert n.input_tokens > 0

    def lc_chat():
        llm = ChatOpenAI(base_url=f"{base}/v1", api_key="none", model=served, max_tokens=8)
        assert llm.invoke("Hi").content

    def lc_tools():
        llm = ChatOpenAI(base_url=f"{base}/v1", api_key="none", model=served, max_tokens=120)
        msg = llm.bind_tools([CHAT_TOOL], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Paris?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
        jsonschema.validate(msg.tool_calls[0]["args"], WEATHER)

    def lc_structured():
        llm = ChatOpenAI(base_url=f"{base}/v1", api_key="none", model=served, max_tokens=120)
        w = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Paris?")
        assert isinstance(w, Weather)

    def lc_responses():
        llm = ChatOpenAI(base_url=f"{base}/v1", api_key="none", model=served, max_tokens=8, use_responses_api=True)
        assert llm.invoke("Hi").text

    return [
        ("openai", "chat", chat), ("openai", "chat stream", chat_stream), ("openai", "completions", completions),
        ("openai", "embeddings", embeddings),
        ("openai", "responses", responses), ("openai", "responses stream", responses_stream),
        ("openai", "responses tools + round trip", responses_tools),
        ("openai", "responses stream named tool", responses_stream_tools),
        ("openai", "responses store: false", responses_store), ("openai", "responses json_schema", responses_schema),
        ("openai", "required/named calls x20 validate", schema_tries),
        ("anthropic", "messages", messages), ("anthropic", "messages stream", messages_stream),
        ("anthropic", "tool use round trip", messages_tools), ("anthropic", "stream tool use", messages_stream_tools),
        ("anthropic", "count_tokens", count_tokens),
        ("langchain", "invoke", lc_chat), ("langchain", "bind_tools", lc_tools),
        ("langchain", "with_structured_output", lc_structured), ("langchain", "use_responses_api", lc_responses),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weft", default="target/release/weft")
    args = ap.parse_args()
    failed = 0
    for model in FIXTURES:
        proc, base = start(args.weft, model)
        try:
            print(f"\n{model}\n| client | scenario | result |\n|---|---|---|")
            for client, name, run in scenarios(base):
                try:
                    run()
                    result = "pass"
                except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
                    failed += 1
                    result = f"FAIL: {type(e).__name__}: {str(e)[:300]}"
                print(f"| {client} | {name} | {result} |", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if failed:
        sys.exit(f"{failed} client scenarios failed")


if __name__ == "__main__":
    main()
