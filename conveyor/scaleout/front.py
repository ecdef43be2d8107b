"""The one address in front of the replicas: generation traffic through the router, operations here.

The router answers the OpenAI routes and routes them (cache-aware), but it has no fleet view: vllm-router
passes any other path (`/metrics`, `/dashboard`) to whichever replica its policy picks, and sglang-router
answers them 404. So the public address is this small app, which

- passes every request it does not answer itself to the router as it came (method, path, headers, body)
  and streams the router's answer back as it arrives; the router chooses the replica, retries a
  request on another replica when its replica failed before sending anything, and marks dead
  replicas down by its health checks;
- ends a server-sent-event stream that breaks off (its replica died after sending part of the answer,
  which cannot be retried without answering twice) with an error event naming what happened, then
  `data: [DONE]`, instead of a connection cut that clients read as a network error;
- answers `GET /health` (200 while the router runs and at least one replica answers; 503 otherwise and
  while stopping), `GET /metrics` (every replica's metrics labelled `engine`, their sums as
  `engine="all"`, the supervisor's gauges, the router's own metrics), `GET /dashboard` (a page with a
  row per replica) and `GET /dashboard/data`, and `GET /engines/{i}/...`: replica i's own `/health`,
  `/metrics`, `/dashboard` and `/dashboard/data`;
- while stopping, answers new requests 503 with Retry-After while the replicas drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from . import fleet_metrics
from .supervisor import Supervisor

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length"}
SCRAPE_TIMEOUT_S = 2.0
ENGINE_PATHS = ("health", "metrics", "dashboard", "dashboard/data")
CUT_MESSAGE = ("the replica serving this request stopped after it had sent part of the answer (it died or was "
               "killed; the supervisor restarts it); the request was not retried, since that would answer it "
               "twice: send it again")
STATIC = Path(__file__).resolve().parent / "static"


def error_body(status: int, message: str, code: str, type_: str = "service_unavailable_error") -> dict[str, Any]:
    """An OpenAI error object, as Conveyor's server writes them."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def unavailable(message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(503, message, code), status_code=503, headers={"Retry-After": "1"})


def sse_error(message: str, code: str) -> bytes:
    return f"data: {json.dumps(error_body(500, message, code, 'server_error'))}\n\ndata: [DONE]\n\n".encode()


async def relay(upstream: httpx.Response, sse: bool) -> AsyncIterator[bytes]:
    """The router's answer as it arrives; a broken-off event stream ends with an error event and [DONE]."""
    tail = b""
    try:
        async for chunk in upstream.aiter_raw():
            tail = (tail + chunk)[-64:]
            yield chunk
        cut = False
    except httpx.HTTPError:
        cut = True
    finally:
        await upstream.aclose()
    if sse and (cut or not tail.rstrip().endswith(b"data: [DONE]")):
        yield (b"" if tail.endswith(b"\n\n") else b"\n\n") + sse_error(CUT_MESSAGE, "replica_failed")


