"""The OpenAI endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(and POST /v1/tokenize, a count of prompt tokens, as vLLM has).

Each request goes to the engine of the model it names (404 if none); a streamed one gets
SSE (sse.py), a plain one waits for the whole output (and is aborted if its client leaves).
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..async_engine import AsyncEngine
from . import render, tool_calls
from .errors import OpenAIError, from_exception
from .params import EngineArgs, chat_args, completion_args
from .protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from .sse import HEADERS, batch_events, events, gather_all, until_disconnect


def build_router(engines: dict[str, AsyncEngine]) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def engine_for(model: str) -> AsyncEngine:
        if model not in engines:
            raise OpenAIError(404, f"The model `{model}` does not exist. Served: "
                              f"{', '.join(engines)}.", param="model", code="model_not_found")
        return engines[model]

    @router.get("/models")
    async def list_models() -> dict:
        """The served models, OpenAI's list shape (plus each one's context length)."""
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": e.created, "owned_by": "llm-stack",
             "max_model_len": e.max_model_len} for name, e in engines.items()]}

    async def run(request: Request, engine: AsyncEngine, batch: list[EngineArgs], *,
                  chat: bool, stream: bool, include_usage: bool, model: str):
        streams = []
        try:
            for args in batch:
                streams.append(await engine.generate(
                    args.prompt_ids, args.params, priority=args.priority, logprobs=args.logprobs,
                    presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty))
        except Exception as e:  # noqa: BLE001 - bad input or backpressure: a 4xx
            for s in streams:  # all of a batch or none of it
                await s.aclose()
            err = from_exception(e)
            if err.status == 400 and err.param is None:
                err.param = "messages" if chat else "prompt"
            return err.response()
        rid = render.new_id("chatcmpl" if chat else "cmpl")
        n, plan = batch[0].params.n, batch[0].tools
        if stream:
            maker = (render.ChunkMaker(rid, model, chat, include_usage) if plan is None
                     else tool_calls.ToolChunkMaker(rid, model, include_usage, plan))
            body = (events(streams[0], maker, n) if len(streams) == 1
                    else batch_events(streams, maker, n))
            return StreamingResponse(body, media_type="text/event-stream", headers=HEADERS)
        try:
            outs = await until_disconnect(request, gather_all(streams))
        except Exception as e:  # noqa: BLE001 - timeout or engine failure, in OpenAI's shape
            return from_exception(e).response()
        out = render.join_batch(outs, n)
        if plan is not None:  # the answer's tool calls parsed out of its text
            body = tool_calls.chat_response(rid, model, out, plan)
        else:
            body = (render.chat_response if chat else render.completion_response)(rid, model, out)
        return JSONResponse(body)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI's (legacy) completions: a prompt (or a list of prompts) in, n completions
        out per prompt."""
        engine = engine_for(body.model)
        include = bool(body.stream_options and body.stream_options.include_usage)
        # tokenizing (and a chat template) is CPU work: off the event loop, which serves others
        args = await asyncio.to_thread(completion_args, body, engine)
        return await run(request, engine, args, chat=False,
                         stream=body.stream, include_usage=include, model=body.model)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI's chat completions through the model's own chat template."""
        engine = engine_for(body.model)
        include = bool(body.stream_options and body.stream_options.include_usage)
        args = await asyncio.to_thread(chat_args, body, engine)
        return await run(request, engine, [args], chat=True,
                         stream=body.stream, include_usage=include, model=body.model)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """How many tokens a prompt (or chat messages, through the template) takes, and the
        model's context: what a client needs to tell a user, before sending, that a prompt
        will not fit. Text longer than any context could hold is a 400, as elsewhere."""
        engine = engine_for(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "send either 'prompt' or 'messages'", param="prompt",
                              code="invalid_value")
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            work = lambda: engine.encode_chat(messages)  # noqa: E731
        else:
            work = lambda: engine.encode(body.prompt) if body.prompt else []  # noqa: E731
        try:
            ids = await asyncio.to_thread(work)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages" if body.messages else "prompt",
                              code="invalid_value") from e
        return {"count": len(ids), "max_model_len": engine.max_model_len}

    return router
