"""A step's results turned into request state, in one place for the synchronous step, the async pipeline
and speculative verification: computed tokens and completed blocks, prompt logprobs, sampled tokens
appended (incremental detokenization, stop tokens and strings, grammars, length), a pooling pass's
results, failures, the engine's token counters and the dashboard's step record.

Finishing a request also touches the scheduler, the pool and the pipeline, so the engine hands its
`finish_request` in; everything else a step changes in a request happens here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from ..cache.allocator import CacheAllocator
from ..request import Request, RequestState
from ..sched.output import ScheduledChunk
from ..speculative import Speculator
from ..speculative.verification import verify_chunks
from ..structured.constraints import grammar_complete
from .draft_runner import DraftProposer
from .model_runner import PooledStep
from .stats import EngineStats
from .step_history import StepHistory

logger = logging.getLogger("conveyor")

Finish = Callable[[Request, RequestState, str, "str | None"], None]  # Engine.finish_request
OFFLOADED = (RequestState.PENDING, RequestState.SWAPPED)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int, allocator: CacheAllocator,
                 counters: EngineStats, finish: Finish, history: StepHistory | None = None,
                 speculator: Speculator | None = None, draft: DraftProposer | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.allocator = allocator
        self.counters = counters  # the engine's cumulative counters (`Engine.stats` adds the gauges)
        self.finish = finish
        self.history = history
        self.speculator = speculator
        self.draft = draft

    # -- the pass's tokens ----------------------------------------------------------------
    def advance(self, chunks: Sequence[ScheduledChunk], register: bool = True,
                in_flight: Container[str] = ()) -> None:
        """The chunks ran (or were submitted): their tokens count as computed, prefill tokens are counted
        (not the first decode of a prefill whose sample is still `in_flight`), and with `register` their
        completed blocks become matchable. Speculating chunks are left to `verify`."""
        for chunk in chunks:
            request = chunk.request
            if chunk.draft_tokens:
                continue
            if request.state is RequestState.PREFILLING and request.request_id not in in_flight:
                self.counters.prefill_tokens += chunk.num_tokens
            request.num_computed_tokens += chunk.num_tokens
            if register:
                self.allocator.register_full_blocks(request)

    def register_blocks(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Every token of the chunks' completed blocks is known now (async batching reads one step behind).
        A request offloaded since the step was launched holds no blocks now: its blocks are indexed
        again once it is back (freeing reset what it had registered)."""
        for chunk in chunks:
            if not chunk.request.is_finished and self.allocator.holds(chunk.request.request_id):
                self.allocator.register_full_blocks(chunk.request)

    @staticmethod
    def add_prompt_logprobs(entries: Sequence[tuple[Request, int, list]]) -> None:
        """(request, index of its first entry, entries) from a pass; entries already recorded are skipped."""
        for request, first, values in entries:
            if not request.is_finished:
                known = request.prompt_logprobs  # set: it asked for them
                known.extend(values[max(0, len(known) - first):])  # type: ignore[union-attr]

    def add_pooled(self, pooled: PooledStep | None) -> list[Request]:
        """A pooling pass's results: the state of prompts still prefilling, the outputs of those it completed
        (which finish now, their blocks back to the pool). The requests that finished."""
        if pooled is None:
            return []
        for request, state in pooled.states:
            request.pooling_state = state
        finished = []
        for request, values in pooled.results:
            if request.is_finished:  # cancelled while its pass ran
                continue
            request.pooled, request.pooling_state = values, None
            self.finish(request, RequestState.FINISHED, "stop", None)
            finished.append(request)
        return finished

    # -- sampled tokens -------------------------------------------------------------------
    def append_tokens(self, requests: Sequence[Request], tokens: Sequence[int],
                      logprobs: Sequence[dict[int, float] | None], now: float) -> list[Request]:
        """Each request's sampled token (requests that ended meanwhile are skipped: their token is
        discarded); one whose bookkeeping raises fails alone. The requests updated."""
        updated = []
        for request, token, logprob in zip(requests, tokens, logprobs):
            if request.is_finished:
                continue
            self.counters.generation_tokens += 1
            self.append_token_safely(request, token, logprob, now)
            updated.append(request)
        return updated

    def append_token_safely(self, request: Request, token: int, logprob: dict[int, float] | None,
                            now: float) -> None:
        try:
            self.append_token(request, token, logprob, now)
        except Exception as exc:
            logger.exception("request %s failed", request.request_id)
            self.finish(request, RequestState.FAILED, "error", str(exc))

    def append_token(self, request: Request, token: int, logprob: dict[int, float] | None, now: float) -> None:
        """One new token: metrics, logprobs, text; finishes the request on a stop, its grammar's end, or length.
        A request offloaded since its pass was submitted (async batching) stays waiting."""
        request.output_token_ids.append(token)
        if request.state not in OFFLOADED:
            request.state = RequestState.DECODING
        request.metrics.token_times.append(now)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        if request.logprobs is not None:
            request.logprobs.append(logprob or {})
        answer = request.reasoning.advance(token) if request.reasoning is not None else True
        may_stop = len(request.output_token_ids) > request.params.min_tokens
        if token in request.stop_token_ids and may_stop:
            request.stop_reason = token if token in request.params.stop_token_ids else None
            self.finish(request, RequestState.FINISHED, "stop", None)
            return
        delta = self.detokenize(request, token) if request.params.detokenize else ""
        if delta and may_stop and request.params.stop and truncate_at_stop(request, len(delta)):
            self.finish(request, RequestState.FINISHED, "stop", None)
        elif answer and request.grammar is not None and grammar_complete(request.grammar, token):
            self.finish(request, RequestState.FINISHED, "stop", None)
        elif len(request.output_token_ids) >= request.params.max_new_tokens or request.num_tokens >= self.max_model_len:
            self.finish(request, RequestState.FINISHED, "length", None)

    def detokenize(self, request: Request, token: int) -> str:
        """Incremental detokenization; text waits until a token completes its characters."""
        request.detok_ids.append(token)
        ids, start, read = request.detok_ids, request.detok_prefix_offset, request.detok_read_offset
        skip = request.params.skip_special_tokens
        prefix = self.tokenizer.decode(ids[start:read], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[start:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        request.detok_prefix_offset, request.detok_read_offset = read, len(ids)
        request.text += delta
        return delta

    # -- speculative decoding -------------------------------------------------------------
    def verify(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[Request]:
        """Speculating chunks (rows of `logits` in their order): accepted tokens appended one by one (so
        stops, EOS, `max_new_tokens` and the context length cut exactly), K/V kept through the last
        accepted proposal (`num_computed_tokens`, blocks past it trimmed), then full blocks registered."""
        assert self.speculator is not None
        now = time.monotonic()
        for chunk, (emitted, accepted, state) in zip(chunks, verify_chunks(logits, chunks)):
            request = chunk.request
            if request.is_finished:  # cancelled while its pass ran: its blocks are back already
                continue
            self.speculator.record(len(chunk.draft_tokens), accepted)
            if state is not None:
                request.generator.set_state(state)  # type: ignore[union-attr]  # seeded: has one
            start = request.num_computed_tokens
            for token in emitted:
                self.counters.generation_tokens += 1
                self.append_token_safely(request, token, None, now)
                if request.is_finished:
                    break
            if request.is_finished:
                continue
            request.num_computed_tokens = start + 1 + accepted  # the last token and the accepted proposals
            if self.draft is not None:
                self.draft.rolled_back(request)
            self.allocator.trim(request.request_id, request.num_computed_tokens)
            self.allocator.register_full_blocks(request)
        return [c.request for c in chunks]

    # -- failures and the step record -----------------------------------------------------
    def fail(self, requests: list[Request], error: str) -> list[Request]:
        for request in requests:
            self.finish(request, RequestState.FAILED, "error", error)
        return requests

    def record_step(self, started: float, composition: tuple[int, int], sampled: int, padding: int) -> None:
        """The dashboard's record of one step (when the step history is on)."""
        if self.history is not None:
            self.history.record(started, composition, sampled, padding)


def truncate_at_stop(request: Request, delta_len: int) -> bool:
    """Cut the text before the earliest stop string that the new text completes, even across tokens (after
    it with `include_stop_str_in_output`); the string becomes the request's `stop_reason`."""
    longest = max(len(s) for s in request.params.stop)
    start = max(len(request.text) - delta_len - longest + 1, 0)
    hits = [(at, s) for s in request.params.stop if (at := request.text.find(s, start)) >= 0]
    if not hits:
        return False
    at, request.stop_reason = min(hits, key=lambda hit: hit[0])  # the earliest; on a tie, the first listed
    request.text = request.text[:at + len(request.stop_reason) if request.params.include_stop_str_in_output else at]
    return True
