"""Built-in tools the chat page can enable, run by the app, their results fed back to the model.

A reply with tools enabled goes to the model server with OpenAI's `tools` (layer 6 renders
them into the prompt and, for tool_choice "required", enforces the call's grammar). When the
answer is a tool call, the app runs it here, sends the call and its result back as an
assistant `tool_calls` turn and a `role: "tool"` turn, and streams the model's next answer;
at most MAX_ROUNDS rounds, the last with tool_choice "none" so a reply always ends in text.

    calculator          arithmetic on numbers: + - * / // % **, parentheses, and a few math
                        functions; parsed with `ast` and evaluated node by node (never eval),
                        with bounded sizes, so no input can run code or exhaust the machine
    search_documents    the best passages of the user's documents (the session's RAG index)

A reply stores its calls and results in its message's meta (`tool_calls`, `tool_results`,
`tool_text`: what the model wrote before calling); `expand_history` turns such a message
back into the turns the model saw.
"""
from __future__ import annotations

import ast
import json
import math
import operator
from typing import Any

from ..rag import DocIndex

MAX_ROUNDS = 2  # tool rounds per reply before the model must answer in text
MAX_EXPR = 200  # characters of a calculator expression
MAX_RESULT = 600  # characters of a tool's result fed back (a small model's context is short)

# numbers and operators, as the model may write them: the grammar keeps even a tiny model's
# expression computable (the calculator itself also takes parentheses and math functions)
NUMBER = r"-?[0-9]{1,6}(\.[0-9]{1,4})?"
ARITHMETIC = rf"^{NUMBER}( ?(\*\*|[-+*/%]) ?{NUMBER}){{0,4}}$"

TOOLS: dict[str, dict[str, Any]] = {
    "calculator": {"type": "function", "function": {
        "name": "calculator", "description": "Arithmetic on numbers, e.g. 6 * 7 + 1",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "pattern": ARITHMETIC}},
            "required": ["expression"], "additionalProperties": False}}},
    "search_documents": {"type": "function", "function": {
        "name": "search_documents", "description": "Search my documents",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 40}},
            "required": ["query"], "additionalProperties": False}}},
}

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan,
          "log": math.log, "exp": math.exp, "abs": abs, "round": round}
_NAMES = {"pi": math.pi, "e": math.e}


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression. ValueError for anything else (names, calls
    other than the math functions, attributes, strings, huge powers)."""
    if len(expression) > MAX_EXPR:
        raise ValueError(f"expression longer than {MAX_EXPR} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from e
    return _eval(tree.body)


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
            raise ValueError("power too large")
        if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 1e300:
            raise ValueError("product too large")
        try:
            return _BIN[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise ValueError("division by zero") from e
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS and not node.keywords and len(node.args) == 1):
        try:
            return _FUNCS[node.func.id](_eval(node.args[0]))
        except (ValueError, OverflowError) as e:
            raise ValueError(f"{node.func.id}: {e}") from e
    raise ValueError(f"not allowed in a calculation: {ast.unparse(node)[:40]!r}")


def search(index: DocIndex | None, query: str) -> str:
    """The best three passages for query, as a short text with their sources."""
    if index is None:
        return "no documents to search: attach some first"
    passages = index.search(query, k=3)
    if not passages:
        return "nothing found"
    return "\n".join(f"[{p.source} #{p.index + 1}] {' '.join(p.text.split()[:60])}"
                     for p in passages)


def run_tool(name: str, arguments: str, index: DocIndex | None) -> str:
    """One call's result as text (errors included: the model reads them too)."""
    try:
        args = json.loads(arguments or "{}")
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
        if name == "calculator":
            value = calculate(str(args.get("expression", "")))
            out = str(int(value)) if isinstance(value, float) and value.is_integer() \
                and abs(value) < 1e15 else str(value)
        elif name == "search_documents":
            out = search(index, str(args.get("query", "")))
        else:
            out = f"error: no tool named {name!r}"
    except (ValueError, TypeError, OverflowError) as e:
        out = f"error: {e}"
    return out[:MAX_RESULT]


def definitions(names: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """OpenAI tool definitions of the enabled built-ins (ValueError for an unknown name)."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tool(s) {', '.join(unknown)}; built-in: {', '.join(TOOLS)}")
    return [TOOLS[n] for n in names]


def follow_up(body: dict[str, Any], text: str, calls: list[dict], results: list[str],
              last: bool, room: int | None = None) -> dict[str, Any]:
    """The next request: the model's calls and their results appended to its messages;
    room: the tokens the context still has after them (max_tokens is cut to fit)."""
    turns = [{"role": "assistant", "content": text, "tool_calls": calls}]
    turns += [{"role": "tool", "tool_call_id": c["id"], "content": r}
              for c, r in zip(calls, results, strict=True)]
    out = {**body, "messages": body["messages"] + turns,
           "tool_choice": "none" if last else "auto"}
    if room is not None and "max_tokens" in body:
        out["max_tokens"] = max(1, min(body["max_tokens"], room))
    return out


def room_after(context_len: int | None, usage: dict[str, Any], results: list[str]) -> int | None:
    """Tokens left for the next answer: the context less the last request's prompt and
    answer (usage) and the results (two characters a token, and a margin for the template);
    None when the context or the usage is unknown."""
    used = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    if not context_len or not used:
        return None
    return context_len - used - sum(len(r) for r in results) // 2 - 32


def expand_history(messages: list[Any]) -> list[dict[str, Any]]:
    """Stored messages -> the model's turns: a reply that called tools becomes its call turn,
    the tool turns and then its text (skipped when empty)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = (m.meta or {}).get("tool_calls") if m.role == "assistant" else None
        if calls:
            out.append({"role": "assistant", "content": m.meta.get("tool_text") or "",
                        "tool_calls": calls})
            for r in m.meta.get("tool_results", []):
                out.append({"role": "tool", "tool_call_id": r["id"], "content": r["content"]})
        if m.content:
            out.append({"role": m.role, "content": m.content})
    return out
