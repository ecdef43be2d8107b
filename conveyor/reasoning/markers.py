"""vLLM's `ReasoningConfig`: the reasoning markers a `thinking_token_budget` counts between and forces,
as token ids of the model's tokenizer (`reasoning_state.ReasoningMarkers`).

The markers come from a reasoning parser's format (`reasoning_parser`: its first start marker, its end
markers) or from the strings given (`reasoning_start_str`, `reasoning_end_str`; the end string is what
a budget's end forces, and may put a phrase before the end marker, as vLLM's). gpt-oss's channels are
not one block: its budget needs the strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..reasoning_state import Marker, ReasoningMarkers
from . import get_reasoning_parser
from .base import BlockParser


@dataclass(frozen=True)
class ReasoningConfig:
    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""

    @classmethod
    def of(cls, value: ReasoningConfig | dict[str, Any] | None, parser: str | None = None) -> ReasoningConfig | None:
        """`LLM(reasoning_config=...)` as given (a dict of the fields, as vLLM's JSON), with `reasoning_parser`
        (`LLM(reasoning_parser=...)`) where the config names none; None when neither says anything."""
        if isinstance(value, dict):
            unknown = set(value) - {"reasoning_parser", "reasoning_start_str", "reasoning_end_str"}
            if unknown:
                raise ValueError(f"reasoning_config takes reasoning_parser, reasoning_start_str and "
                                 f"reasoning_end_str; got {sorted(unknown)}")
            value = cls(**value)
        if value is None:
            return cls(reasoning_parser=parser) if parser else None
        if parser and value.reasoning_parser and parser != value.reasoning_parser:
            raise ValueError(f"reasoning_parser {parser!r} and reasoning_config's {value.reasoning_parser!r} differ")
        return cls(parser or value.reasoning_parser, value.reasoning_start_str, value.reasoning_end_str)

    def markers(self, tokenizer: Any) -> ReasoningMarkers:
        """The markers as token ids; a ValueError where the parser's format has no single block and no
        strings are given, or a string encodes to nothing."""
        parser = get_reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        block = parser if parser is not None and issubclass(parser, BlockParser) else None
        starts = (self.reasoning_start_str,) if self.reasoning_start_str else block.starts if block else ()
        ends = block.ends if block else ()
        end = self.reasoning_end_str or (ends[0] if ends else "")
        if not starts or not end:
            what = f"the {parser.name} parser's format is not one marked block" if parser else "no reasoning parser"
            raise ValueError(f"reasoning markers: {what}; give reasoning_config's reasoning_start_str and "
                             "reasoning_end_str")

        def ids(text: str) -> Marker:
            encoded = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not encoded:
                raise ValueError(f"reasoning marker {text!r} encodes to no tokens")
            return encoded

        natural = tuple(ids(e) for e in ends) or (ids(end),)
        return ReasoningMarkers(tuple(ids(s) for s in starts), natural, ids(end),
                                opens_unmarked=bool(block and block.assume_open and not self.reasoning_start_str))
