"""A bounded ring of per-step records: what each forward pass held and how long it took.

Continuous batching rebuilds the batch every step; the dashboard shows that as a strip chart of the
recent steps' composition. The engine appends one small record per step (O(requests in the batch)
to count decode rows and prefill tokens, O(1) to store: a `deque(maxlen=N)`), and only when
`ContinuousBatchingConfig.step_history` > 0 or the server switched it on; readers on other threads
take a copy under a lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..request import RequestState

if TYPE_CHECKING:
    from ..sched.output import ScheduledChunk


class StepRecord(NamedTuple):
    """One forward pass. `time` is `time.monotonic()` at its end (with async batching: when it was read
    back); `padding_tokens` are the rows a padded (CUDA-graph) shape added."""

    time: float
    duration: float  # seconds, scheduling included
    decode_rows: int  # requests decoding one token (plus their draft tokens)
    prefill_tokens: int  # prompt (or recomputed) tokens run through prefill
    padding_tokens: int
    sampled_tokens: int  # tokens appended to requests this step


def composition(chunks: Sequence[ScheduledChunk], sampled: Container[str] = ()) -> tuple[int, int]:
    """(decode rows, prefill tokens) of a step; taken before the chunks' requests advance. `sampled`:
    requests whose first token is sampled but not read back yet (async batching): they decode."""
    prefill = rows = 0
    for chunk in chunks:
        if chunk.request.state is RequestState.PREFILLING and chunk.request.request_id not in sampled:
            prefill += chunk.num_tokens
        else:
            rows += 1
    return rows, prefill


class StepHistory:
    """The last `maxlen` steps' records."""

    def __init__(self, maxlen: int) -> None:
        if not isinstance(maxlen, int) or maxlen < 1:
            raise ValueError(f"step_history must be a positive integer, got {maxlen!r}")
        self.maxlen = maxlen
        self._ring: deque[StepRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.total = 0  # steps recorded since the start (the last record is step number total - 1)

    def record(self, started: float, composition: tuple[int, int], sampled_tokens: int,
               padding_tokens: int = 0) -> None:
        """Append the step that began at `started` (monotonic), `composition` from `composition()`."""
        now = time.monotonic()
        entry = StepRecord(now, now - started, *composition, padding_tokens, sampled_tokens)
        with self._lock:
            self._ring.append(entry)
            self.total += 1

    def snapshot(self) -> tuple[int, list[StepRecord]]:
        """The number of steps recorded so far and a copy of the kept records, oldest first (any thread)."""
        with self._lock:
            return self.total, list(self._ring)
