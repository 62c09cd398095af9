"""Tool calling for chat completions: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`.

The model's side is the Hermes / Qwen convention: a call is written as

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

(several, one per line, for parallel calls). The prompt: a chat template that knows tools
(its text mentions `tools`: Qwen2/Qwen3, Hermes) gets them as the `tools` variable and the
assistant's earlier calls as `tool_calls`; any other template (the course model's, SmolLM2's)
gets a short system message listing the tools and that format, earlier calls written into
the assistant's text, and tool results as `role: "tool"` messages wrapped in
<tool_response>. tool_choice "required" or a named function is enforced by a grammar (layer
4's mask): the output can only be well-formed calls of the allowed tools with arguments that
follow their JSON schemas, so even a tiny model calls correctly. "auto" leaves the model free
and parses whatever calls it writes; "none" parses nothing.

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
from .errors import OpenAIError
from .render import ChunkMaker
from .structured import checked

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL = 4  # calls in one answer under a grammar (a tiny model would go on forever)
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
HOLD = len("}" + CLOSE) + 4  # argument text held back: it may be the call's closing
# the grammar's JSON: compact, so a small model cannot idle in whitespace
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


@dataclass
class ToolPlan:
    """What a request's tools mean for its prompt, grammar and answer. choice: "none" |
    "auto" | "required" | "named" (then `named` is the function)."""

    tools: list[dict]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> str | None:
        """The Lark grammar (llguidance's dialect) for "required" / named, else None."""
        if self.choice not in ("required", "named"):
            return None
        fns = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for f in fns]
        schema = dict(calls[0] if len(calls) == 1 else {"anyOf": calls}, **{"x-guidance": COMPACT})
        repeat = f'("\\n" call){{0,{MAX_PARALLEL - 1}}}' if self.parallel else ""
        return (f"start: call {repeat}\n"
                f'call: "{OPEN}" body "{CLOSE}"\n'
                f"body: %json {json.dumps(schema)}\n")


def plan(tools: list | None, tool_choice, parallel: bool | None) -> ToolPlan | None:
    """Check the request's tools and tool_choice (400s naming the field); None without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    checked_tools = []
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or \
                not isinstance(fn, dict):
            raise _bad(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise _bad(f"{where}.function.name must be 1-64 letters, digits, _ or -; got "
                       f"{name!r}", f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema (an object)",
                       f"{where}.function.parameters")
        checked({"json": params}, f"{where}.function.parameters")
        checked_tools.append({"type": "function", "function": dict(fn, parameters=params)})
    names = [t["function"]["name"] for t in checked_tools]
    if len(set(names)) != len(names):
        raise _bad("tools must have distinct function names", "tools")
    choice, named = tool_choice if tool_choice is not None else "auto", None
    if isinstance(choice, dict):
        named = _fn(choice).get("name")
        if choice.get("type") != "function" or named not in names:
            raise _bad(f"tool_choice names function {named!r}, which is not in tools "
                       f"({', '.join(names)})", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    out = ToolPlan(checked_tools, choice, named, parallel is not False)
    grammar = out.grammar()
    if grammar is not None:
        checked({"grammar": grammar}, "tools")
    return out


# ---- the prompt ------------------------------------------------------------------------------
def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def _fn(obj: dict) -> dict:
    """obj["function"] when it is an object, else {} (a malformed call or choice)."""
    fn = obj.get("function")
    return fn if isinstance(fn, dict) else {}


def _arguments(call: dict) -> dict | str:
    args = _fn(call).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _call_text(call: dict) -> str:
    fn = _fn(call)
    body = {"name": fn.get("name"), "arguments": _arguments(call)}
    return OPEN + json.dumps(body, separators=(",", ":")) + CLOSE


def system_text(plan: ToolPlan) -> str:
    """The tools, for a template that does not know them (Hermes' system prompt, short)."""
    lines = "\n".join(json.dumps(f, separators=(",", ":")) for f in plan.functions)
    return ("You may call these tools:\n<tools>\n" + lines + "\n</tools>\nTo call one, write "
            f'{OPEN}{{"name": <name>, "arguments": <object>}}{CLOSE}.')


def template_messages(messages: list[dict], plan: ToolPlan | None, knows_tools: bool
                      ) -> list[dict]:
    """The request's messages (dicts with role, content, name, tool_calls, tool_call_id) as
    the chat template should see them."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if knows_tools:
            if calls:  # templates read arguments as an object (transformers' convention)
                m["tool_calls"] = [dict(c, function=dict(_fn(c), arguments=_arguments(c)))
                                   for c in calls]
        else:
            if calls:
                m["content"] = "\n".join(filter(None, [m.get("content") or ""] +
                                                [_call_text(c) for c in calls]))
            if m["role"] == "tool":
                m["content"] = f"<tool_response>{m.get('content') or ''}</tool_response>"
            m.pop("tool_call_id", None)
        out.append(m)
    if plan is not None and not knows_tools:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = dict(out[0], content=system_text(plan) + "\n" + (out[0]["content"] or ""))
        else:
            out.insert(0, {"role": "system", "content": system_text(plan)})
    return out


def render_prompt(tokenizer, messages: list[dict], plan: ToolPlan | None) -> list[int]:
    """Token ids of the chat prompt with the tools in it (see template_messages)."""
    knows = template_knows_tools(tokenizer.chat_template)
    msgs = template_messages(messages, plan, knows)
    kwargs = {"tools": plan.tools} if (plan is not None and knows) else {}
    try:
        text = tokenizer.apply_chat_template(msgs, **kwargs)
    except Exception:  # noqa: BLE001 - a template that refuses the "tool" role: as user turns
        msgs = [dict(m, role="user") if m["role"] == "tool" else m for m in msgs]
        text = tokenizer.apply_chat_template(msgs, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


# ---- the answer -------------------------------------------------------------------------------
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
