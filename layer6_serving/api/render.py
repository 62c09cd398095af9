"""StreamOutputs -> OpenAI's JSON objects (completions and chat, whole or as chunks).

Shapes, as OpenAI sends them:
- text_completion: choices[{index, text, logprobs, finish_reason}] with logprobs
  {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset};
- chat.completion: choices[{index, message{role, content}, logprobs, finish_reason}] with
  logprobs {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]};
- chat.completion.chunk: choices[{index, delta{role?, content?}, logprobs, finish_reason}];
- usage {prompt_tokens, completion_tokens, total_tokens}; a streamed usage chunk has
  choices [] and, with include_usage, every other chunk has "usage": null.
Ours, ignored by OpenAI clients: "llm_stack" {ttft_s, tokens_per_s, cached_prompt_tokens,
spec_acceptance} on a whole response and on the last chunk before [DONE].
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

from ..streams import Delta, StreamOutput, TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(out: StreamOutput, n_prompt_copies: int = 1) -> dict:
    prompt = out.prompt_tokens * n_prompt_copies
    return {"prompt_tokens": prompt, "completion_tokens": out.completion_tokens,
            "total_tokens": prompt + out.completion_tokens}


def header(rid: str, obj: str, model: str, created: int | None = None) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model,
            "system_fingerprint": None}


# ---- logprobs --------------------------------------------------------------------------------
def completion_logprobs(lps: list[TokenLogprob | None] | None, offset: int) -> dict | None:
    """Legacy completions logprobs; offset: characters of text already sent before these."""
    if lps is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        out["tokens"].append(lp.token if lp else "")
        out["token_logprobs"].append(lp.logprob if lp else None)
        out["top_logprobs"].append({t: v for _, t, v in lp.top} if lp else None)
        out["text_offset"].append(offset)
        offset += len(lp.token) if lp else 0
    return out


def chat_logprobs(lps: list[TokenLogprob | None] | None) -> dict | None:
    if lps is None:
        return None

    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = [dict(one(lp.token, lp.logprob), top_logprobs=[one(t, v) for _, t, v in lp.top])
               for lp in lps if lp is not None]
    return {"content": content, "refusal": None}


# ---- a batch of prompts ----------------------------------------------------------------------
def reindex(out: StreamOutput, prompt: int, n: int) -> StreamOutput:
    """Prompt `prompt`'s output with its choices numbered prompt-major (prompt * n + i), as
    OpenAI numbers the choices of a batch."""
    if not prompt:
        return out
    deltas = [dataclasses.replace(d, index=prompt * n + d.index) for d in out.deltas]
    return dataclasses.replace(out, deltas=deltas)


def join_batch(outs: list[StreamOutput], n: int) -> StreamOutput:
    """A batch's whole outputs as one: every prompt's choices (prompt-major), usage summed
    (each prompt counted once), the last one's metrics."""
    if len(outs) == 1:
        return outs[0]
    deltas = [d for i, o in enumerate(outs) for d in reindex(o, i, n).deltas]
    return StreamOutput(outs[0].request_id, deltas, True, sum(o.prompt_tokens for o in outs),
                        sum(o.completion_tokens for o in outs), outs[-1].metrics)


# ---- whole responses -------------------------------------------------------------------------
def completion_response(rid: str, model: str, out: StreamOutput) -> dict:
    body = header(rid, "text_completion", model)
    body["choices"] = [{"index": d.index, "text": d.text,
                        "logprobs": completion_logprobs(d.logprobs, 0),
                        "finish_reason": d.finish_reason} for d in out.deltas]
    body["usage"] = usage(out)
    body["llm_stack"] = out.metrics.as_dict() if out.metrics else None
    return body


def chat_response(rid: str, model: str, out: StreamOutput) -> dict:
    body = header(rid, "chat.completion", model)
    body["choices"] = [{"index": d.index, "message": {"role": "assistant", "content": d.text},
                        "logprobs": chat_logprobs(d.logprobs), "finish_reason": d.finish_reason}
                       for d in out.deltas]
    body["usage"] = usage(out)
    body["llm_stack"] = out.metrics.as_dict() if out.metrics else None
    return body


