"""The engine's side of structured outputs: a request's matcher when it is made, the tokens it consumes.

`Constraints.matcher` runs in `Engine.make_request`, on the caller's thread (the server's worker,
the user's), so a bad constraint is an error before anything is queued and a slow compile never
stalls the engine loop. The grammar cache (and llguidance's tokenizer, about a second to build) is
made on the first constrained request, so plain serving never pays for it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from ..sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from .grammars import GrammarCache


class Constraints:
    """Matchers for the requests of one engine (its tokenizer, vocabulary and EOS tokens)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    @property
    def cache(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                from .grammars import GrammarCache
                self._cache = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._cache

    def matcher(self, params: StructuredOutputsParams | None) -> llguidance.LLMatcher | None:
        """A fresh matcher for the constraint (None without one); a ValueError naming a bad constraint."""
        return None if params is None else self.cache.matcher(params)


def grammar_complete(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Consume an appended token; True when the grammar is complete and only EOS could follow (or EOS
    ended it), so the request finishes with "stop". A token the grammar rejects raises."""
    from .masks import GrammarMasks
    return not GrammarMasks.advance(matcher, token)
