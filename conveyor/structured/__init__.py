"""Structured outputs: generation constrained by a JSON schema, a regex, a choice or a grammar.

The user-facing `StructuredOutputsParams` (vLLM's names) lives in `sampling_params` and is
re-exported here; `grammars` turns one into a grammar of the grammar engine (llguidance), validated
and cached; `masks` applies the allowed-token bitmasks to a batch's logits in one pass and advances
each request's matcher; `constraints` is the engine's side (a request's matcher, the token it
consumes). The llguidance-backed parts load on
first use, so a plain `import conveyor` does not import llguidance (nor, through it, triton).
"""

from __future__ import annotations

from typing import Any

from ..sampling_params import StructuredOutputsParams

__all__ = ["GrammarCache", "GrammarMasks", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "GrammarCache":
        from .grammars import GrammarCache
        return GrammarCache
    if name == "GrammarMasks":
        from .masks import GrammarMasks
        return GrammarMasks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
