"""One streamed request of `conveyor bench serve`, timed on the client, and the endpoints it talks to.

A "token chunk" is a streamed choice carrying text (`text` for /v1/completions; `delta.content`,
`delta.reasoning_content` or `delta.reasoning` for chat), even an empty string (special tokens,
held-back partial characters), except an empty one that only announces the role (llama-server
sends it before prefill, so vllm's rule, any chunk with choices, would start its TTFT early) or
closes the stream (finish_reason set; unless no token came before it: an EOS generated at once),
and chunks without text (the usage chunk). A finish_reason "error" or "abort" fails the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from .workloads import BenchRequest, WorkloadError

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
_ERROR_BODY_CHARS = 500
_DRAIN_AFTER_DONE_S = 1.0
_FAILED_FINISH_REASONS = ("error", "abort")  # Conveyor's and vLLM's ends of a failed or cancelled request


@dataclass
class RequestResult:
    """Client-side record of one streamed request. Times in seconds; `arrival_s`, `start_s` and
    `end_s` from the start of the run, the others from `start_s` (the moment it was sent, after any
    wait for a concurrency slot)."""

    index: int
    arrival_s: float = 0.0
    start_s: float = 0.0
    success: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None       # to the last token chunk (vllm's E2E latency)
    end_s: float | None = None           # the stream's end ([DONE] or EOF), from the run's start
    output_tokens: int = 0
    output_tokens_source: str = "none"   # "usage", "chunks" or "none"
    prompt_tokens: int | None = None
    token_chunks: int = 0
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def build_payload(request: BenchRequest, *, model: str, chat: bool, temperature: float = 0.0) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    if request.prompt is None:
        raise WorkloadError("the serve benchmark sends text prompts; this request has only token ids")
    payload: dict[str, Any] = {"model": model}
    if chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    payload.update({"max_tokens": request.max_new_tokens, "temperature": temperature, "stream": True,
                    "stream_options": {"include_usage": True}})
    if request.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _token_text(choice: dict[str, Any], chat: bool) -> str | None:
    """The text a streamed choice carries, or None when it carries no token: no text field, or an
    empty one on a role announcement or on a closing chunk (finish_reason set)."""
    if not chat and "text" not in choice and isinstance(choice.get("delta"), dict):
        chat = True  # a completions endpoint answering in chat shape
    if chat:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return None
        pieces = [p for p in (delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning"))
                  if isinstance(p, str)]
        if not pieces:
            return None
        text = "".join(pieces)
        if not text and "role" in delta:
            return None
    else:
        text = choice.get("text")
        if not isinstance(text, str):
            return None
    if not text and choice.get("finish_reason"):
        return None
    return text


async def _read_capped(response: Any, limit: int = _ERROR_BODY_CHARS) -> str:
    data = b""
    async for part in response.aiter_bytes():
        data += part
        if len(data) >= limit:
            break
    return data[:limit].decode("utf-8", "replace").strip()


async def _drain(lines: Any) -> None:
    async for _ in lines:
        pass


async def _stream_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str],
                          result: RequestResult, chat: bool, t0: float) -> None:
    start = time.perf_counter()
    result.start_s = start - t0
    last_token = None
    done = False
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        result.status = response.status_code
        if response.status_code != 200:
            body = await _read_capped(response)
            result.error = f"HTTP {response.status_code}" + (f": {body}" if body else "")
            return
        lines = response.aiter_lines()
        async for line in lines:
            if not line.startswith("data:"):
                continue  # blank separators, SSE comments (":"), "event:" lines
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                result.end_s = time.perf_counter() - t0
                # Read the body's end so that the connection is reused, as a client would; a server
                # that keeps the stream open after [DONE] costs at most a second, not a failure.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_drain(lines), _DRAIN_AFTER_DONE_S)
                break
            now = time.perf_counter()
            try:
                chunk = json.loads(data)
            except ValueError:
                result.error = f"invalid JSON in the stream: {data[:200]!r}"
                return
            if not isinstance(chunk, dict):
                continue
            if chunk.get("error"):
                result.error = f"error in the stream: {json.dumps(chunk['error'])[:_ERROR_BODY_CHARS]}"
                return
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    result.output_tokens = usage["completion_tokens"]
                    result.output_tokens_source = "usage"
                if isinstance(usage.get("prompt_tokens"), int):
                    result.prompt_tokens = usage["prompt_tokens"]
            choices = chunk.get("choices")
            if not choices or not isinstance(choices[0], dict):
                continue
            choice = choices[0]
            finish = choice.get("finish_reason")
            if finish:
                result.finish_reason = finish
                if finish in _FAILED_FINISH_REASONS:
                    result.error = f"finish_reason {finish!r}"
                    return
            # A closing chunk is no token, unless nothing came before it: then it carries the
            # (invisible) first token, e.g. an EOS generated at once, and dates it.
            if _token_text(choice, chat) is None and not (finish and last_token is None):
                continue
            if last_token is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last_token)
            last_token = now
            result.token_chunks += 1
    if result.end_s is None:
        result.end_s = time.perf_counter() - t0
    if last_token is None:
        result.error = "the stream carried no tokens" + ("" if done else " and no [DONE]")
        return
    if not done and result.finish_reason is None:
        result.error = "the stream ended before [DONE] or a finish_reason"
        return
    result.latency_s = last_token - start
    if result.output_tokens_source != "usage":
        result.output_tokens = result.token_chunks
        result.output_tokens_source = "chunks"
    result.success = True


async def send_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str], *,
                       index: int = 0, chat: bool, timeout_s: float, t0: float | None = None,
                       arrival_s: float = 0.0) -> RequestResult:
    """Send one streamed request and time it; never raises (except on cancellation): an HTTP
    error, a dropped connection, a malformed stream or the timeout make a failed result."""
    result = RequestResult(index=index, arrival_s=arrival_s)
    t0 = time.perf_counter() if t0 is None else t0
    try:
        await asyncio.wait_for(_stream_request(client, url, payload, headers, result, chat, t0), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout_s:g} s (--request-timeout)"
    except Exception as exc:  # noqa: BLE001 -- any failure of one request is that request's result
        result.error = f"{type(exc).__name__}: {exc}".strip().rstrip(":") or type(exc).__name__
    if result.error is not None:
        result.success = False
        if result.end_s is None:
            result.end_s = time.perf_counter() - t0
    return result


def api_urls(base_url: str, endpoint: str) -> tuple[str, str]:
    """(request URL, models URL). A base URL ending in /v1 is accepted (the /v1 is not doubled)."""
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
    if not endpoint.startswith("/"):
        endpoint = "/" + endpoint
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[:-3]
    return base + endpoint, base + "/v1/models"


def is_chat_endpoint(endpoint: str) -> bool:
    """Chat format (messages, deltas) for a chat endpoint, completions format (prompt, text) else."""
    return "chat" in endpoint.lower()


def make_client(*, max_concurrency: int | None, timeout_s: float) -> Any:
    import httpx

    limit = max_concurrency if max_concurrency else None  # unlimited, as vllm's connector without a cap
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                             limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                             follow_redirects=False, trust_env=False)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(client: Any, models_url: str, headers: dict[str, str]) -> str:
    """The id of the first model GET /v1/models lists."""
    try:
        response = await client.get(models_url, headers=headers)
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"cannot reach {models_url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise RuntimeError(f"GET {models_url}: HTTP {response.status_code}: {response.text[:200]}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"GET {models_url} listed no model ({response.text[:200]!r}); pass --model") from exc
