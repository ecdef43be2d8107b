"""OpenAI-compatible HTTP server (`conveyor serve`): FastAPI + uvicorn over one shared engine.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending in `data: [DONE]`), POST /v1/messages and /v1/messages/count_tokens (Anthropic's
Messages API, its own shapes and errors: `routes/messages.py`), GET /v1/models, GET /health, GET /metrics (Prometheus),
POST /tokenize, POST /detokenize (vLLM's shapes); a pooling model's server (`--runner pooling`) answers POST
/v1/embeddings, /v1/score and /v1/rerank instead of the generation routes (`pooling`, `pooling_protocol`,
`routes/embeddings.py`, `routes/score.py`: docs/design/pooling.md). Modules: `protocol` (request bodies, error
object), `serving` (admission, the engine bridge, rendering), `limits` (the body and prompt-length
limits), `tools` and `response_format` (what a request constrains), `replies` (chat template
options, reasoning split from the answer), `request_fields` (llama.cpp's fields, unknown ones),
`metrics` (Prometheus), `streaming` (server-sent events, collected results), `errors` (the error
handlers), `routes` (a module per route family), `settings` (`ServerSettings`), `cors` (cross-origin
requests), `observers` (what watches requests end: `request_log`, `tracing`), `log_format` (text or
JSON lines), `outcomes` (how a request that ended badly is answered), `app` (puts them together).
`run_server` serves in the foreground with graceful
SIGINT/SIGTERM handling; `BackgroundServer` serves on a thread (tests, notebooks). uvicorn runs on
uvloop and httptools (dependencies, as vLLM's server): each streamed token wakes the event loop and
writes a chunk, and on 2 cores that work takes its time from the decode threads (one stream on the
built-in model, AVX-512 Xeon, interleaved: TPOT 4.3-4.7 ms against 4.8-6.6 ms on asyncio and h11,
the decode stack's median 2.9 against 3.4-3.6 ms a step).

Behaviour where the OpenAI API leaves room (mostly as vLLM):
- max_tokens: completions default to 16 (OpenAI's and vLLM's default); chat completions, and a
  completion with `max_tokens: null`, default to the rest of the context (context - prompt).
  `max_completion_tokens` wins over `max_tokens`. A prompt that leaves no room is a 400.
- Sampling defaults are OpenAI's (temperature 1.0, top_p 1.0), not the model's generation_config.
  top_k 0 or -1 = off. With `seed` and `n` > 1, choice i uses seed + i (per prompt), so choice 0
  equals the same request with n = 1.
- model: the served names (`--served-model-name`, several allowed, the first is reported;
  default the model file or directory name) are accepted; a missing or empty `model` means the
  served model; anything else is a 404 (no `default` alias: name it with --served-model-name).
- Prompts: a string, a list of strings, a list of token ids or a list of lists; choices are
  numbered prompt-major (prompt p, choice j -> index p * n + j); usage counts each prompt once.
- Chat roles: system, user, assistant ("developer" is read as system); text content parts are
  joined with newlines. vLLM's chat fields: `chat_template_kwargs` (over
  `--default-chat-template-kwargs`), `add_generation_prompt` (default true),
  `continue_final_message` (not with add_generation_prompt: a 400), `echo` (the last message's
  content before the reply's when the roles match; without a generation prompt the reply's role is
  the last message's).
- Reasoning (`--reasoning-parser`): the reasoning goes to `reasoning_content` (and vLLM's
  `reasoning`), the answer to `content`, tool calls are read from the answer only (`replies`);
  `include_reasoning: false` leaves it out. A constrained reply is read from its first token. The
  Responses API makes it a `reasoning` item, the Messages API a `thinking` block. An assistant
  message's `reasoning_content` reaches a template that renders it.
- Not supported, answered 400 rather than ignored: suffix, best_of != n, top_logprobs without
  logprobs, prompt_logprobs with stream, llama.cpp's samplers set on, vLLM's right truncation, prompt
  embeddings and logprob_token_ids, OpenAI's deprecated functions, audio output and web_search_options
  (`request_fields`); with vLLM's use_beam_search, the fields a beam search does not read
  (`beam_search`). At most --max-logprobs (default 20) logprobs, top_logprobs and prompt_logprobs.
- Tools (`tools`): "none", "required" (a list of calls, constrained; `parallel_tool_calls: false`
  makes it one), a named function (its arguments, constrained), "auto" (the model's own format,
  read by the tool parser: `--tool-call-parser`, by default read off the chat template; refused with
  a 400 unless the server runs with `--enable-auto-tool-choice`, as vLLM; like vLLM, tools without
  `tool_choice` mean "auto"). Tool parameters and `strict: true` JSON schemas are closed (no
  properties or items beyond those listed).
- Limits before work: a body over `--max-request-bytes` is a 413 before it is read (default: 256
  bytes per context token, at least 16 MiB); a prompt text longer than the longest token x the
  context is a 400 before it is tokenized. Tokenizing, chat templates and constraints run on a
  small thread pool, never on the event loop.
- prompt_logprobs (vLLM's extra field): each completion choice gets `prompt_logprobs` (a chat
  completion once, at the top level), vLLM's list of None (first token) or {token id: {logprob, rank,
  decoded_token}}; null when not asked.
- vLLM's sampling fields on both endpoints: stop_token_ids, include_stop_str_in_output,
  allowed_token_ids, bad_words, skip_special_tokens, add_special_tokens (completions: true, chat:
  false, as vLLM), cache_salt; return_token_ids adds each choice's `token_ids` (a stream: each chunk's
  new ones) and the prompt's `prompt_token_ids` (completions: in the choice, its first chunk when
  streamed; chat: top level, not streamed); return_tokens_as_token_ids names logprobs' tokens
  `token_id:N`. `stop_reason` is the stop string or stop token id that ended a choice, else null.
- echo (completions, as vLLM): each choice's text begins with its prompt (as sent, or the text of the
  tokens kept by truncation or given as ids), and with `logprobs` its logprobs with the prompt tokens'
  (the first null); `max_tokens: 0` (only with echo) returns the prompt alone and counts no completion
  tokens. A stream sends the prompt with the first token.
  llama.cpp's `n_predict`, `grammar`, `json_schema` and `cache_prompt` are mapped. Other unknown
  fields are ignored (as vLLM), with a warning the first time each name is seen.
- Errors are `{"error": {"message", "type", "param", "code"}}`: 400 invalid_request_error
  (validation errors, FastAPI's 422 included), 401 invalid_api_key (only /v1/*, /tokenize and
  /detokenize need the key; /health and /metrics stay open), 404 model_not_found, 500
  server_error (the request failed inside the engine; in a stream: an error event, then [DONE]),
  503 service_unavailable_error with Retry-After (queue full, or shutting down), 504 request_timeout (past
  the request's `request_timeout` or the server's `--request-timeout`, waiting or running: `outcomes`).
- Streaming: the status line and headers go out with the first output (a token, the end, or an
  error), so a request still queued when the server dies has received nothing and a router in front
  (`conveyor serve --data-parallel-size`) retries it on another replica.
- Admission: the server counts engine requests (prompts x n) accepted and not yet finished; a
  request that would take the count past `max_queue` gets 503 at once. Accepted requests always
  get their answer. A client that disconnects (streaming or not) cancels its requests at once.
- Shutdown (SIGINT/SIGTERM): the server keeps listening but answers new requests (and /health)
  with 503 while in-flight requests get `shutdown_timeout` seconds to finish; those still running
  are then aborted (a 503 error object, or an error event in a stream); then uvicorn shuts down
  and the process exits 0. A second signal shuts down at once.
- Engine death (an exception escaping the engine loop, not one request's failure): in-flight
  requests get a 500 naming the cause (in a stream: an error event, then [DONE]); /health and new
  requests get 503 (code engine_dead); `run_server` then drains and raises `EngineDeadError`, so
  `conveyor serve` exits 1 for a supervisor to restart it. A `BackgroundServer` keeps answering 503.
- Metrics: vLLM's names under `conveyor:` with a `model_name` label; request_success_total is
  labelled finish_reason = stop | length | abort | error; kv_cache_usage_perc is a fraction (0-1).
- OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}, POST
  /v1/responses/{id}/cancel): what it honours, stores and streams is in `routes/responses.py` and
  the `responses` package.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

from ..llm import LLM
from ..manager import EngineDeadError, death_message
from .app import build_app
from .log_format import uvicorn_logging
from .tls import scheme, uvicorn_tls
from .settings import ServerSettings

__all__ = ["build_app", "ServerSettings", "run_server", "BackgroundServer", "GracefulServer", "check_address"]


def check_address(host: str, port: int) -> None:
    """ValueError, one line, when uvicorn could not listen on `host`:`port`; checked before the model
    loads, so that a port already in use fails in a second, not after the load (uvicorn's own error
    stays for a port taken in between). Bound as uvicorn binds: SO_REUSEADDR, IPv6 for a host with ':'."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            raise ValueError(f"--host {host} is not an address ({exc.strerror}): give an IP address of this "
                             "machine, e.g. --host 127.0.0.1 or --host 0.0.0.0 (every interface)") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is already in use (an earlier `conveyor serve` still "
                                 f"running?): stop that process, or pass a free port, e.g. --port {port + 1}") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host {host} is not an address of this machine: give one of its own, e.g. "
                                 "--host 127.0.0.1 or --host 0.0.0.0 (every interface)") from None
            if exc.errno == errno.EACCES:
                raise ValueError(f"port {port} needs privileges to listen on (ports below 1024 do): pass a port "
                                 "from 1024 up, e.g. --port 8000") from None
            raise


