"""Constraints compiled into llguidance grammars: validated before a request is queued, cached.

llguidance was chosen over xgrammar by measurement (64 JSON-schema requests, built-in tokenizer,
busy 2-core machine, per step): mask fill 14.7 ms against 47.4 ms, first compile 180 ms against
913 ms (docs/design/structured-outputs.md). It compiles lazily, so a grammar costs little until its matchers run; what
is cached per distinct constraint is the grammar text, its validation and a pristine matcher that
each request's matcher is copied from.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark
from transformers import PreTrainedTokenizerBase

from ..sampling_params import StructuredOutputsParams


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


# JSON is written compactly (one space after ':' and ','; no free whitespace): a small model left free
# to choose whitespace can emit newlines until max_tokens, and the output never parses.
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _json_grammar(schema: dict | str) -> str:
    value = json.loads(schema) if isinstance(schema, str) else dict(schema)
    if not isinstance(value, dict):
        raise ValueError("structured_outputs.json must be a JSON schema object")
    value.setdefault("x-guidance", JSON_LAYOUT)
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value))


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON envelope) for a constraint."""
    kind = params.kind
    if kind == "json":
        assert params.json is not None
        return _json_grammar(params.json)
    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "regex":
        assert params.regex is not None
        try:
            re.compile(params.regex)
        except re.error as exc:
            raise ValueError(f"structured_outputs.regex is not a valid regular expression: {exc}") from exc
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        return llguidance.grammar_from("lark", "start: " + " | ".join(_lark_string(c) for c in params.choice))
    if kind == "structural_tag":
        assert params.structural_tag is not None
        return _structural_tag_grammar(params.structural_tag)
    assert params.grammar is not None
    try:
        lark = any_to_lark(params.grammar)
    except Exception as exc:  # the converter raises its own error types
        raise ValueError(f"structured_outputs.grammar could not be read: {exc}") from exc
    return llguidance.grammar_from("lark", lark)


def _structural_tag_grammar(spec: dict | str) -> str:
    """vLLM's structural tag (its form with `structures` and `triggers`, which its llguidance backend takes):
    free text in which each trigger opens the structure whose `begin` starts with it."""
    value = json.loads(spec) if isinstance(spec, str) else spec
    name = "structured_outputs.structural_tag"
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object with structures and triggers")
    if "format" in value and "structures" not in value:
        raise ValueError(f"{name}: the `format` form (xgrammar's) is not supported; give `structures` "
                         '([{"begin", "schema", "end"}]) and `triggers`')
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{name}.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{name}.structures must be a non-empty list of {{begin, schema, end}}")
    tags = []
    for i, item in enumerate(structures):
        if not (isinstance(item, dict) and isinstance(item.get("begin"), str) and isinstance(item.get("end"), str)
                and isinstance(item.get("schema"), dict)):
            raise ValueError(f"{name}.structures[{i}] needs begin and end (strings) and schema (a JSON schema object)")
        trigger = next((t for t in triggers if item["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"{name}.structures[{i}].begin {item['begin']!r} starts with none of the triggers "
                             f"{triggers}")
        schema = {"x-guidance": JSON_LAYOUT} | item["schema"]  # (the schema itself: StructTag embeds it as %json)
        tags.append(llguidance.StructTag(trigger=trigger, begin=item["begin"], grammar=schema, end=item["end"]))
    return llguidance.StructTag.to_grammar(tags)


class GrammarCache:
    """Validated grammars per distinct constraint (LRU, `capacity` entries), and the matchers made
    from them. Thread-safe: requests are validated on the callers' threads, not the engine's."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int],
                 capacity: int = 256) -> None:
        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar text -> pristine matcher
        self._lock = threading.Lock()

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The constraint's grammar, validated against the tokenizer; a ValueError naming the problem."""
        key = params.key()
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        text = grammar_text(params)
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{params.kind} is not a valid constraint: {error.strip()}")
        with self._lock:
            self._grammars[key] = text
            while len(self._grammars) > self.capacity:
                self._grammars.popitem(last=False)
        return text

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher: a copy of the constraint's pristine one (copying costs microseconds, building
        one from the grammar text a few milliseconds)."""
        text = self.grammar(params)
        with self._lock:
            template = self._matchers.get(text)
            if template is not None:
                self._matchers.move_to_end(text)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, text)
            if template.is_error():
                raise ValueError(f"structured_outputs.{params.kind}: {template.get_error()}")
            with self._lock:
                self._matchers[text] = template
                while len(self._matchers) > self.capacity:
                    self._matchers.popitem(last=False)
        with self._lock:
            return template.deep_copy()

    def __len__(self) -> int:
        return len(self._grammars)
