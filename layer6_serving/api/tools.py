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

The answer, parsed back into calls: tool_calls.py.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .errors import OpenAIError
from .structured import checked

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL = 4  # calls in one answer under a grammar (a tiny model would go on forever)
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
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
