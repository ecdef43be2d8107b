"""Structured outputs' parts: constraints, the grammar cache, and batch masks (no engine)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conveyor.sampling_params import StructuredOutputsParams
from conveyor.structured import GrammarCache, GrammarMasks


@pytest.fixture(scope="module")
def built_in():
    from conveyor import LLM

    llm = LLM(dtype="float32")  # the built-in tokenizer: a real BPE vocabulary
    eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return GrammarCache(llm.tokenizer, llm.engine.model.config.vocab_size, [eos]), llm.tokenizer, eos


def constrained_decode(built_in, params: StructuredOutputsParams, seed: int, max_tokens: int = 300) -> str:
    """Random logits through the mask, then argmax, until the matcher stops: what any model would emit."""
    cache, tokenizer, eos = built_in
    matcher = cache.matcher(params)
    masks = GrammarMasks(cache.vocab_size, 4)
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = torch.randn(2, cache.vocab_size, generator=g)
        plain = logits[0].clone()
        masks.apply(logits, [None, matcher])
        assert torch.equal(logits[0], plain)  # an unconstrained row is untouched
        token = int(logits[1].argmax())
        if token == eos:
            break
        out.append(token)
        if not masks.advance(matcher, token):
            break
    return tokenizer.decode(out)


@pytest.mark.parametrize("bad, field", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"choice": []}, "choice"),
    ({"json": 3}, "json"),
])
def test_params_need_exactly_one_valid_constraint(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**bad)


@pytest.mark.parametrize("bad, message", [
    (StructuredOutputsParams(regex="[0-9"), "regex"),
    (StructuredOutputsParams(json={"type": "objecto"}), "objecto"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(grammar="root ::= ( "), "grammar"),
])
def test_invalid_constraints_are_value_errors_naming_the_problem(built_in, bad, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        built_in[0].matcher(bad)


def test_the_cache_keeps_one_grammar_per_distinct_constraint(built_in) -> None:
    cache = built_in[0]
    before = len(cache)
    a = cache.grammar(StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = cache.grammar(StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert a is b and len(cache) == before + 1


SCHEMA = {"type": "object", "required": ["name", "age", "tags", "ok", "size"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb"]},
                                  "minItems": 1, "maxItems": 3},
                         "ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
          "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_any_logits_give_output_that_validates_against_the_schema(built_in, seed: int) -> None:
    value = json.loads(constrained_decode(built_in, StructuredOutputsParams(json=SCHEMA), seed))
    assert set(value) == set(SCHEMA["required"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and value["age"] >= 0
    assert 1 <= len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "bb"}
    assert isinstance(value["ok"], bool) and value["size"] in ("S", "M", "L")


def test_regex_choice_grammar_and_json_object(built_in) -> None:
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", constrained_decode(built_in, StructuredOutputsParams(
        regex=r"[0-9]{3}-[a-z]{2}"), 0))
    assert constrained_decode(built_in, StructuredOutputsParams(choice=["yes", "no", "maybe so"]), 1) in (
        "yes", "no", "maybe so")
    assert constrained_decode(built_in, StructuredOutputsParams(grammar='root ::= "up" | "down"'), 2) in ("up", "down")


def allowed(cache: GrammarCache, matcher) -> torch.Tensor:
    logits = torch.zeros(1, cache.vocab_size)
    GrammarMasks(cache.vocab_size, 1).apply(logits, [matcher])
    return logits[0] == 0


def test_json_object_accepts_an_object_and_masks_what_breaks_it(built_in) -> None:
    cache, tokenizer, eos = built_in
    matcher = cache.matcher(StructuredOutputsParams(json_object=True))
    for token in tokenizer.encode('{"a": [1, 2], "b": "x"}', add_special_tokens=False):
        assert allowed(cache, matcher)[token]
        GrammarMasks.advance(matcher, token)
    assert allowed(cache, matcher).nonzero().flatten().tolist() == [eos]  # complete: only EOS may follow
    fresh = cache.matcher(StructuredOutputsParams(json_object=True))
    assert not allowed(cache, fresh)[tokenizer.encode("[", add_special_tokens=False)[0]]  # not an object
