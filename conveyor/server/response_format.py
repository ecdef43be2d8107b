"""The output constraint and logit bias a request body asks for, checked into engine parameters.

OpenAI's `response_format` (`json_object`, `json_schema`, and vLLM's `structural_tag`), vLLM's extra body field
`structured_outputs` (json, regex, choice, grammar, json_object, structural_tag), its earlier `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` (which vLLM has since dropped, so that their
requests silently lose the constraint there) and llama.cpp's `grammar` (GBNF), `json_schema` and
`json_object` with a `schema` all become a `StructuredOutputsParams`; a
`json_schema` with `strict: true` is closed first (no properties or items beyond those it lists,
`structured.strict`), as OpenAI reads it. `logit_bias` arrives with string keys (JSON objects have
no others).
Malformed fields are 400s naming the field; a constraint that does not compile is refused by the
engine's `make_request`, also before anything is queued.
"""

from __future__ import annotations

from typing import Any

from ..sampling_params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams
from ..structured.strict import close_schema
from .protocol import APIError, SamplingFields

FORMATS = ("text", "json_object", "json_schema", "structural_tag")
# vLLM's earlier fields -> the `structured_outputs` key each one is
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def body_constraint(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field it came from) or (None, None)."""
    fmt, extra = body.response_format, body.structured_outputs
    guided = {name: value for name, value in (body.model_extra or {}).items() if name in GUIDED and value is not None}
    given = [name for name, on in (("response_format", fmt is not None and fmt.get("type", "text") != "text"),
                                   ("structured_outputs", bool(extra)), ("grammar", body.grammar is not None),
                                   ("json_schema", body.json_schema is not None)) if on] + list(guided)
    if len(given) > 1:
        raise APIError(400, f"give one constraint, not {' and '.join(given)}", param=given[-1])
    field = "structured_outputs"
    if guided:  # as structured_outputs, the field named in its errors
        [(field, value)] = guided.items()
        extra = {GUIDED[field]: value}
    if body.grammar is not None:
        return StructuredOutputsParams(grammar=body.grammar), "grammar"
    if body.json_schema is not None:
        return StructuredOutputsParams(json=body.json_schema), "json_schema"
    if extra:
        unknown = sorted(set(extra) - set(STRUCTURED_OUTPUT_KINDS))
        if unknown:
            raise APIError(400, f"invalid {field}: unknown field(s) {unknown}; give one of "
                           f"{', '.join(STRUCTURED_OUTPUT_KINDS)}", param=field)
        try:
            return StructuredOutputsParams(**extra), field
        except (TypeError, ValueError) as exc:
            raise APIError(400, f"invalid {field}: {exc}", param=field) from exc
    if fmt is None:
        return None, None
    kind = fmt.get("type", "text")
    if kind not in FORMATS:
        raise APIError(400, f"response_format.type must be one of {', '.join(FORMATS)}, got {kind!r}",
                       param="response_format")
    if kind == "text":
        return None, None
    if kind == "structural_tag":  # vLLM's: {"type": "structural_tag", "structures": [...], "triggers": [...]}
        return StructuredOutputsParams(structural_tag={k: v for k, v in fmt.items() if k != "type"}), "response_format"
    if kind == "json_object":  # llama.cpp takes a schema there too
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise APIError(400, "response_format.schema must be a JSON schema object", param="response_format")
        return StructuredOutputsParams(json=schema) if schema else StructuredOutputsParams(json_object=True), \
            "response_format"
    spec: Any = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise APIError(400, 'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                       param="response_format")
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object", param="response_format")
    if spec.get("strict") is True:
        schema = close_schema(schema)
    return StructuredOutputsParams(json=schema), "response_format"


def logit_bias(body: SamplingFields) -> dict[int, float]:
    """OpenAI's `{"token id": bias}` with integer keys (range checks follow in SamplingParams / make_request)."""
    out = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    return out
