"""Allowed-token masks for the constrained rows of a batch, applied in one pass.

The bitmasks of all constrained rows are filled together (llguidance fills them in parallel, off
the GIL) into one preallocated int32 bitmask, then applied to the logits in place (masked tokens
get -inf); unconstrained rows are not touched, so they sample exactly as without the others.
"""

from __future__ import annotations

import llguidance
import llguidance.torch as lgt
import torch


class GrammarMasks:
    def __init__(self, vocab_size: int, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.bitmask = lgt.allocate_token_bitmask(max_rows, vocab_size)
        self.executor = llguidance.LLExecutor()

    def apply(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
        """Mask, in place, the rows of `logits [rows, >= vocab]` whose matcher is not None."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        if logits.shape[0] > self.bitmask.shape[0]:
            self.bitmask = lgt.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        lgt.fill_next_token_bitmask_par(self.executor, rows, self.bitmask)
        index = torch.tensor([i for _, i in rows], device=logits.device)
        bitmask = self.bitmask[index].to(logits.device, non_blocking=True)
        part = logits[index]
        lgt.apply_token_bitmask_inplace(part[:, :self.vocab_size], bitmask)
        part[:, self.vocab_size:] = float("-inf")
        logits[index] = part

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
        """Consume a sampled token; True while the matcher has not stopped (it stops when nothing but
        EOS can follow, or the grammar is complete and the token was EOS)."""
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {matcher.get_error()}")
        return not matcher.is_stopped()
