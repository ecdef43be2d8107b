"""Qwen3-Coder's XML tool calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it becomes JSON by the type the tool's schema gives it (integer,
number, boolean, object/array as JSON, null), as Qwen's own parser does; a value of unknown type
is a JSON value when it parses as one, else a string."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from .base import Region, ToolParser, load_json

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def schema_types(schema: Any) -> list[str]:
    """The JSON types a property schema allows (`type`, a list of them, an enum's values, or the
    branches of anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if isinstance(schema.get("enum"), list):
        names = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}
        return [names.get(type(v), "any") for v in schema["enum"]]
    return [t for branch in schema.get("anyOf", schema.get("oneOf", [])) for t in schema_types(branch)]


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for (the text itself when it does not fit)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    types = [t for t in schema_types(schema) if t != "null"]
    if value.strip().lower() == "null" and (not types or "null" in schema_types(schema)):
        return None
    kind = types[0] if types else "any"
    if kind in ("string", "str", "text", "enum"):
        return value
    text = value.strip()
    if kind in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            return value
    if kind in ("number", "float"):
        try:
            number = float(text)
        except ValueError:
            return value
        return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", text) else number
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(text.lower(), value)
    ok, parsed = load_json(text)
    if ok:
        return parsed
    if kind in ("object", "array", "dict", "list"):
        try:
            return ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return value
    return value


class Qwen3XmlParser(ToolParser):
    name = "qwen3_xml"
    families = "Qwen3-Coder, Qwen3 2507 XML calls (`qwen3_coder` too)"
    example = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    starts = ("<tool_call>", "<function=")

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        close_tag = "</tool_call>" if marker == "<tool_call>" else "</function>"
        close = text.find(close_tag, at)
        if close < 0 and not finished:
            return None
        end = close + len(close_tag) if close >= 0 else len(text)
        calls = []
        for function in FUNCTION.finditer(text, at, close if marker == "<tool_call>" and close >= 0 else end):
            name = function.group(1).strip()
            schema = self.schemas.get(name)
            properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
            arguments = {p.group(1).strip(): convert(p.group(2), properties.get(p.group(1).strip()))
                         for p in PARAMETER.finditer(function.group(2))}
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return Region(end, calls or None)
