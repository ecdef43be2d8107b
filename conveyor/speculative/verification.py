"""After a pass: verify each speculating chunk's proposals, decide what is accepted.

Every row of a speculating chunk is sampled exactly as plain decoding would sample it (argmax for
greedy requests; the request's own distribution and noise for sampled ones), and proposals are
accepted while they equal the row's token (`rejection.verify` on those tokens). For drafts that are
deterministic, as n-gram and greedy draft-model proposals are (q one-hot), this is the rejection
sampling of Leviathan et al.: proposal x is accepted with probability p(x), and a rejected position
takes a token distributed as norm(max(p - q, 0)) = p given "not x". It also keeps a seeded
request's tokens those of speculation off: each emitted token uses the uniform number plain decoding
would have drawn for it, and the generator is rewound to just after the rows actually used.

This module decides the tokens; the engine's `OutputProcessor.verify` appends them one by one (so
stops, EOS, `max_new_tokens` and the context length cut exactly) and rolls the cache back to the last
accepted proposal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.transfer import to_device
from ..layers.sampler import Sampler
from ..sched.output import ScheduledChunk
from .rejection import verify


def sample_rows(logits: torch.Tensor,
                chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Each row's token as plain decoding would draw it, and for seeded requests their generator's
    state after each of their rows (to rewind to the rows actually used)."""
    owners = [c.request for c in chunks for _ in range(c.num_tokens)]
    tokens = logits.argmax(dim=-1)
    states: list[list[torch.Tensor]] = [[] for _ in chunks]
    sampled = [i for i, r in enumerate(owners) if not r.params.greedy]
    if not sampled:
        return tokens, states
    device = logits.device
    rows = to_device(sampled, torch.long, device)
    chunk_of = [n for n, c in enumerate(chunks) for _ in range(c.num_tokens)]
    requests = [owners[i] for i in sampled]

    def keep_state(j: int) -> None:  # a seeded request's state after each of its rows, in row order
        states[chunk_of[sampled[j]]].append(requests[j].generator.get_state())

    tokens[rows] = Sampler.sample_with(logits.index_select(0, rows), requests,
                                       Sampler.uniforms(requests, device, keep_state))
    return tokens, states


def verify_chunks(logits: torch.Tensor,
                  chunks: Sequence[ScheduledChunk]) -> list[tuple[list[int], int, torch.Tensor | None]]:
    """Per speculating chunk (rows of `logits` in their order): the tokens it emits (accepted proposals
    and one more), how many proposals were accepted, and for a seeded request the generator state to
    rewind to (None otherwise)."""
    tokens, states = sample_rows(logits, chunks)
    n = len(chunks)
    result = verify([c.draft_tokens for c in chunks], [True] * n, tokens, None, [None] * n)
    return [(emitted, accepted, state[accepted] if state else None)
            for emitted, accepted, state in zip(result.tokens, result.num_accepted, states)]
