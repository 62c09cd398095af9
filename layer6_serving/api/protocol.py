"""The request bodies of OpenAI's completions and chat completions APIs (pydantic).

Field names, types and ranges follow OpenAI's API reference; unknown fields are accepted
and ignored (clients send `user`, `metadata`, ...), as OpenAI does. Fields OpenAI has but
this server cannot honour (echo, suffix, logit_bias, best_of != n) are refused with a 400
naming the field rather than silently ignored. `tools` / `tool_choice` / `response_format`
are read by tools.py and structured.py. vLLM extensions: `top_k`, `priority` (lower runs
first under the priority policy) and `structured_outputs` / `guided_*` (read from the extras).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .limits import MAX_BATCH, MAX_MESSAGES, MAX_STOP, Name, StopString, Text


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: Name
    n: int = Field(1, ge=1, le=16)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    priority: int = Field(0, ge=-2**31, le=2**31)
    user: Name | None = None

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]  # "" would stop at once: OpenAI ignores it too


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: a string or token ids (one prompt per request)."""

    prompt: (Text | Annotated[list[Text], Field(max_length=MAX_BATCH)] | list[int]
             | Annotated[list[list[int]], Field(max_length=MAX_BATCH)])
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls (tools.py renders them)
    tool_call_id: Name | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: messages through the model's own chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None


class TokenizeRequest(BaseModel):
    """POST /v1/tokenize (vLLM has the same at /tokenize): a prompt, or chat messages through
    the model's own template; the answer counts the tokens the model would get."""

    model: Name
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)

