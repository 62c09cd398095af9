"""Structured outputs at the API: OpenAI's `response_format` and vLLM's extra parameters ->
layer 4's `StructuredOutputsParams` (the engine masks the request's logits with its grammar).

    response_format {"type": "text"}                                   no constraint
                    {"type": "json_object"}                            any JSON object
                    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs {"json": schema} | {"regex": r} | {"choice": [..]} | {"grammar": lark}
                       | {"json_object": true}                         (vLLM's, both endpoints)
    guided_json / guided_regex / guided_choice / guided_grammar        (vLLM's older names)

A constraint that cannot compile (an unknown schema type, a regex that does not parse) is a
400 naming the field and the problem, before the request reaches the engine. `strict` is
accepted either way: the output always follows the schema here (the grammar enforces it).
"""
from __future__ import annotations

import layer5_parallel as l5

from .errors import OpenAIError

SO = l5.engine.StructuredOutputsParams
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def checked(spec_fields: dict, param: str) -> l5.engine.StructuredOutputsParams:
    """StructuredOutputsParams(**spec_fields), compiled once to check it: a 400 naming
    `param` and the problem otherwise."""
    try:
        spec = SO(**spec_fields)
        l5.engine.structured.check(spec)
    except (ValueError, TypeError) as e:
        raise _bad(f"{param}: {e}", param) from e
    return spec


def from_response_format(fmt: dict | None) -> l5.engine.StructuredOutputsParams | None:
    """OpenAI's response_format -> a constraint (None for "text" or no format)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("response_format must be an object with a 'type'", "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return checked({"json_object": True}, "response_format")
    if kind != "json_schema":
        raise _bad(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", "response_format.type")
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema must be an object with 'name' and 'schema'",
                   "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("response_format.json_schema.name is required (a string)",
                   "response_format.json_schema.name")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema must be a JSON schema (an object)",
                   "response_format.json_schema.schema")
    return checked({"json": schema}, "response_format.json_schema.schema")


def from_extras(extra: dict | None) -> l5.engine.StructuredOutputsParams | None:
    """vLLM's `structured_outputs` object or its `guided_*` fields (pydantic's extras of the
    request body) -> a constraint; None if none is given; a 400 if more than one is."""
    extra = extra or {}
    found: list[tuple[str, dict]] = []
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs must be an object, e.g. {\"regex\": \"...\"}",
                       "structured_outputs")
        unknown = sorted(set(so) - set(KINDS))
        if unknown:
            raise _bad(f"structured_outputs has unknown field(s) {', '.join(unknown)}; use one "
                       f"of {', '.join(KINDS)}", "structured_outputs")
        fields = {k: v for k, v in so.items() if v not in (None, False)}
        found.append(("structured_outputs", fields))
    for name, kind in GUIDED.items():
        if extra.get(name) is not None:
            found.append((name, {kind: extra[name]}))
    if extra.get("guided_json_object"):
        found.append(("guided_json_object", {"json_object": True}))
    if not found:
        return None
    if len(found) > 1:
        raise _bad(f"give one constraint, got {', '.join(n for n, _ in found)}", found[1][0])
    param, fields = found[0]
    return checked(fields, param)


def constraint(fmt: dict | None, extra: dict | None) -> l5.engine.StructuredOutputsParams | None:
    """The request's one constraint from response_format or vLLM's extras (400 for both)."""
    a, b = from_response_format(fmt), from_extras(extra)
    if a is not None and b is not None:
        raise _bad("give response_format or structured_outputs, not both", "structured_outputs")
    return a or b
