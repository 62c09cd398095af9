"""Tool calls in a chat answer: the Hermes / Qwen `<tool_call>{...}</tool_call>` text the model
writes (tools.py sets up the request and the prompt), parsed into OpenAI's form.

The answer: `message.tool_calls` [{id, type: "function", function: {name, arguments (JSON
text)}}] with finish_reason "tool_calls"; streamed, as OpenAI frames it: the first chunk of a
call carries its index, id, type and function.name with arguments "", later chunks only the
index and the next piece of function.arguments (`ToolStream`, used for whole responses too,
so both agree to the byte).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..streams import Delta, StreamOutput
from . import render
from .render import ChunkMaker
from .tools import CLOSE, OPEN, ToolPlan

HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
HOLD = len("}" + CLOSE) + 4  # argument text held back: it may be the call's closing


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolStream:
    """Text in (a completion's deltas), OpenAI deltas out: {"content": ...} for text outside
    calls and {"tool_calls": [...]} pieces for calls. `calls` holds the whole calls so far."""

    buf: str = ""
    in_call: bool = False
    started: bool = False  # the current call's header (id, name) went out
    calls: list[dict] = field(default_factory=list)
    content: str = ""
    pending_ws: str = ""  # whitespace held back: dropped if a call follows it

    def _text(self, text: str, out: list[dict]) -> None:
        """Text outside calls; trailing whitespace waits (a call right after drops it)."""
        stripped = text.rstrip()
        if stripped:
            piece = self.pending_ws + stripped
            self.content += piece
            out.append({"content": piece})
            self.pending_ws = text[len(stripped):]
        else:
            self.pending_ws += text

    def _args(self, text: str, out: list[dict]) -> None:
        if not self.calls[-1]["function"]["arguments"]:
            text = text.lstrip()  # the space after "arguments": is not part of them
        if text:
            self.calls[-1]["function"]["arguments"] += text
            out.append({"tool_calls": [{"index": len(self.calls) - 1,
                                        "function": {"arguments": text}}]})

    def _header(self, name: str, out: list[dict]) -> None:
        call = {"id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        out.append({"tool_calls": [dict(call, index=len(self.calls) - 1,
                                        function=dict(call["function"]))]})
        self.started = True

    def feed(self, text: str, final: bool = False) -> list[dict]:
        out: list[dict] = []
        self.buf += text
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i >= 0:
                    self._text(self.buf[:i], out)
                    self.pending_ws = ""
                    self.buf, self.in_call, self.started = self.buf[i + len(OPEN):], True, False
                    continue
                keep = 0 if final else _prefix_overlap(self.buf, OPEN)
                self._text(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if not self.started:
                m = HEAD.match(self.buf)
                if m:
                    self._header(m.group(1), out)
                    self.buf = self.buf[m.end():]
                    continue
                j = self.buf.find(CLOSE)
                if j < 0 and not final:
                    break
                self._whole(self.buf[:j] if j >= 0 else self.buf, out)
                self.buf = self.buf[j + len(CLOSE):] if j >= 0 else ""
                self.in_call = False
                continue
            j = self.buf.find(CLOSE)
            if j >= 0:
                args = self.buf[:j].rstrip()
                self._args(args[:-1] if args.endswith("}") else args, out)
                self.buf, self.in_call = self.buf[j + len(CLOSE):], False
                continue
            if final:  # cut before </tool_call> (max_tokens): drop a complete call's "}"
                rest = self.buf.rstrip()
                whole = self.calls[-1]["function"]["arguments"] + rest
                if whole.endswith("}") and _is_json(whole[:-1]) and not _is_json(whole):
                    rest = rest[:-1]
                self._args(rest, out)
                self.buf = ""
                break
            safe = max(0, len(self.buf) - HOLD)
            self._args(self.buf[:safe], out)
            self.buf = self.buf[safe:]
            break
        if final and self.pending_ws and not self.calls:  # plain text keeps its last spaces
            self.content += self.pending_ws
            out.append({"content": self.pending_ws})
            self.pending_ws = ""
        return out

    def _whole(self, body: str, out: list[dict]) -> None:
        """A call whose head did not come as name-then-arguments: parse it whole."""
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            self._text(OPEN + body + CLOSE, out)  # not a call after all: plain text
            return
        self._header(str(name), out)
        self._args(args if isinstance(args, str) else json.dumps(args), out)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _prefix_overlap(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def finish_reason(reason: str | None, stream: ToolStream) -> str | None:
    return "tool_calls" if stream.calls and reason == "stop" else reason


def chat_response(rid: str, model: str, out: StreamOutput, plan: ToolPlan) -> dict:
    """render.chat_response, with each choice's calls parsed into message.tool_calls."""
    body = render.chat_response(rid, model, out)
    if not plan.parses:
        return body
    for choice, d in zip(body["choices"], out.deltas, strict=True):
        ts = ToolStream()
        ts.feed(d.text, final=True)
        if ts.calls:
            choice["message"] = {"role": "assistant", "content": ts.content or None,
                                 "tool_calls": ts.calls}
            choice["finish_reason"] = finish_reason(d.finish_reason, ts)
    return body


class ToolChunkMaker(ChunkMaker):
    """ChunkMaker for a request with tools: each choice's text goes through a ToolStream, so
    calls stream as delta.tool_calls; the last chunk has an empty delta and the finish
    reason ("tool_calls" when the choice called a tool)."""

    def __init__(self, rid: str, model: str, include_usage: bool, plan: ToolPlan) -> None:
        super().__init__(rid, model, True, include_usage)
        self.plan = plan
        self.streams: dict[int, ToolStream] = {}

    def role(self, n: int) -> list[dict]:
        forced = self.plan.choice in ("required", "named")
        return [self._chunk([{"index": i, "delta": {"role": "assistant",
                                                    "content": None if forced else ""},
                              "logprobs": None, "finish_reason": None}]) for i in range(n)]

    def payload(self, out: StreamOutput) -> bytes:
        if not self.plan.parses:
            return super().payload(out)
        return b"".join(render.frame(c) for c in self.chunks(out))

    def deltas(self, d: Delta) -> list[dict]:
        ts = self.streams.setdefault(d.index, ToolStream())
        done = d.finish_reason is not None
        chunks = [self._chunk([{"index": d.index, "delta": delta, "logprobs": None,
                                "finish_reason": None}]) for delta in ts.feed(d.text, done)]
        if done:
            chunks.append(self._chunk([{"index": d.index, "delta": {}, "logprobs": None,
                                        "finish_reason": finish_reason(d.finish_reason, ts)}]))
        return chunks

    def chunks(self, out: StreamOutput) -> list[dict]:
        if not self.plan.parses:
            return super().chunks(out)
        return self.finish_chunks([c for d in out.deltas for c in self.deltas(d)], out)
