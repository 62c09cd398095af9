"""JSON schemas for the structured-output tests (layer 4's engine, layer 6's API): nested
objects, arrays, enums, numbers with bounds, required fields, anyOf, const, patterns.

The course model is tiny and writes Shakespeare: left free, it may never close a string or
stop a run of digits, and max_tokens would cut the JSON. So strings, arrays and numbers here
are bounded (maxLength, maxItems, enum, pattern; multipleOf bounds a number's decimals), as a
schema for a small model should be; what
is tested is that the mask keeps every output inside its schema, not the model's taste."""
from __future__ import annotations

S = {"type": "string", "maxLength": 8}
INT = {"type": "integer", "minimum": 0, "maximum": 99}
NUM = {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.5}
BOOL = {"type": "boolean"}
COLOR = {"enum": ["red", "green", "blue"]}


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    out = {"type": "object", "properties": props,
           "required": list(props) if required is None else required,
           "additionalProperties": False}
    out.update(extra)
    return out


def arr(items: dict, lo: int = 0, hi: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


SCHEMAS: list[dict] = [
    obj({"name": S}),
    obj({"age": INT}),
    obj({"ok": BOOL}),
    obj({"x": NUM}),
    obj({"color": COLOR}),
    obj({"name": S, "age": INT}),
    obj({"name": S, "age": INT, "ok": BOOL}),
    obj({"name": S, "age": INT}, required=["name"]),
    obj({"name": S, "nick": S}, required=[]),
    obj({"kind": {"const": "point"}, "x": INT, "y": INT}),
    obj({"tags": arr(S)}),
    obj({"scores": arr(INT, 1, 4)}),
    obj({"flags": arr(BOOL, 2, 2)}),
    obj({"points": arr(obj({"x": INT, "y": INT}), 1, 2)}),
    obj({"colors": arr(COLOR, 1, 3)}),
    obj({"person": obj({"name": S, "age": INT})}),
    obj({"a": obj({"b": obj({"c": INT})})}),
    obj({"user": obj({"id": INT, "roles": arr({"enum": ["admin", "guest"]}, 1, 2)})}),
    obj({"id": {"anyOf": [INT, S]}}),
    obj({"value": {"anyOf": [BOOL, {"type": "null"}]}}),
    obj({"shape": {"anyOf": [obj({"r": INT}), obj({"w": INT, "h": INT})]}}),
    obj({"n": {"type": "integer", "minimum": 5, "maximum": 9}}),
    obj({"n": {"type": "integer", "minimum": -3, "maximum": 3}}),
    obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4}}),
    obj({"p": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}}),
    obj({"t": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25}}),
    obj({"year": {"type": "integer", "minimum": 1564, "maximum": 1616}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 5}}),
    obj({"level": {"enum": ["low", "mid", "high"]}, "n": INT}),
    obj({"mixed": {"enum": [1, "two", True, None]}}),
    obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"name": S, "address": obj({"city": S, "zip": {"type": "string",
                                                       "pattern": "^[0-9]{5}$"}})}),
    obj({"matrix": arr(arr(INT, 1, 2), 1, 2)}),
    obj({"items": arr(obj({"sku": S, "qty": INT}, required=["sku"]), 0, 2)}),
    obj({"play": {"enum": ["Hamlet", "Macbeth", "Othello"]}, "act": {"type": "integer",
                                                                      "minimum": 1,
                                                                      "maximum": 5}}),
    obj({"speaker": S, "line": {"type": "string", "maxLength": 12}}),
    obj({"ok": BOOL, "reason": {"anyOf": [{"type": "null"}, S]}}),
    obj({"rgb": arr({"type": "integer", "minimum": 0, "maximum": 255}, 3, 3)}),
    obj({"a": INT, "b": INT, "c": INT, "d": INT}),
    obj({"nested": obj({"list": arr(obj({"k": S}), 1, 2), "flag": BOOL})}),
    obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0,
                                                 "maximum": 9, "multipleOf": 0.1}}),
    obj({"result": {"anyOf": [obj({"ok": {"const": True}, "value": INT}),
                              obj({"ok": {"const": False}, "error": S})]}}),
    obj({"lang": {"enum": ["en", "fr"]}, "words": arr(S, 1, 2)}),
    obj({"temp": {"type": "number", "minimum": -40, "maximum": 50, "multipleOf": 0.5},
         "unit": {"enum": ["C", "F"]}}),
    obj({"q": {"type": "string", "enum": ["to be", "not to be"]}}),
    obj({"pair": arr({"anyOf": [INT, BOOL]}, 2, 2)}),
    obj({"meta": obj({"v": {"const": 1}, "name": S}, required=["v"])}),
    obj({"grid": arr(arr(BOOL, 2, 2), 2, 2)}),
    obj({"first": S, "last": S, "age": INT, "tags": arr(COLOR, 0, 2)}),
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 3},
    {"enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "boolean"},
]
