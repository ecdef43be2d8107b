"""`StructuredOutputsParams`: what the output must match (exactly one of the fields)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """json: a JSON schema (dict or JSON text); regex: a regular expression the whole output matches;
    choice: one of these strings exactly; grammar: a grammar in GBNF/EBNF (`root ::= ...`) or Lark
    syntax; json_object: any JSON object (OpenAI's `{"type": "json_object"}`)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def key(self) -> str:
        """A canonical text of the constraint: the grammar cache's key."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
        return f"{self.kind}:{json.dumps(value, sort_keys=True)}"
