"""Structured outputs and tool calling over HTTP with the official `openai` client and raw SSE
bytes (course model, CPU, the layer's shared server): response_format json_schema (strict)
and json_object, `chat.completions.parse` with a Pydantic model, tools with tool_choice
auto / required / named, streamed and not, vLLM's structured_outputs on completions, and the
400s for constraints that cannot compile. Every JSON answer is parsed and validated against
its schema with `jsonschema`."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from layer6_serving.api import tool_calls, tools

from ..layer4.schemas import SCHEMAS
from .helpers import (
    assert_json_schemas_hold,
    assert_streamed_json_schema_holds,
    sse_events,
    validate,
)

MSG = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"],
        "additionalProperties": False}}}
PARAMS = {f["function"]["name"]: f["function"]["parameters"] for f in (WEATHER, ADD)}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def check_calls(calls, names=("get_weather", "add")) -> None:
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names
        validate(json.loads(c.function.arguments), PARAMS[c.function.name])


# ---- response_format -------------------------------------------------------------------------
def test_many_json_schemas_parse_and_validate(server):
    """Every schema of the suite (>= 50), sent at once so the engine batches their masks."""
    assert len(SCHEMAS) >= 50
    assert_json_schemas_hold(server.url, "course", MSG, SCHEMAS, temperature=0.8)


class Verdict(pydantic.BaseModel):
    speaker: str = pydantic.Field(max_length=10)
    mood: Literal["merry", "sad", "wroth"]
    lines: int = pydantic.Field(ge=1, le=9)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="course", messages=MSG, response_format=Verdict,
                                      max_tokens=64, temperature=0.7, seed=3)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Verdict)
    assert 1 <= parsed.lines <= 9 and len(parsed.speaker) <= 10


def test_json_object_and_streamed_json_schema(client):
    r = client.chat.completions.create(model="course", messages=MSG, max_tokens=60, seed=2,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert_streamed_json_schema_holds(client, "course", MSG, SCHEMAS[17])


def test_completions_take_vllms_structured_outputs(client):
    r = client.completions.create(
        model="course", prompt="HAMLET.\n", max_tokens=24, seed=1,
        extra_body={"structured_outputs": {"regex": r"(Aye|Nay), [a-z]+!"}})
    assert re.fullmatch(r"(Aye|Nay), [a-z]+!", r.choices[0].text)
    r = client.completions.create(model="course", prompt="HAMLET.\n", max_tokens=8,
                                  extra_body={"guided_choice": ["to be", "not to be"]})
    assert r.choices[0].text in ("to be", "not to be")
    r = client.completions.create(model="course", prompt="HAMLET.\n", max_tokens=48, seed=4,
                                  extra_body={"structured_outputs": {"json": SCHEMAS[5]}})
    validate(json.loads(r.choices[0].text), SCHEMAS[5])


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strng"}}}}, "response_format.json_schema.schema",
     "strng"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "name"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "empty"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice", "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'auto'"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0", "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name", "bad name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integr"}}}}}]},
     "tools.0.function.parameters", "integr"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
])
def test_constraints_that_cannot_compile_are_400s_naming_the_problem(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "course", "messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


# ---- tools -----------------------------------------------------------------------------------
def test_tool_choice_required_calls_tools(client):
    """Parallel calls (at most MAX_PARALLEL under the grammar), then one of two tools."""
    r = client.chat.completions.create(
        model="course", messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=[ADD], tool_choice="required", max_tokens=200, seed=7)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    check_calls(ch.message.tool_calls, ("add",))
    assert 1 <= len(ch.message.tool_calls) <= tools.MAX_PARALLEL
    assert len({c.id for c in ch.message.tool_calls}) == len(ch.message.tool_calls)
    r = client.chat.completions.create(
        model="course", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False,
        max_tokens=96, seed=7)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(r.choices[0].message.tool_calls) == 1
    check_calls(r.choices[0].message.tool_calls)


def test_named_tool_without_parallel_calls_is_one_call(client):
    r = client.chat.completions.create(
        model="course", messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False, max_tokens=64, temperature=0.9, seed=11)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add"
    check_calls(calls, ("add",))


def test_streamed_named_tool_call_through_the_sdk(client):
    stream = client.chat.completions.create(
        model="course", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, max_tokens=96, seed=1, stream=True)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    for c in calls.values():
        assert c["name"] == "get_weather"
        validate(json.loads(c["arguments"]), PARAMS["get_weather"])


def test_auto_answers_in_text_or_calls(client):
    r = client.chat.completions.create(
        model="course", messages=[{"role": "user", "content": "Good morrow."}],
        tools=[WEATHER], tool_choice="auto", max_tokens=20, seed=0)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    assert ch.message.content or ch.message.tool_calls


def test_tool_results_go_back_through_the_template(client, server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\":2,\"b\":3}"}}
    messages = [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = client.chat.completions.create(model="course", messages=messages, tools=[ADD],
                                       max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tok = server.engines["course"].tokenizer
    plan = tools.plan([ADD], "auto", None)
    text = tok.decode(tools.render_prompt(tok, messages, plan), skip_special_tokens=False)
    assert '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>' in text
    assert "<tool_response>5</tool_response>" in text and '"name":"add"' in text


def test_raw_sse_bytes_of_a_streamed_tool_call_follow_openais_framing(server):
    body = {"model": "course", "messages": [{"role": "user", "content": "Add 1 and 2."}],
            "tools": [ADD], "tool_choice": "required", "max_tokens": 200, "seed": 5,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": None}
    pieces = [c["choices"][0] for c in chunks[1:] if c["choices"]]
    last = pieces[-1]
    assert last["delta"] == {} and last["finish_reason"] == "tool_calls"
    calls: dict[int, dict] = {}
    for p in pieces[:-1]:
        assert p["finish_reason"] is None and set(p["delta"]) == {"tool_calls"}
        (tc,) = p["delta"]["tool_calls"]
        if tc["index"] not in calls:  # a call opens: index, id, type, name, arguments ""
            assert set(tc) == {"index", "id", "type", "function"}
            assert tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"] == {"name": "add", "arguments": ""}
            assert tc["index"] == len(calls)
            calls[tc["index"]] = {"arguments": ""}
        else:  # then only the index and the next piece of the arguments
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert calls
    for c in calls.values():
        validate(json.loads(c["arguments"]), PARAMS["add"])


# ---- the parser, without a model ----------------------------------------------------------------
TEXT = ('Let me see. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"arguments": {"city": "Rome", "unit": "C"}, "name": "get_weather"}'
        '</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 7, len(TEXT)])
def test_tool_stream_gives_the_same_calls_however_the_text_is_cut(step):
    ts = tool_calls.ToolStream()
    deltas = []
    for i in range(0, len(TEXT), step):
        deltas += ts.feed(TEXT[i:i + step], final=i + step >= len(TEXT))
    assert ts.content == "Let me see."
    assert [c["function"]["name"] for c in ts.calls] == ["add", "get_weather"]
    assert ts.calls[0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    assert json.loads(ts.calls[1]["function"]["arguments"]) == {"city": "Rome", "unit": "C"}
    args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", [])
                   if tc["index"] == 0)
    assert args == '{"a": 1, "b": 2}'
    cut = tool_calls.ToolStream()  # max_tokens ended it after the object, before </tool_call>
    cut.feed('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', final=True)
    assert cut.calls[0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    plain = tool_calls.ToolStream()
    assert "".join(d["content"] for d in plain.feed("no call <tool here ", True)) == \
        "no call <tool here "


def test_malformed_tool_turns_are_not_server_errors(server):
    for messages in ([{"role": "assistant", "tool_calls": [{"function": "oops"}]},
                      {"role": "user", "content": "hi"}],
                     [{"role": "tool", "content": None}, {"role": "user", "content": "hi"}]):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": "course", "messages": messages, "max_tokens": 2})
        assert r.status_code in (200, 400), r.text