class Front:
    """The front's state: the supervisor (replicas, router), whether it is stopping, its HTTP client."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.stopping = False
        self.client: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self.client is None:  # made on the event loop that serves
            self.client = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=None,
                                            max_keepalive_connections=256),
                                            timeout=httpx.Timeout(None, connect=10.0))
        return self.client

    async def fetch(self, url: str) -> httpx.Response | None:
        try:
            return await self.http.get(url, timeout=SCRAPE_TIMEOUT_S)
        except httpx.HTTPError:
            return None

    async def fetch_all(self, path: str) -> list[httpx.Response | None]:
        return list(await asyncio.gather(*(self.fetch(f"{r.url}{path}") for r in self.supervisor.replicas)))

    async def proxy(self, request: Request) -> Response:
        router = self.supervisor.router
        if self.stopping:
            return unavailable("the server is shutting down", "shutting_down")
        if router is None or not router.alive():
            return unavailable("the router is not running (the supervisor is restarting it)", "router_down")
        url = f"{router.url}{request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.raw if k.decode().lower() not in HOP_BY_HOP]
        outgoing = self.http.build_request(request.method, url, headers=headers, content=await request.body())
        try:
            upstream = await self.http.send(outgoing, stream=True)
        except httpx.HTTPError as exc:
            return unavailable(f"the router did not answer: {exc}", "router_down")
        sse = upstream.status_code == 200 and upstream.headers.get("content-type", "").startswith("text/event-stream")
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(relay(upstream, sse), status_code=upstream.status_code, headers=kept)

    def health(self) -> Response:
        router = self.supervisor.router
        up = sum(r["state"] == "up" for r in self.supervisor.snapshot())
        if self.stopping:
            return unavailable("not serving: shutting down", "shutting_down")
        if router is None or not router.alive():
            return unavailable("not serving: the router is not running", "router_down")
        if not up:
            return unavailable("not serving: no replica answers /health", "no_replica")
        return Response(status_code=200)

    async def metrics(self) -> Response:
        replies = await self.fetch_all("/metrics")
        texts = {str(i): r.text for i, r in enumerate(replies) if r is not None and r.status_code == 200}
        router = self.supervisor.router
        routed = await self.fetch(router.metrics_url) if router is not None else None
        body = fleet_metrics.render(texts, self.supervisor.snapshot(),
                                    routed.text if routed is not None and routed.status_code == 200 else "")
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def dashboard_data(self) -> dict[str, Any]:
        replies = await self.fetch_all("/dashboard/data")
        engines = []
        for info, reply in zip(self.supervisor.snapshot(), replies):
            data = reply.json() if reply is not None and reply.status_code == 200 else None
            engines.append(info | {"data": None if data is None else {
                k: data.get(k) for k in ("model", "requests", "prefix_cache", "recent", "latency")} | {
                "kv_usage": data["kv"]["usage"]}})
        live = [e["data"] for e in engines if e["data"] is not None]
        hits = sum(d["prefix_cache"]["hit_tokens"] for d in live)
        queries = sum(d["prefix_cache"]["query_tokens"] for d in live)
        router = self.supervisor.router
        return {"router": None if router is None else {"name": router.name, "alive": router.alive(),
                                                        "restarts": self.supervisor.router_restarts},
                "engines": engines, "total": {
                    "running": sum(d["requests"]["running"] for d in live),
                    "waiting": sum(d["requests"]["waiting"] for d in live),
                    "finished": sum(d["requests"]["finished"] for d in live),
                    "output_tok_s": sum(d["recent"]["output_tok_s"] for d in live),
                    "prefix_cache_hit_rate": hits / queries if queries else None}}

    async def engine_get(self, index: int, path: str) -> Response:
        if not 0 <= index < len(self.supervisor.replicas) or path not in ENGINE_PATHS:
            return JSONResponse(error_body(404, f"no such page: /engines/{index}/{path} (engines 0-"
                                           f"{len(self.supervisor.replicas) - 1}, pages {', '.join(ENGINE_PATHS)})",
                                           "not_found", "invalid_request_error"), status_code=404)
        reply = await self.fetch(f"{self.supervisor.replicas[index].url}/{path}")
        if reply is None:
            return unavailable(f"replica {index} does not answer", "replica_down")
        return Response(reply.content, status_code=reply.status_code,
                        media_type=reply.headers.get("content-type"))


@cache
def fleet_page() -> str:
    return (STATIC / "fleet.html").read_text()


def build_front(front: Front) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if front.client is not None:
            await front.client.aclose()

    app = FastAPI(title="Conveyor (data parallel)", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return front.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await front.metrics()

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(fleet_page())

    @app.get("/dashboard/data")
    async def dashboard_data() -> dict[str, Any]:
        return await front.dashboard_data()

    @app.get("/engines/{index}/{path:path}")
    async def engine(index: int, path: str) -> Response:
        return await front.engine_get(index, path)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def proxy(request: Request) -> Response:
        return await front.proxy(request)

    return app
