"""Strict JSON schemas, as OpenAI's function calling and xgrammar's strict mode read them: an object
schema that lists `properties` admits no other properties, and a tuple (`prefixItems`) no further
items, unless the schema says otherwise (`additionalProperties`, `items`, or their `unevaluated*`
forms). Objects and arrays that list nothing (`{"type": "object"}`) stay free-form, as in xgrammar.

A small model needs this to stop: with the JSON Schema default (anything not forbidden is allowed)
the grammar lets it add properties until the token limit. llguidance ignores keywords it does not
know and refuses `unevaluatedProperties`/`unevaluatedItems`, so closing is spelled with
`additionalProperties: false` and `items: false`, which it implements.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema / a list of them / a map of name -> subschema.
ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
       "unevaluatedItems", "unevaluatedProperties", "additionalItems")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_schema(schema: Any) -> Any:
    """A copy of `schema` with every object that lists properties closed and every tuple closed,
    recursively (the input is not changed)."""
    if isinstance(schema, list):  # draft-4 tuple `items: [...]`
        return [close_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ONE:
        if key in out:
            out[key] = close_schema(out[key])
    for key in MANY:
        if isinstance(out.get(key), list):
            out[key] = [close_schema(s) for s in out[key]]
    for key in NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_schema(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out
