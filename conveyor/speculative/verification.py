"""After a pass: verify each speculating chunk's proposals, append what is accepted, roll back the rest.

Every row of a speculating chunk is sampled exactly as plain decoding would sample it (argmax for
greedy requests; the request's own distribution and noise for sampled ones), and proposals are
accepted while they equal the row's token (`rejection.verify` on those tokens). For drafts that are
deterministic, as n-gram and greedy draft-model proposals are (q one-hot), this is the rejection
sampling of Leviathan et al.: proposal x is accepted with probability p(x), and a rejected position
takes a token distributed as norm(max(p - q, 0)) = p given "not x". It also keeps a seeded
request's tokens those of speculation off: each emitted token uses the noise row plain decoding
would have drawn for it, and the generator is rewound to just after the rows actually used.

Accepted tokens go through the engine's `_append_token` one by one, so stops, EOS, `max_new_tokens`
and the context length cut exactly; K/V is valid through the last accepted proposal, so
`num_computed_tokens` moves there, blocks past it go back (`allocator.trim`), and only then are
full blocks registered for prefix caching.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..request import Request, RequestState
from ..sampler import Sampler
from ..transfer import to_device
from .rejection import verify

if TYPE_CHECKING:
    from ..engine import Engine
    from ..scheduler import ScheduledChunk


def sample_rows(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
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
    probs = Sampler.probs(logits.index_select(0, rows), [owners[i] for i in sampled])
    noise = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(sampled) if owners[i].generator is None]
    if unseeded:
        noise[to_device(unseeded, torch.long, device)] = torch.empty(len(unseeded), probs.shape[1],
                                                                     device=device).exponential_()
    chunk_of = [n for n, c in enumerate(chunks) for _ in range(c.num_tokens)]
    for j, i in enumerate(sampled):
        generator = owners[i].generator
        if generator is not None:
            noise[j].exponential_(generator=generator)
            states[chunk_of[i]].append(generator.get_state())
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens, states


def apply_verification(engine: Engine, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[Request]:
    """Verify, append and roll back the speculating `chunks` (rows of `logits` in their order);
    the requests that produced tokens or ended."""
    speculator = engine.scheduler.speculator
    assert speculator is not None
    tokens, states = sample_rows(logits, chunks)
    n = len(chunks)
    result = verify([c.draft_tokens for c in chunks], [True] * n, tokens, None, [None] * n)
    now = time.monotonic()
    for chunk, emitted, accepted, state in zip(chunks, result.tokens, result.num_accepted, states):
        request = chunk.request
        if request.is_finished:  # cancelled while its pass ran: its blocks are back already
            continue
        speculator.record(len(chunk.draft_tokens), accepted)
        if state:
            request.generator.set_state(state[accepted])  # type: ignore[union-attr]  # seeded: has one
        start = request.num_computed_tokens
        try:
            for token in emitted:
                engine._append_token(request, token, None, now)
                engine._stats.generation_tokens += 1
                if request.is_finished:
                    break
        except Exception as exc:
            engine._finish(request, RequestState.FAILED, "error", error=str(exc))
        if request.is_finished:
            continue
        request.num_computed_tokens = start + 1 + accepted  # the last token and the accepted proposals
        speculator.rolled_back(request)
        engine.allocator.trim(request.request_id, request.num_computed_tokens)
        engine.allocator.register_full_blocks(request)
    return [c.request for c in chunks]
