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


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TAG = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}],
       "triggers": ["<function="]}


def walk(cache: GrammarCache, tokenizer, matcher, text: str) -> list[str]:
    """Feed `text`'s tokens while the mask allows them; the tokens fed (all of them if the grammar takes it)."""
    fed = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not allowed(cache, matcher)[token]:
            break
        GrammarMasks.advance(matcher, token)
        fed.append(tokenizer.decode([token]))
    return fed


def test_a_structural_tag_constrains_only_what_follows_its_trigger(built_in) -> None:
    """vLLM's structural tag: free text and EOS before and after; after the trigger, the structure's begin, a
    body that follows its schema (a wrong key is masked) and its end; EOS not inside it."""
    cache, tokenizer, eos = built_in
    text = 'It is sunny. <function=get_weather>{"city": "Paris"}</function> Done.'
    for spec in (TAG, json.dumps(TAG)):
        matcher = cache.matcher(StructuredOutputsParams(structural_tag=spec))
        assert allowed(cache, matcher)[eos]
        assert "".join(walk(cache, tokenizer, matcher, text)) == text
        assert allowed(cache, matcher)[eos]
    matcher = cache.matcher(StructuredOutputsParams(structural_tag=TAG))
    fed = walk(cache, tokenizer, matcher, 'Hi <function=get_weather>{"town": "Paris"}')
    assert "".join(fed).endswith('{"') and not allowed(cache, matcher)[eos]  # "town" masked, and no EOS mid-call
    free = cache.matcher(StructuredOutputsParams(structural_tag=TAG))
    assert "".join(walk(cache, tokenizer, free, 'Any {"town": 1} text')) == 'Any {"town": 1} text'


@pytest.mark.parametrize("bad, message", [
    ({"structures": TAG["structures"]}, "triggers must be a non-empty list"),
    ({"triggers": ["<f"], "structures": []}, "structures must be a non-empty list"),
    ({"triggers": ["<tool>"], "structures": TAG["structures"]}, r"structures\[0\].begin '<function=get_weather>' "
                                                                 "starts with none of the triggers"),
    ({"triggers": ["<f"], "structures": [{"begin": "<f>", "end": "</f>"}]}, r"structures\[0\] needs begin and end"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "the `format` form .* is not supported"),
    ("[1]", "must be a JSON object with structures and triggers"),
])
def test_bad_structural_tags_are_value_errors_naming_the_part(built_in, bad, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        built_in[0].matcher(StructuredOutputsParams(structural_tag=bad))