# ---- chunks ----------------------------------------------------------------------------------
def dumps(obj) -> str:
    """JSON as the SSE frames carry it: compact, UTF-8 as is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def frame(obj: dict) -> bytes:
    """One server-sent event: `data: {json}\\n\\n`."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


class ChunkMaker:
    """Builds the chunks of one streamed response (same id and created in every chunk).
    `payload(out)` is what the stream sends for one StreamOutput: its chunks as SSE frames.
    The frequent case (a step's new text, no logprobs, the request not yet finished) is
    rendered from a template made once per response, byte for byte what framing the
    chunk dicts gives, without building them: the server writes one such chunk per
    request per engine step, and at 64 streams dict building and json.dumps of the whole
    chunk were most of the front end's time per step."""

    def __init__(self, rid: str, model: str, chat: bool, include_usage: bool) -> None:
        self.base = header(rid, "chat.completion.chunk" if chat else "text_completion", model)
        self.chat, self.include_usage = chat, include_usage
        self.offsets: dict[int, int] = {}
        # `data: {"id":..,"model":..,"choices":[` + choice + `]}` (+ "usage":null)
        self._head = b"data: " + dumps(self.base)[:-1].encode() + b',"choices":['
        self._tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def _chunk(self, choices: list[dict]) -> dict:
        c = dict(self.base, choices=choices)
        if self.include_usage:
            c["usage"] = None
        return c

    def role(self, n: int) -> list[dict]:
        """Chat streams open with the assistant role, one chunk per choice."""
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for i in range(n)]

    def delta(self, d: Delta) -> dict:
        if self.chat:
            choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                      "logprobs": chat_logprobs(d.logprobs), "finish_reason": d.finish_reason}
        else:
            off = self.offsets.get(d.index, 0)
            choice = {"index": d.index, "text": d.text,
                      "logprobs": completion_logprobs(d.logprobs, off),
                      "finish_reason": d.finish_reason}
            self.offsets[d.index] = off + len(d.text)
        return self._chunk([choice])

    def usage(self, out: StreamOutput) -> dict:
        return dict(self.base, choices=[], usage=usage(out))

    def payload(self, out: StreamOutput) -> bytes:
        """The SSE bytes for one StreamOutput (b"" when it has nothing to send)."""
        if out.finished or any(d.logprobs is not None for d in out.deltas):
            return b"".join(frame(c) for c in self.chunks(out))
        parts = []
        for d in out.deltas:
            reason = "null" if d.finish_reason is None else dumps(d.finish_reason)
            if self.chat:
                delta = '{"content":' + dumps(d.text) + "}" if d.text else "{}"
                choice = (f'{{"index":{d.index},"delta":{delta},"logprobs":null,'
                          f'"finish_reason":{reason}}}')
            else:
                self.offsets[d.index] = self.offsets.get(d.index, 0) + len(d.text)
                choice = (f'{{"index":{d.index},"text":{dumps(d.text)},"logprobs":null,'
                          f'"finish_reason":{reason}}}')
            parts += (self._head, choice.encode(), self._tail)
        return b"".join(parts)

    def chunks(self, out: StreamOutput) -> list[dict]:
        """The chunks for one StreamOutput; the request's last one carries "llm_stack"."""
        return self.finish_chunks([self.delta(d) for d in out.deltas], out)

    def finish_chunks(self, chunks: list[dict], out: StreamOutput) -> list[dict]:
        """After the request's last deltas: the usage chunk when asked (else at least one
        chunk), the last one carrying the "llm_stack" metrics."""
        if out.finished:
            if self.include_usage:
                chunks.append(self.usage(out))
            elif not chunks:
                chunks.append(self._chunk([]))
            chunks[-1]["llm_stack"] = out.metrics.as_dict() if out.metrics else None
        return chunks
