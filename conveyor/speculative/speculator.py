"""Who speculates this step, with which proposals; and what a verified run leaves behind.

A decoding request's proposals ride in its row as extra query tokens (a decode becomes a
(k+1)-token chunk); one pass verifies them (`rejection.verify`). Speculation is for the small
batches that leave compute idle: it is off while more than `disable_by_batch_size` requests are
running, and for requests it cannot serve exactly here: penalties and `min_tokens` (they depend on
each earlier token), logit_bias, logprobs, prompt logprobs, and models with sliding-window layers (a rejected
position would already have overwritten a ring slot still in the window). Proposals never run past
`max_new_tokens` or the context length, so an accepted run ends where plain decoding would.
Requests under a grammar (structured outputs) or a thinking budget do not speculate either: their tokens
are masked or forced.

The `Speculator` is the scheduler's `Proposer`: n-gram proposals are made while scheduling; for a
draft model it reserves their number (placeholders), and the engine's draft runner
(`engine.draft_runner`) fills them for all speculating requests at once after scheduling.
"""

from __future__ import annotations

import numpy as np

from ..request import Request
from .config import SpeculativeConfig
from .ngram import NgramProposer

# With more running requests than this, a step is compute-bound enough that verifying proposals
# costs more than it saves (chat64 at 64 concurrent must not slow down).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, sliding: bool,
                 rope_switch: int | None = None) -> None:
        """`rope_switch`: the target's (`CausalLM.rope_switch`): proposals stop short of it."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = None
        if config.method == "ngram":
            assert config.prompt_lookup_max is not None and config.prompt_lookup_min is not None
            self.proposer = NgramProposer(self.k, config.prompt_lookup_max, config.prompt_lookup_min)
        self.max_model_len = max_model_len
        self.sliding = sliding
        self.rope_switch = rope_switch
        self.disable_by_batch_size = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        self.num_drafts = 0  # verification steps with at least one proposal (vLLM's counters)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    def active(self, num_running: int) -> bool:
        return not self.sliding and num_running <= self.disable_by_batch_size

    @staticmethod
    def serves(request: Request) -> bool:
        p = request.params
        return (not request.runs_synchronously and not p.logit_bias and not request.restricts_tokens
                and p.repetition_penalty == 1.0
                and not p.presence_penalty and not p.frequency_penalty
                and len(request.output_token_ids) >= p.min_tokens and p.logprobs is None
                and p.prompt_logprobs is None)

    def propose(self, request: Request, budget: int) -> list[int]:
        """Proposals for a decoding request, at most `budget` tokens (the pass's token budget left
        after its own token) and never past its `max_new_tokens` or the context length, nor past the
        model's RoPE switch while the request is short of it (a pass that crosses it would verify against
        K/V the switch recomputes: `Engine._switch_rope`)."""
        room = min(self.k, budget, request.params.max_new_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - request.num_tokens - 1)
        if self.rope_switch is not None and request.rope_length <= self.rope_switch:
            room = min(room, self.rope_switch - request.num_tokens)
        if room < 1 or not self.serves(request):
            return []
        if self.proposer is None:
            return [-1] * room  # placeholders: the engine's draft runner writes the draft model's proposals
        tokens = np.asarray(request.prompt_token_ids + request.output_token_ids, dtype=np.int64)
        return self.proposer.propose(tokens, room)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed:
            self.num_drafts += 1
            self.num_draft_tokens += num_proposed
            self.num_accepted_tokens += num_accepted
            for pos in range(num_accepted):
                self.accepted_per_pos[pos] += 1

    def stats(self) -> dict[str, object]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.accepted_per_pos)}
