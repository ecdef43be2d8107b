"""Structured outputs: generation constrained by a JSON schema, a regex, a choice or a grammar.

`params` is the user-facing `StructuredOutputsParams` (vLLM's names); `grammars` turns one into a
grammar of the grammar engine (llguidance), validated and cached; `masks` applies the allowed-token
bitmasks to a batch's logits in one pass and advances each request's matcher.
"""

from .grammars import GrammarCache
from .masks import GrammarMasks
from .params import StructuredOutputsParams

__all__ = ["GrammarCache", "GrammarMasks", "StructuredOutputsParams"]
