"""Async batching (docs/design/async-batching.md): the host schedules and prepares step N+1 while step N runs.

Steps run one after another on a forward worker (a thread: on CPU it computes, on CUDA it launches
and replays, so the device queue never waits for the host). The engine's thread, meanwhile,
schedules step N+1 before step N's tokens are known: each request that samples in a step gets a
placeholder token at once (so the unchanged scheduler sees its next decode), and the rows of step
N+1 whose input is such a placeholder are filled on the worker, from step N's sampled tokens on
the device, just before N+1's forward pass. The worker never waits for the device: each step's
samples are copied to pinned host memory behind its sampling kernels, with an event, and the
engine's thread waits on that event when it reads step N back, one step behind (while N+1 runs),
to detokenize, check stops and stream. A request that finished at step N but was already
in step N+1 has that extra token discarded; its blocks (and those of requests cancelled or failed
while in flight) go back to the pool only once the last step that holds it has finished, so no
pass ever writes into a block someone else owns. Padded steps alternate between two sets of static
buffers: step N+1 is written into one while step N still reads the other.

Samplers that read a request's output history (penalties, min_tokens, bad words of several tokens) get
a snapshot taken when the step is prepared, its pending last token filled on the worker: they see
exactly what a synchronous step would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..cache.allocator import CacheAllocator
from ..cache.transfer import to_device
from ..request import Request
from ..sched.output import ScheduledChunk, SchedulerOutput
from .model_runner import LaunchedStep, ModelRunner, PreparedStep, split_batch
from .output_processor import OutputProcessor
from .step_history import composition

logger = logging.getLogger("conveyor")

PLACEHOLDER = -1  # a sampled token not read back yet


class SamplingView:
    """What the sampler reads of a request, with its output history frozen when the step was prepared."""

    __slots__ = ("active_grammar", "bad_words_token_ids", "forced_token", "generator", "grammar", "opening_token",
                 "output_token_ids", "params", "prompt_token_ids", "request_id", "restricts_tokens", "stop_token_ids")

    def __init__(self, request: Request) -> None:
        self.request_id, self.params, self.generator = request.request_id, request.params, request.generator
        # None: constrained requests and those whose reasoning is followed run synchronous steps (Engine.step)
        self.grammar, self.active_grammar = request.grammar, request.active_grammar
        self.forced_token, self.opening_token = request.forced_token, request.opening_token
        self.prompt_token_ids, self.stop_token_ids = request.prompt_token_ids, request.stop_token_ids
        self.bad_words_token_ids, self.restricts_tokens = request.bad_words_token_ids, request.restricts_tokens
        self.output_token_ids = list(request.output_token_ids)


def needs_history(request: Request) -> bool:
    p = request.params
    return (p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
            or len(request.output_token_ids) < p.min_tokens or any(len(w) > 1 for w in request.bad_words_token_ids))


@dataclass
class _InFlight:
    future: Future[LaunchedStep]
    chunks: list[ScheduledChunk]
    number: int
    started: float  # when it was scheduled (the dashboard's step record)
    composition: tuple[int, int]


class AsyncPipeline:
    """Drives the engine one step ahead; `step()` replaces `Engine.step` when async batching is on."""

    def __init__(self, runner: ModelRunner, output: OutputProcessor, allocator: CacheAllocator,
                 schedule: Callable[[], SchedulerOutput],
                 unschedulable: Callable[[SchedulerOutput], list[Request]]) -> None:
        """`schedule` and `unschedulable`: the engine's `schedule` and `fail_unschedulable`."""
        self.runner = runner
        self.output = output
        self.allocator = allocator
        self.schedule = schedule
        self.unschedulable = unschedulable
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="conveyor-forward")
        self.inflight: _InFlight | None = None
        self.number = 0  # steps submitted
        self.pending: dict[str, int] = {}  # request -> its row among the in-flight step's samples
        self.placeholders: dict[str, int] = {}  # request -> placeholder tokens at the end of its output
        self.last_step: dict[str, int] = {}  # request -> the last step submitted with it
        self.deferred: set[str] = set()  # finished requests whose blocks wait for their last step
        self._last: LaunchedStep | None = None  # worker side: the last step launched (None: it failed)

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def holds(self, request: Request) -> bool:
        """Whether a submitted step that has not been read back yet includes the request."""
        return self.inflight is not None and self.last_step.get(request.request_id, -1) >= self.inflight.number

    # -- the engine's thread --------------------------------------------------------------
    def step(self) -> list[Request]:
        started = time.monotonic()
        out = self.schedule()
        if not out.chunks:
            return self.drain() if self.inflight is not None else self.unschedulable(out)
        buffer_set = self.number % max(1, len(self.runner.buffers))
        try:
            prepared = self.runner.prepare(out.chunks, buffer_set)
        except Exception as exc:
            logger.exception("step preparation failed")
            return self._fail([c.request for c in out.chunks], exc) + self.drain()
        rows, sources = self._pending_rows(out.chunks, prepared)
        views = [SamplingView(r) if needs_history(r) else r for r in prepared.samplers]
        fills = [(v, self.pending[r.request_id]) for v, r in zip(views, prepared.samplers)
                 if v is not r and r.request_id in self.pending]
        prepared.sampling_views = views
        future = self.worker.submit(self._run, prepared, rows, sources, fills)
        counts = composition(out.chunks, self.placeholders) if self.output.history is not None else (0, 0)
        self.output.advance(out.chunks, register=False, in_flight=self.placeholders)  # registered when read back
        for chunk in out.chunks:
            self.last_step[chunk.request.request_id] = self.number
        for request in prepared.samplers:
            request.output_token_ids.append(PLACEHOLDER)
            self.placeholders[request.request_id] = self.placeholders.get(request.request_id, 0) + 1
        self.pending = {r.request_id: i for i, r in enumerate(prepared.samplers)}
        previous, self.inflight = self.inflight, _InFlight(future, out.chunks, self.number, started, counts)
        self.number += 1
        return self._read_back(previous) if previous is not None else []

    def drain(self) -> list[Request]:
        """Read back the step in flight (nothing new is submitted); frees what waited for it."""
        step, self.inflight = self.inflight, None
        self.pending = {}
        return self._read_back(step) if step is not None else []

    def wait(self) -> None:
        """Block until the step in flight has run (before blocks are copied out or reused)."""
        if self.inflight is not None:
            self.inflight.future.exception()

    def on_finish(self, request: Request) -> bool:
        """A request ends: drop its placeholders; True if its blocks must wait for a step in flight."""
        n = self.placeholders.pop(request.request_id, 0)
        if n:
            del request.output_token_ids[-n:]
        if self.holds(request):
            self.deferred.add(request.request_id)
            return True
        self.last_step.pop(request.request_id, None)
        return False

    def _pending_rows(self, chunks: list[ScheduledChunk], step: PreparedStep) -> tuple[list[int], list[int]]:
        """Rows of this step whose input token is a placeholder of the step in flight, and the index of
        that token among the in-flight step's samples."""
        rows: list[int] = []
        sources: list[int] = []
        offset = 0
        decodes, prefills = split_batch(chunks)
        for chunk in decodes + prefills:
            request, start = chunk.request, chunk.request.num_computed_tokens
            source = self.pending.get(request.request_id)
            position = request.num_tokens - 1  # a placeholder is always the last token
            if source is not None and start <= position < start + chunk.num_tokens:
                rows.append(step.row(offset + position - start))
                sources.append(source)
            offset += chunk.num_tokens
        return rows, sources

    def _read_back(self, step: _InFlight) -> list[Request]:
        """Step N's results (step N+1 may be running): tokens appended, stops checked, blocks freed."""
        try:
            result = step.future.result().result()  # waits for the step's samples to reach the host
        except Exception as exc:
            logger.exception("forward pass failed")
            failed = self._fail([c.request for c in step.chunks if not c.request.is_finished], exc)
            self._release(step.number)
            return failed
        self.output.add_prompt_logprobs(result.prompt_logprobs)
        live = [(r, t, lp) for r, t, lp in zip(result.requests, result.token_ids, result.logprobs)
                if not r.is_finished]  # a request that ended at the previous step (or was cancelled): discarded
        later: dict[str, int] = {}  # request -> placeholders of steps after this one
        for request, _, _ in live:
            n = self.placeholders.pop(request.request_id)
            del request.output_token_ids[-n:]
            later[request.request_id] = n - 1
        updated = self.output.append_tokens(*zip(*live), time.monotonic()) if live else []
        for request in updated:
            n = later[request.request_id]
            if n and not request.is_finished:
                request.output_token_ids.extend([PLACEHOLDER] * n)
                self.placeholders[request.request_id] = n
        # The tokens kept (not those of requests that had ended).
        self.output.record_step(step.started, step.composition, len(updated), result.padding_tokens)
        self.output.register_blocks(step.chunks)  # every token of the now complete blocks is known
        self._release(step.number)
        return updated

    def _release(self, number: int) -> None:
        """Free the blocks of finished requests whose last step was `number` or earlier."""
        done = [rid for rid in self.deferred if self.last_step.get(rid, -1) <= number]
        for rid in done:
            self.deferred.discard(rid)
            self.last_step.pop(rid, None)
            self.allocator.free(rid)

    def _fail(self, requests: list[Request], exc: Exception) -> list[Request]:
        return self.output.fail(requests, f"forward pass failed: {exc}")

    # -- the forward worker ---------------------------------------------------------------
    def _run(self, step: PreparedStep, rows: list[int], sources: list[int],
             fills: list[tuple[SamplingView, int]]) -> LaunchedStep:
        """Fill the rows waiting for the previous step's tokens from its device tensor, then launch the
        step without waiting for the device (only samplers that read the output history wait for the
        previous step's tokens on the host)."""
        last, self._last = self._last, None
        tokens = last.tokens if last is not None else None
        if rows:
            dev = step.input_ids.device
            index = to_device(rows, torch.long, dev)
            if tokens is not None:
                values = tokens.index_select(0, to_device(sources, torch.long, tokens.device))
            else:  # the previous step failed: its requests did too, these rows are never read
                values = torch.zeros(len(rows), dtype=step.input_ids.dtype, device=dev)
            step.input_ids.index_copy_(0, index, values)
        if fills:
            token_ids = last.result().token_ids if tokens is not None and last is not None else None
            for view, source in fills:
                view.output_token_ids[-1] = token_ids[source] if token_ids is not None else 0
        self._last = self.runner.launch(step)
        return self._last
