"""Constrained throughput: the same workload with every request constrained by a JSON schema.

`conveyor bench throughput --structured json` (a built-in schema: an object of strings, an integer,
an enum and a bounded array, the shape of a typical extraction reply) or
`--structured-json-schema FILE` runs Conveyor a second time with that constraint on every request
and reports its output tok/s next to the plain run's, and their ratio (the constraint should cost under 10%:
a ratio >= 0.9).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..sampling_params import StructuredOutputsParams

BUILTIN_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["title", "summary", "year", "genre", "tags"],
    "properties": {"title": {"type": "string", "maxLength": 40}, "summary": {"type": "string"},
                   "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                   "genre": {"enum": ["drama", "comedy", "science fiction", "documentary"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8}},
}


def add_structured_arguments(parser: Any) -> None:
    group = parser.add_argument_group("structured outputs (a second, constrained run of the same requests)")
    group.add_argument("--structured", choices=("json",), default=None,
                       help="constrain every request by a built-in JSON schema")
    group.add_argument("--structured-json-schema", default=None, metavar="FILE",
                       help="constrain every request by the JSON schema in FILE")


def structured_from_args(args: Any) -> StructuredOutputsParams | None:
    if args.structured and args.structured_json_schema:
        raise SystemExit("error: give either --structured or --structured-json-schema, not both")
    if args.structured_json_schema:
        try:
            return StructuredOutputsParams(json=json.loads(Path(args.structured_json_schema).read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: --structured-json-schema: {exc}") from None
    return StructuredOutputsParams(json=BUILTIN_SCHEMA) if args.structured == "json" else None
