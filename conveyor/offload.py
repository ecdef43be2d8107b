"""Offloading: which active requests give up their cache when others stall (SPEC section 7).

Demand-driven: the scheduler reports stalled requests and the blocks each asked for; we pick the
fewest victims that free that many blocks, newest first (so older requests, already scheduled,
keep their cache), never a request in the batch about to run, and never the last active request.
A victim takes the soft-reset path: its blocks are freed and it goes back to the head of the
waiting queue with `num_computed_tokens = 0`, so its prompt plus the tokens it already generated
are prefilled again when room returns. What the user receives is unchanged.
"""

from __future__ import annotations

from .allocator import FullAttentionCacheAllocator
from .request import Request


def choose_victims(active: list[Request], scheduled: set[str], stalled: list[tuple[Request, int]],
                   allocator: FullAttentionCacheAllocator) -> list[Request]:
    """Newest-first victims until the stalled requests that remain have the blocks they asked for."""
    need = {r.request_id: n for r, n in stalled}
    victims: list[Request] = []
    freed = 0
    for request in reversed(active):
        if freed >= sum(need.values()) or len(active) - len(victims) <= 1:
            break
        if request.request_id in scheduled:
            continue
        victims.append(request)
        freed += allocator.exclusive_blocks(request.request_id)
        need.pop(request.request_id, None)
    return victims
