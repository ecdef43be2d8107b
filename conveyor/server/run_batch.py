"""vLLM's `run-batch`: a file of OpenAI Batch API requests run through the server's own routes in this process
(`conveyor run-batch -i INPUT.jsonl -o OUTPUT.jsonl MODEL`), no socket in between (docs/serving.md, "Batch files").

Input: one JSON object a line, OpenAI's batch request `{"custom_id", "method": "POST", "url", "body"}`, from a
local file or an http(s) URL. The whole file is checked before the model loads: a line that is not such an
object, a repeated `custom_id`, a method other than POST, a URL not in `URLS` or a streaming body is an error
naming its line. Each body then goes to its route in the server app (`build_app`) as an HTTP request's would, so
validation, chat templates, tools, reasoning and errors are the server's; up to `max_queue` lines are in flight
at once, and one the server turns away as over its queue (503) waits for others to finish and goes again.
Output: one line per input line, in input order, OpenAI's batch output `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`; a failed request keeps the route's error body and has `error`
`{"code", "message"}`. It is written to a local file (through a temporary file, replaced at the end) or PUT to
an http(s) URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prometheus_client
from fastapi import FastAPI
from tqdm import tqdm

from ..llm import LLM
from .app import build_app
from .settings import ServerSettings

logger = logging.getLogger("conveyor")

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/score",
        "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify", "/pooling")
RETRY_S = 0.05  # how long a line the queue turned away waits before it goes again


class BatchFileError(ValueError):
    """A batch input file that cannot be run: the message names the line."""


@dataclass(frozen=True)
class BatchLine:
    """One request of the input file."""

    custom_id: str
    url: str
    body: dict[str, Any]


def read_text(source: str) -> str:
    """A local file's text, or an http(s) URL's (GET)."""
    try:
        if source.startswith(("http://", "https://")):
            with urllib.request.urlopen(source, timeout=300) as reply:
                return reply.read().decode("utf-8")
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchFileError(f"cannot read the batch file {source}: {exc}") from exc


def check_output(target: str) -> None:
    """A local output file's folder exists and takes files (said before the run, not after it)."""
    if target.startswith(("http://", "https://")):
        return
    folder = Path(target).resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise BatchFileError(f"cannot write the batch output {target}: {folder} is not a writable directory")


def parse_batch(text: str) -> list[BatchLine]:
    """The requests of a batch file (blank lines skipped); `BatchFileError` at the first line that cannot run."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError as exc:
            raise BatchFileError(f"line {number}: not JSON ({exc})") from exc
        if not isinstance(item, dict):
            raise BatchFileError(f"line {number}: a batch request is a JSON object with custom_id, method, url and "
                                 "body")
        custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchFileError(f"line {number}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise BatchFileError(f"line {number}: custom_id {custom_id!r} is used twice: each request needs its own")
        if method != "POST":
            raise BatchFileError(f"line {number}: method must be \"POST\", got {method!r}")
        if url not in URLS:
            raise BatchFileError(f"line {number}: url {url!r} is not one run-batch takes ({', '.join(URLS)})")
        if not isinstance(body, dict):
            raise BatchFileError(f"line {number}: body must be a JSON object (the request {url} takes)")
        if body.get("stream"):
            raise BatchFileError(f"line {number}: a batch request cannot stream (\"stream\": true)")
        seen.add(custom_id)
        lines.append(BatchLine(custom_id, url, body))
    return lines


async def post(app: FastAPI, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` (JSON) to `path` of the ASGI app; its status and body. The client never goes away."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"run-batch"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("run-batch", 0)}
    done = asyncio.Event()
    sent = False
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    done.set()
    return status, b"".join(chunks)


async def run_line(app: FastAPI, line: BatchLine, slots: asyncio.Semaphore) -> dict[str, Any]:
    """One request through its route (again while the server's queue is full): its output line."""
    payload = json.dumps(line.body).encode()
    while True:
        async with slots:
            status, raw = await post(app, line.url, payload)
        if status != 503 or b"server_overloaded" not in raw:
            break
        await asyncio.sleep(RETRY_S)
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = {"error": {"message": raw.decode("utf-8", "replace"), "code": status}}
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    error = None
    if status >= 400:
        detail = body.get("error") if isinstance(body, dict) else None
        message = (detail.get("message") if isinstance(detail, dict) else detail) or str(body)
        error = {"code": str(status), "message": str(message)}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body},
            "error": error}


async def run_lines(llm: LLM, settings: ServerSettings, lines: list[BatchLine],
                    metrics_address: tuple[str, int] | None = None) -> list[dict[str, Any]]:
    """Every line through the server app over `llm`, at most `settings.max_queue` at once; outputs in order.
    `metrics_address`: (host, port) of a Prometheus endpoint serving the app's metrics meanwhile (vLLM's
    `--enable-metrics`)."""
    app = build_app(llm, settings)
    if metrics_address is not None:
        host, port = metrics_address
        prometheus_client.start_http_server(port, addr=host, registry=app.state.serving.metrics.registry)
    slots = asyncio.Semaphore(settings.max_queue)
    async with app.router.lifespan_context(app):
        with tqdm(total=len(lines), unit="req", desc="Running batch") as bar:
            async def one(line: BatchLine) -> dict[str, Any]:
                out = await run_line(app, line, slots)
                bar.update()
                return out
            return list(await asyncio.gather(*(one(line) for line in lines)))


def write_output(target: str, outputs: list[dict[str, Any]], tmp_dir: str | None = None) -> None:
    """The output lines to a local file (a temporary file in `tmp_dir` or beside it, then renamed) or PUT to an
    http(s) URL (the file in `tmp_dir` kept if the upload fails)."""
    text = "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs)
    remote = target.startswith(("http://", "https://"))
    folder = tmp_dir or (None if remote else str(Path(target).resolve().parent))
    if remote and folder is None:
        upload(target, text.encode())
        return
    fd, path = tempfile.mkstemp(prefix="batch_output_", suffix=".jsonl", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    if not remote:
        shutil.move(path, target)
        return
    try:
        upload(target, Path(path).read_bytes())
    except OSError as exc:
        raise OSError(f"{exc}; the results are kept in {path}") from exc
    os.unlink(path)


def upload(url: str, data: bytes) -> None:
    request = urllib.request.Request(url, data=data, method="PUT", headers={"Content-Type": "application/jsonl"})
    try:
        with urllib.request.urlopen(request, timeout=1000) as reply:
            status = reply.status
    except OSError as exc:  # (urllib's HTTPError and URLError are OSErrors)
        raise OSError(f"uploading the batch output to {url} failed: {exc}") from exc
    if not 200 <= status < 300:
        raise OSError(f"uploading the batch output to {url} failed: HTTP {status}")


def run_batch(llm: LLM, settings: ServerSettings, lines: list[BatchLine], output: str, tmp_dir: str | None = None,
              metrics_address: tuple[str, int] | None = None) -> list[dict[str, Any]]:
    """Run parsed batch lines on `llm` and write the output; the output lines."""
    outputs = asyncio.run(run_lines(llm, settings, lines, metrics_address))
    write_output(output, outputs, tmp_dir)
    failed = sum(o["error"] is not None for o in outputs)
    logger.info("run-batch: %d requests, %d failed; wrote %s", len(outputs), failed, output)
    return outputs
