"""OpenAI request fields -> the engine's arguments (prompt ids, SamplingParams, extras).

Defaults are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions and, for chat,
as much as the context (and the KV pool) leaves after the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import layer5_parallel as l5

from ..async_engine import AsyncEngine
from .errors import OpenAIError
from .protocol import ChatCompletionRequest, CompletionRequest, _Sampling


@dataclass
class EngineArgs:
    prompt_ids: list[int]
    params: l5.SamplingParams
    logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    priority: int


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def _unsupported(req: _Sampling) -> None:
    if req.logit_bias:
        raise _bad("logit_bias is not supported by this server", "logit_bias")


def _params(req: _Sampling, engine: AsyncEngine, n_prompt: int, max_tokens: int | None,
            extra_stop: tuple[str, ...] = ()) -> l5.SamplingParams:
    if max_tokens is None:  # all the room the context and the KV pool leave
        info = engine.info
        max_tokens = min(engine.max_model_len, info.num_blocks * info.block_size) - n_prompt
        if max_tokens < 1:
            raise _bad(f"the prompt has {n_prompt} tokens: no room left in this model's "
                       f"{engine.max_model_len}-token context", "messages")
    stop = tuple(dict.fromkeys(req.stop_list() + list(extra_stop)))
    try:
        return l5.SamplingParams(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=0 if req.top_k is None else req.top_k, seed=req.seed, max_tokens=max_tokens,
            stop=stop, ignore_eos=req.ignore_eos, n=req.n)
    except ValueError as e:
        raise _bad(str(e), "body") from e


def _encode(engine: AsyncEngine, prompt, param: str) -> list[int]:
    try:
        return engine.encode(prompt)
    except ValueError as e:
        raise _bad(str(e), param) from e


def completion_args(req: CompletionRequest, engine: AsyncEngine) -> list[EngineArgs]:
    """One EngineArgs per prompt: OpenAI's prompt is a string, token ids, or a list of
    either (a batch: each prompt its own request, its n choices indexed after the last's)."""
    _unsupported(req)
    if req.echo:
        raise _bad("echo is not supported by this server", "echo")
    if req.suffix:
        raise _bad("suffix is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of must equal n on this server", "best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and not prompt:
        raise _bad("the prompt is empty", "prompt")
    batch = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    out = []
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt.{i}"
        if isinstance(p, list) and not p:
            raise _bad(f"{where} is empty", where)
        ids = _encode(engine, p, where)
        params = _params(req, engine, len(ids), 16 if req.max_tokens is None else req.max_tokens)
        out.append(EngineArgs(ids, params, req.logprobs, req.presence_penalty,
                              req.frequency_penalty, req.priority))
    return out


def chat_args(req: ChatCompletionRequest, engine: AsyncEngine) -> EngineArgs:
    _unsupported(req)
    if req.tools:
        raise _bad("tools are not supported by this server", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise _bad("only the 'text' response_format is supported", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in req.messages]
    try:
        engine.check_chars(sum(len(m["content"]) for m in messages))
    except ValueError as e:
        raise _bad(str(e), "messages") from e
    try:
        ids = engine.encode_chat(messages)
    except Exception as e:  # noqa: BLE001 - a template error is about the messages sent
        raise _bad(f"the chat template could not render these messages: {e}", "messages") from e
    if not ids:
        raise _bad("the messages render to an empty prompt", "messages")
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    params = _params(req, engine, len(ids), max_tokens, engine.chat_stop)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return EngineArgs(ids, params, logprobs, req.presence_penalty, req.frequency_penalty,
                      req.priority)
