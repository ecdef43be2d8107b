"""What the front refuses before it spends work on a request: bodies over `--max-request-bytes`
(413, before they are parsed) and prompts that cannot fit the context by their length alone (400,
before they are tokenized). Tokenizing a 20 MB prompt takes seconds; refusing it takes microseconds.

The prompt bound is exact in one direction: no prompt under it is refused. Every token of the
served tokenizer covers at most `L` characters of the text it encodes (the longest token in the
vocabulary, measured on its token string, which is never shorter than the text it decodes to), so a
text of more than `L x max_model_len` characters needs more than `max_model_len` tokens. That holds
for tokenizers that drop nothing: byte-level or byte-fallback BPE and Unigram models (unknown
characters fused into one `<unk>` would break it), pre-tokenizers that keep every character, and
normalizers that shrink text by a known factor (Unicode composition: at most 3 characters into 1).
Any other tokenizer gets no bound: its prompts are tokenized (off the event loop) as before.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .anthropic_protocol import anthropic_error, anthropic_path
from .asgi import HTTPMiddleware

MIN_BODY_BYTES = 16 * 2**20
BODY_BYTES_PER_TOKEN = 256  # a full-context prompt as JSON: the longest tokens, escaped (\uXXXX), with room
UNICODE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def default_max_request_bytes(max_model_len: int) -> int:
    """The default body limit: room for a full-context prompt of the longest tokens, at least 16 MiB."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def shrink_factor(normalizer: dict[str, Any] | None) -> float | None:
    """How many characters of input one character of normalized text can stand for; None: unbounded."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in normalizer.get("normalizers", []):
            inner = shrink_factor(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind in UNICODE_NORMALIZERS:
        return 3.0
    if kind == "Prepend":
        return 1.0
    if kind == "Replace" and isinstance(normalizer.get("pattern"), dict) and "String" in normalizer["pattern"]:
        return max(len(normalizer["pattern"]["String"]) / max(len(normalizer.get("content", "")), 1), 1.0)
    return None


def keeps_every_character(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(keeps_every_character(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") in KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a prompt text can have and still fit `max_model_len` tokens; None when the
    tokenizer gives no such bound (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) or model.get("byte_fallback")
    if model.get("type") not in ("BPE", "Unigram") or not (byte_level or not model.get("fuse_unk", False)):
        return None
    if model.get("type") == "Unigram" and not model.get("byte_fallback"):
        return None
    factor = shrink_factor(spec.get("normalizer"))
    if factor is None or not keeps_every_character(spec.get("pre_tokenizer")):
        return None
    strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max([len(s) for s in strings if s] + [len(t) for t in tokenizer.get_added_vocab()] + [1])
    return int(longest * factor * max_model_len)


class BodyLimit(HTTPMiddleware):
    """ASGI middleware: a request body over `max_bytes` is answered 413 (OpenAI's error object; Anthropic's on
    the Messages routes) before the app reads it: by its Content-Length, or, for a chunked body, as soon as
    the bytes received pass it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await self.refuse(scope, send, int(length))
                return
            await self.app(scope, receive, send)
            return
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:  # a chunked body: read it here, up to the limit, then hand it on
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self.refuse(scope, send, size, "at least ")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, replay(b"".join(chunks), receive), send)

    async def refuse(self, scope: Scope, send: Send, size: int, qualifier: str = "") -> None:
        message = (f"the request body ({qualifier}{size} bytes) is over the server's limit of {self.max_bytes} bytes "
                   "(--max-request-bytes)")
        error = (anthropic_error(413, message)[1] if anthropic_path(scope["path"]) else
                 {"error": {"message": message, "type": "invalid_request_error", "param": None,
                            "code": "request_too_large"}})
        body = json.dumps(error).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """`receive` that first hands over the body read already, then the client's later messages."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
