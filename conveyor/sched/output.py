"""What the scheduler decides for one step, read by the engine and the model runner: the chunks of the
pass, the requests that stalled for cache, those to preempt first, and the prefix-cache lookups of the
requests it admitted."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at its `num_computed_tokens`; for a speculating
    decode, its last token and then `draft_tokens` (proposals that are not in the request yet)."""

    request: Request
    num_tokens: int
    draft_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    stalled: list[tuple[Request, int]] = field(default_factory=list)
    # Running requests to offload before anything is scheduled (a waiting request outranks them: priority)
    preempted: list[Request] = field(default_factory=list)
    prefix_cache_query_tokens: int = 0  # tokens of the requests admitted, looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, tokens found cached: their prefill is skipped

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
