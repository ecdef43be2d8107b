"""Allowed-token masks for the constrained rows of a batch, applied in one pass.

The bitmasks of all constrained rows are filled together (llguidance fills them in parallel, off
the GIL) into one preallocated int32 bitmask (pinned on CUDA), copied to the logits' device once,
unpacked there with plain tensor ops (no compiled kernel, so no first-call compile on any device)
and applied to those rows (masked tokens get -inf); unconstrained rows are not touched, so they
sample exactly as without the others.
"""

from __future__ import annotations

import llguidance
import llguidance.torch as lgt
import torch
import torch.nn.functional as F

from ..transfer import to_device


class GrammarMasks:
    def __init__(self, vocab_size: int, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.bitmask = lgt.allocate_token_bitmask(max_rows, vocab_size)
        self.executor = llguidance.LLExecutor()
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
        """Mask, in place, the rows of `logits [rows, >= vocab]` whose matcher is not None."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        if len(rows) > self.bitmask.shape[0]:
            self.bitmask = lgt.allocate_token_bitmask(len(rows), self.vocab_size)
        lgt.fill_next_token_bitmask_par(self.executor, [(matchers[i], j) for j, i in enumerate(rows)], self.bitmask)
        device, width = logits.device, logits.shape[1]
        words = self.bitmask[:len(rows)].to(device, non_blocking=True)
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :self.vocab_size].bool()
        if width > self.vocab_size:  # columns past the grammar's vocabulary: never allowed
            allowed = F.pad(allowed, (0, width - self.vocab_size))
        index = to_device(rows, torch.long, device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
        """Consume a sampled token; True while the matcher has not stopped (it stops when nothing but
        EOS can follow, or the grammar is complete and the token was EOS)."""
        if not matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {matcher.get_error()}")
        return not matcher.is_stopped()