class GracefulServer(uvicorn.Server):
    """uvicorn's server that, on the first SIGINT/SIGTERM, calls `drain(then)` and keeps listening while it
    drains (the app answers new requests with 503); `then` shuts it down. `drain` returns False when there
    is nothing to drain (shut down at once). A second signal shuts down at once. It exits 0: it does not
    re-raise the signal after the graceful shutdown as uvicorn does. The data-parallel front reuses it."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[Callable[[], None]], bool]) -> None:
        super().__init__(config)
        self.drain = drain
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.draining:
            self.draining = True
            if self.drain(self.drained):
                return
        super().handle_exit(sig, frame)

    def drained(self) -> None:
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(llm: LLM, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", uds: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM: then new requests get 503, in-flight ones get `shutdown_timeout`
    seconds to finish before they are aborted, and this returns (a second signal: at once). If the
    engine loop dies, the same drain follows and this raises `EngineDeadError`. `uds`: listen on that Unix
    domain socket instead of `host`:`port`."""
    settings.url = settings.url or (f"unix:{uds}" if uds else f"{scheme(settings.tls)}://{host}:{port}")
    app = build_app(llm, settings)
    address: dict[str, Any] = {"uds": uds} if uds else {"host": host, "port": port}
    config = uvicorn.Config(app, **address, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5,  # after the app's own drain
                            **uvicorn_logging(settings.log_format, not settings.disable_uvicorn_access_log,
                                              settings.disable_access_log_for_endpoints),
                            **uvicorn_tls(settings.tls), root_path=settings.root_path)
    serving = app.state.serving
    server = GracefulServer(config, serving.request_shutdown)
    serving.on_engine_death = server.drained
    server.run()
    if serving.dead_error is not None:
        raise EngineDeadError(death_message(serving.dead_error)) from serving.dead_error


class BackgroundServer:
    """`with BackgroundServer(llm, settings) as url:` serves on a free loopback port on a thread."""

    def __init__(self, llm: LLM, settings: ServerSettings | None = None, host: str = "127.0.0.1",
                 log_level: str = "warning") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        settings = settings or ServerSettings()
        self.url = f"{scheme(settings.tls)}://{host}:{self.sock.getsockname()[1]}"
        settings.url = self.url
        self.app = build_app(llm, settings)
        config = uvicorn.Config(self.app, log_level=log_level, lifespan="on", access_log=False,
                                timeout_graceful_shutdown=int(settings.shutdown_timeout) + 5,
                                **uvicorn_tls(settings.tls), root_path=settings.root_path)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="conveyor-server", daemon=True)

    def start(self, timeout: float = 60.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
