"""What a request's output must look like: a JSON schema, any JSON object, a regex, one of a
few strings, or a grammar (vLLM's `StructuredOutputsParams`).

Plain data, carried by `SamplingParams.structured_outputs` through every layer (and pickled
to an engine process). Layer 4 turns it into a grammar and a per-request token mask; this
layer only holds and checks its shape.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema: dict or its JSON text; stored as compact JSON
    text, its keys in the order given: the output's properties follow it), json_object=True
    (any JSON object), regex, choice (a list of strings), grammar (a Lark grammar,
    llguidance's dialect). `key` names the constraint (the cache key for its
    compiled grammar)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            text = json.dumps(self.json, separators=(",", ":"))
            object.__setattr__(self, "json", text)
        elif isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
            object.__setattr__(self, "json", json.dumps(parsed, separators=(",", ":")))
        elif self.json is not None:
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), "
                             f"got {type(self.json).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of strings")
            if not self.choice:
                raise ValueError("structured_outputs.choice is empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, "
                             f"choice, grammar; got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        """"json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar")
                    if getattr(self, n) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for equal constraints."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)
