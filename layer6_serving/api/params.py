"""OpenAI request fields -> the engine's arguments (prompt ids, SamplingParams, extras).

Defaults are OpenAI's: temperature 1, top_p 1, max_tokens 16 for completions and, for chat,
as much as the context (and the KV pool) leaves after the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import layer5_parallel as l5

from ..async_engine import AsyncEngine
from . import structured, tools
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
    tools: tools.ToolPlan | None = None  # a chat request's tools: its answer is parsed for calls


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
    extra = req.model_extra or {}
    spec = structured.constraint(extra.get("response_format"), extra)
    out = []
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt.{i}"
        if isinstance(p, list) and not p:
            raise _bad(f"{where} is empty", where)
        ids = _encode(engine, p, where)
        params = _params(req, engine, len(ids), 16 if req.max_tokens is None else req.max_tokens)
        if spec is not None:
            params = replace(params, structured_outputs=spec)
        out.append(EngineArgs(ids, params, req.logprobs, req.presence_penalty,
                              req.frequency_penalty, req.priority))
    return out


def chat_args(req: ChatCompletionRequest, engine: AsyncEngine) -> EngineArgs:
    _unsupported(req)
    plan = tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    spec = structured.constraint(req.response_format, req.model_extra)
    grammar = plan.grammar() if plan is not None else None
    if grammar is not None:  # tool_choice required / named: the calls' grammar
        if spec is not None:
            raise _bad("a response_format or structured_outputs constraint cannot be combined "
                       "with tool_choice 'required' or a named function", "response_format")
        spec = l5.engine.StructuredOutputsParams(grammar=grammar)  # checked by tools.plan
    if plan is not None and plan.parses and req.logprobs:
        raise _bad("logprobs are not supported with tools on this server", "logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {}),
                 **({"tool_calls": m.tool_calls} if m.tool_calls else {}),
                 **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})}
                for m in req.messages]
    with_tools = plan is not None or any(m.tool_calls or m.role == "tool" for m in req.messages)
    try:
        engine.check_chars(sum(len(m["content"]) for m in messages))
    except ValueError as e:
        raise _bad(str(e), "messages") from e
    try:
        ids = (tools.render_prompt(engine.tokenizer, messages, plan) if with_tools
               else engine.encode_chat(messages))
    except Exception as e:  # noqa: BLE001 - a template error is about the messages sent
        raise _bad(f"the chat template could not render these messages: {e}", "messages") from e
    if not ids:
        raise _bad("the messages render to an empty prompt", "messages")
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    params = _params(req, engine, len(ids), max_tokens, engine.chat_stop)
    if spec is not None:
        params = replace(params, structured_outputs=spec)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return EngineArgs(ids, params, logprobs, req.presence_penalty, req.frequency_penalty,
                      req.priority, plan)
