"""Structured outputs and tool calls with SmolLM2-135M-Instruct (its ChatML template knows no
tools: the server's fallback prompt), over HTTP with the official client: every schema of the
suite (>= 50) as a strict json_schema, `chat.completions.parse` with a Pydantic model, a
streamed json_schema, tools with tool_choice auto / required / named, streamed and not; every
answer parsed and validated with `jsonschema`. Slow tier (~25 s on 2 CPU cores); skipped when
the model cannot be pulled (`stack models pull smollm2`)."""
from __future__ import annotations

import json

import openai
import pytest

import layer6_serving as l6

from ..layer4.schemas import SCHEMAS
from .helpers import assert_json_schemas_hold, assert_streamed_json_schema_holds, validate
from .test_structured_api import ADD, PARAMS, WEATHER, Verdict, check_calls

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def smol():
    from layer3_model.models_command import pull

    try:
        path = pull("smollm2")
    except (FileNotFoundError, ValueError, OSError) as err:
        pytest.skip(f"smollm2 could not be pulled: {err}")
    with l6.start_server({"smollm2": str(path)}, num_blocks=256, max_num_seqs=16) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                            timeout=300), srv


def test_smollm2_json_schemas_parse_and_validate(smol):
    _, srv = smol
    person = [{"role": "user", "content": "Describe a person."}]
    assert len(SCHEMAS) >= 50
    assert_json_schemas_hold(srv.url, "smollm2", person, SCHEMAS,  # all of them, at once
                             temperature=0.7)


def test_smollm2_parse_with_a_pydantic_model_and_a_streamed_schema(smol):
    client, _ = smol
    msg = [{"role": "user", "content": "Give a verdict on Hamlet as JSON."}]
    r = client.chat.completions.parse(model="smollm2", messages=msg, response_format=Verdict,
                                      max_tokens=64, temperature=0.7, seed=3)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and 1 <= parsed.lines <= 9
    assert_streamed_json_schema_holds(client, "smollm2", msg, SCHEMAS[17])


def test_smollm2_auto_answers_in_text_or_valid_calls(smol):
    client, _ = smol
    for question in ("What is 2 plus 3?", "Hello! How are you?"):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}],
            tools=[WEATHER, ADD], tool_choice="auto", max_tokens=64, temperature=0)
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length", "tool_calls")
        if ch.finish_reason == "tool_calls":
            check_calls(ch.message.tool_calls)
        else:
            assert ch.message.content and not ch.message.tool_calls


def test_smollm2_calls_tools_streamed_and_not(smol):
    client, _ = smol
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is 2 plus 3?"}],
        tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False,
        max_tokens=64, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, max_tokens=64, temperature=0, stream=True)
    args, reasons = "", []
    for chunk in stream:
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for tc in ch.delta.tool_calls or []:
                args += tc.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    validate(json.loads(args), PARAMS["get_weather"])
