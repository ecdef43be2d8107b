"""A small JSON-schema checker for the keywords the structured-output tests use (jsonschema is not a
dependency): type, properties, required, additionalProperties, enum, items, minItems/maxItems,
minimum/maximum, minLength/maxLength, anyOf, const. Raises AssertionError naming the path."""

from __future__ import annotations

from typing import Any

TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def check(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                return check(value, option, path)
            except AssertionError as exc:
                errors.append(str(exc))
        raise AssertionError(f"{path}: matches no anyOf option ({'; '.join(errors)})")
    kind = schema.get("type")
    if kind in ("integer", "number"):
        assert isinstance(value, int if kind == "integer" else (int, float)) and not isinstance(value, bool), \
            f"{path}: {value!r} is not {kind}"
        assert value >= schema.get("minimum", value) and value <= schema.get("maximum", value), f"{path}: {value} out of range"
    elif kind is not None:
        assert isinstance(value, TYPES[kind]), f"{path}: {value!r} is not {kind}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != {schema['const']!r}"
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)), f"{path}: length"
    if isinstance(value, list):
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), \
            f"{path}: {len(value)} items"
        for i, item in enumerate(value):
            check(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        missing = set(schema.get("required", [])) - set(value)
        assert not missing, f"{path}: missing {sorted(missing)}"
        properties = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(properties), f"{path}: extra keys {sorted(set(value) - set(properties))}"
        for key, item in value.items():
            if key in properties:
                check(item, properties[key], f"{path}.{key}")
