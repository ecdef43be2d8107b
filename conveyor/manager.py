"""`ContinuousBatchingManager`: the engine loop on a background thread, with transformers' method names.

Callers on any thread `add_request` (validated at once, so bad input raises in the caller),
`cancel_request`, and collect results with `get_result` (finished requests) or
`request_id_iter` (streamed outputs of a request added with `streaming=True`). Only the loop
thread touches the engine; everything else reaches it through an inbox queue (`call` runs a function
of the engine there, between two steps).

Engine death: an exception escaping the loop (out of `engine.step`, not a request's own failure,
which the engine reports as that request's "error") leaves the engine in an unknown state, so the
loop stops for good, as vLLM's EngineDeadError: every request in flight ends with finish_reason
"error" naming the cause, `add_death_callback` listeners are told (the server turns 503 and
exits non-zero so that a supervisor restarts it), and `submit`/`start` raise `EngineDeadError`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from .engine.engine import Engine
from .engine.stats import EngineStats
from .request import Prompt, Request, RequestOutput, RequestState
from .sampling_params import SamplingParams

logger = logging.getLogger("conveyor")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop died; this engine serves no more requests (build a new one, or restart the process)."""


class ContinuousBatchingManager:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._streams: dict[str, queue.Queue[RequestOutput]] = {}
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self._results: dict[str, RequestOutput] = {}
        self._done = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._death_lock = threading.Lock()  # orders submits against death: none lands in the inbox after it
        self._dead_error: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> "ContinuousBatchingManager":
        if self.is_running():
            return self
        self._raise_if_dead()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="conveyor-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop; requests still in flight end with finish_reason "abort"."""
        if self._thread is None:
            return
        self._stopping.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)
        self._thread = None

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        """The exception that killed the loop, or None while it has not died."""
        return self._dead_error

    def add_death_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(exc)` (on the loop thread) when the loop dies, after the requests in flight have
        their final outputs; at once if it is dead already."""
        with self._death_lock:
            dead = self._dead_error
            if dead is None:
                self._death_callbacks.append(callback)
        if dead is not None:
            callback(dead)

    def kill(self, exc: BaseException) -> None:
        """Stop the loop for good with `exc` as the cause, as if a step had raised it: for another thread
        that found the engine unusable (a tensor-parallel rank died while the loop was idle)."""
        if self.is_running():
            self._inbox.put(("die", exc))
            return
        with self._death_lock:
            dead = self._dead_error is not None
        if not dead:
            self._die(exc)

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(death_message(self._dead_error)) from self._dead_error

    def __enter__(self) -> "ContinuousBatchingManager":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, streaming: bool = False) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input."""
        request_id = request_id if request_id is not None else self.new_request_id()
        request = self.engine.make_request(request_id, prompt, sampling_params or SamplingParams())
        self.submit(request, streaming)
        return request_id

    def run_batch(self, requests: list[Request], collect: Callable[[list[str]], T]) -> T:
        """Submit validated requests and return `collect(their ids)` (which waits for them); the loop is started
        for the call when it was not running, and the requests are cancelled if anything fails."""
        started_here = not self.is_running()
        self.start()
        try:
            for request in requests:
                self.submit(request)
            return collect([r.request_id for r in requests])
        except BaseException:
            for request in requests:
                self.cancel_request(request.request_id)
            raise
        finally:
            if started_here:
                self.stop()

    def call(self, fn: Callable[[Engine], T]) -> T:
        """`fn(engine)` on the loop's thread between two steps (only that thread touches the engine), its
        result or its exception raised here; at once on this thread when the loop is not running."""
        if not self.is_running():
            self._raise_if_dead()
            return fn(self.engine)
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._death_lock:
            self._raise_if_dead()
            self._inbox.put(("call", (fn, done)))
        while True:
            try:
                return done.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if not self.is_running() and done.cancel():  # the loop ended with the call unread: ours now
                    self._raise_if_dead()
                    return fn(self.engine)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def submit(self, request: Request, streaming: bool = False,
               on_output: Callable[[RequestOutput], None] | None = None) -> None:
        """Queue a request already built (and validated) by `engine.make_request`.

        With `on_output`, every output (token deltas, then the final one) is passed to it on the loop
        thread instead of being queued: an asyncio server hands them to its event loop this way.
        """
        if request.request_id in self._callbacks or request.request_id in self._results:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        with self._death_lock:
            self._raise_if_dead()
            if streaming and on_output is None:
                stream: queue.Queue[RequestOutput] = queue.Queue()
                self._streams[request.request_id] = stream
                on_output = stream.put
            if on_output is not None:
                self._callbacks[request.request_id] = on_output
            self._inbox.put(("add", request))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def cancel_request(self, request_id: str) -> None:
        """Ask the loop to abort the request; it ends with finish_reason "abort" and frees its blocks."""
        self._inbox.put(("cancel", request_id))

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> RequestOutput | None:
        """The final output of `request_id` (or of any finished non-streaming request); None on timeout."""
        return self.wait_any(None if request_id is None else {request_id}, timeout)

    def wait_any(self, request_ids: set[str] | None, timeout: float | None = None) -> RequestOutput | None:
        """The first finished output among `request_ids` (None = any); None on timeout."""
        def ready() -> str | None:
            for rid in self._results:
                if request_ids is None or rid in request_ids:
                    return rid
            return None

        with self._done:
            if not self._done.wait_for(lambda: ready() is not None, timeout):
                return None
            return self._results.pop(ready())

    def request_id_iter(self, request_id: str) -> Iterator[RequestOutput]:
        """Outputs of a streaming request as its tokens arrive; the last one has `finished=True`."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"{request_id!r} is not a streaming request (add it with streaming=True)")
        try:
            while True:
                output = stream.get()
                yield output
                if output.finished:
                    return
        finally:
            self._streams.pop(request_id, None)

    # -- the loop thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set() or not self.engine.has_unfinished_requests():
                    continue
                self._publish(self.engine.step())
        except Exception as exc:  # the engine's state is unknown now: fail everything, stop for good
            self._die(exc)
            return
        self._publish(self._abort_all("abort"))

    def _die(self, exc: BaseException) -> None:
        logger.critical("the engine loop died; failing the requests in flight", exc_info=exc)
        with self._death_lock:
            self._dead_error = exc
            callbacks, self._death_callbacks = self._death_callbacks, []
        message = death_message(exc)
        failed = list(self.engine.requests.values())
        for request in failed:
            try:
                self.engine.cancel_request(request.request_id)  # returns its KV blocks, if the engine still can
            except Exception:
                logger.exception("could not release request %s", request.request_id)
        failed += self._take_inbox_adds()
        for request in failed:
            request.state, request.finish_reason, request.error = RequestState.FAILED, "error", message
        self._publish(failed)
        for callback in callbacks:
            try:
                callback(exc)
            except Exception:
                logger.exception("engine death callback failed")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                self._handle(*item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, kind: str, payload: object) -> None:
        if kind == "die":
            raise payload  # type: ignore[misc]
        if kind == "add":
            self.engine.add_request(payload)  # type: ignore[arg-type]
        elif kind == "cancel":
            request = self.engine.cancel_request(payload)  # type: ignore[arg-type]
            if request is not None:
                self._publish([request])
        elif kind == "call":
            fn, done = payload  # type: ignore[misc]
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(self.engine))
            except Exception as exc:  # the caller's to handle, not the loop's
                done.set_exception(exc)

    def _abort_all(self, reason: str) -> list[Request]:
        aborted = list(self.engine.requests.values())
        for request in aborted:
            self.engine.cancel_request(request.request_id)
            request.finish_reason = reason
        for request in self._take_inbox_adds():
            self.engine.add_request(request)
            self.engine.cancel_request(request.request_id)
            aborted.append(request)
        self.engine.drain()  # a step in flight returns the cancelled requests' blocks when it ends
        return aborted

    def _take_inbox_adds(self) -> list[Request]:
        """Empty the inbox; the requests it held never reached the engine."""
        requests = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return requests
            if kind == "add":
                requests.append(payload)  # type: ignore[arg-type]

    def _publish(self, requests: list[Request]) -> None:
        finished = []
        for request in requests:
            callback = self._callbacks.get(request.request_id)
            if callback is not None:
                if request.is_finished or request.output_token_ids[request.sent_token_len:]:
                    if request.is_finished:
                        del self._callbacks[request.request_id]
                    try:
                        callback(request.to_output())
                    except Exception:  # a consumer's bug must not stop the loop
                        logger.exception("output callback of %s failed", request.request_id)
            elif request.is_finished:
                finished.append(request.to_output())
        if finished:
            with self._done:
                for output in finished:
                    self._results[output.request_id] = output
                self._done.notify_all()


def death_message(exc: BaseException) -> str:
    return f"the engine loop died: {type(exc).__name__}: {exc}"
