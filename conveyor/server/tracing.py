"""OpenTelemetry traces (vLLM's `--otlp-traces-endpoint`, `--collect-detailed-traces`): one span per engine
request, named `llm_request` as vLLM's, exported over OTLP to a collector (Jaeger, Tempo, an OpenTelemetry
Collector). The protocol is the standard `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`: `grpc` (vLLM's default) or
`http/protobuf` (an endpoint without a path gets OTLP's `/v1/traces`).

The span is made when the request ends, on the event loop, with its start and end set to the request's
arrival and finish, and vLLM's attribute names (`gen_ai.latency.time_in_queue`, `time_to_first_token`,
`e2e`, `time_in_model_prefill`, `_decode`, `_inference`, `gen_ai.usage.prompt_tokens`,
`completion_tokens`, `gen_ai.response.finish_reasons`, the request's sampling parameters); a request
that failed or timed out gets an error status. A W3C `traceparent` (and `tracestate`) header on the HTTP
request makes its spans children of the caller's. The SDK's batch processor exports on its own thread,
so a request costs the engine nothing and the event loop one span. `--collect-detailed-traces` (any of
vLLM's values) adds span events at the request's arrival, first scheduling, first token and end, and its
inter-token latencies' mean and maximum; vLLM's per-request model forward times are not measured.

The SDK and exporters are the optional `otel` extra: asked for without them, `conveyor serve` stops at
start with the command that installs them."""

from __future__ import annotations

import contextvars
import importlib
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from ..errors import MissingDependencyError, install_command
from ..request import Request, RequestOutput
from .asgi import HTTPMiddleware

PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
EXPORTERS = {"grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
             "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter"}
DETAIL_MODULES = ("model", "worker", "all")  # vLLM's values of --collect-detailed-traces
TRACE_HEADERS = (b"traceparent", b"tracestate")
SPAN_NAME = "llm_request"
# The W3C trace headers of the HTTP request being handled (set by `TraceHeaders`, read at submission).
trace_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("trace_headers", default=None)


@dataclass(frozen=True)
class TracingSettings:
    endpoint: str
    protocol: str = "grpc"
    detailed: bool = False

    @classmethod
    def from_args(cls, args: Any) -> TracingSettings | None:
        """The tracing options of `conveyor serve`, checked (the packages too); None when off."""
        if args.otlp_traces_endpoint is None:
            if args.collect_detailed_traces is not None:
                raise ValueError("--collect-detailed-traces takes effect only with --otlp-traces-endpoint")
            return None
        modules = [m.strip() for m in (args.collect_detailed_traces or "").split(",") if m.strip()]
        bad = [m for m in modules if m not in DETAIL_MODULES]
        if bad:
            raise ValueError(f"--collect-detailed-traces takes {', '.join(DETAIL_MODULES)} (comma-separated), got "
                             f"{', '.join(bad)}")
        protocol = os.environ.get(PROTOCOL_VARIABLE, "grpc").strip().lower()
        if protocol not in EXPORTERS:
            raise ValueError(f"{PROTOCOL_VARIABLE}={protocol!r}: traces go over OTLP as grpc or http/protobuf")
        settings = cls(args.otlp_traces_endpoint, protocol, bool(modules))
        otel_modules(protocol)
        return settings


def otel_modules(protocol: str) -> tuple[Any, Any]:
    """(the SDK's trace module, the OTLP exporter's module for `protocol`); `MissingDependencyError` naming
    the `otel` extra when they are not installed."""
    try:
        return (importlib.import_module("opentelemetry.sdk.trace"), importlib.import_module(EXPORTERS[protocol]))
    except ImportError as exc:
        raise MissingDependencyError(
            f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter (opentelemetry-sdk, "
            f"opentelemetry-exporter-otlp), which are not installed ({exc.name or exc}): pip install "
            f"'conveyor[otel]' (for this checkout: {install_command('otel')})", name=exc.name) from None


class TraceHeaders(HTTPMiddleware):
    """ASGI middleware: the request's W3C trace headers into `trace_headers` while it is handled."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in TRACE_HEADERS}
        token = trace_headers.set(found or None)
        try:
            await self.app(scope, receive, send)
        finally:
            trace_headers.reset(token)


def add_trace_headers(app: FastAPI, tracing: TracingSettings | None) -> None:
    if tracing is not None:
        app.add_middleware(TraceHeaders)


def otlp_endpoint(endpoint: str, protocol: str) -> str:
    """OTLP/HTTP's exporter takes the whole URL: an endpoint without a path gets `/v1/traces`."""
    if protocol == "http/protobuf" and urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


class RequestTracer:
    """A span per finished request (a `RequestObserver`)."""

    def __init__(self, settings: TracingSettings, model_name: str) -> None:
        sdk, exporter = otel_modules(settings.protocol)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.settings, self.model_name = settings, model_name
        # OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) win; else the service is "conveyor"
        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "conveyor"}
        self.provider = sdk.TracerProvider(resource=Resource.create(named))
        self.provider.add_span_processor(BatchSpanProcessor(exporter.OTLPSpanExporter(
            endpoint=otlp_endpoint(settings.endpoint, settings.protocol))))
        self.tracer = self.provider.get_tracer("conveyor.server")
        self.propagator = TraceContextTextMapPropagator()
        self.kind, self.error = SpanKind.SERVER, lambda text: Status(StatusCode.ERROR, text)
        self.parents: dict[str, Any] = {}  # request id -> the caller's trace context, until it ends

    def submitted(self, requests: list[Request]) -> None:
        headers = trace_headers.get()
        if headers:
            parent = self.propagator.extract(headers)
            for request in requests:
                self.parents[request.request_id] = parent

    def finished(self, request: Request, out: RequestOutput) -> None:
        m = out.metrics
        if m is None:
            return
        shift = time.time() - time.monotonic()

        def ns(t: float) -> int:
            """Monotonic seconds as the wall clock's nanoseconds, as spans take them."""
            return int((t + shift) * 1e9)

        end = m.finished_time or time.monotonic()
        span = self.tracer.start_span(SPAN_NAME, context=self.parents.pop(out.request_id, None), kind=self.kind,
                                      start_time=ns(m.arrival_time), attributes=span_attributes(
                                          request, out, self.model_name, self.settings.detailed))
        if self.settings.detailed:
            for name, t in (("arrived", m.arrival_time), ("scheduled", m.first_scheduled_time),
                            ("first_token", m.first_token_time), ("finished", end)):
                if t is not None:
                    span.add_event(name, timestamp=ns(t))
        if out.finish_reason in ("error", "timeout"):
            span.set_status(self.error(out.error or out.finish_reason))
        span.end(end_time=ns(end))

    def close(self) -> None:
        """Export what is left (at the server's shutdown)."""
        self.provider.shutdown()


def span_attributes(request: Request, out: RequestOutput, model_name: str, detailed: bool) -> dict[str, Any]:
    """vLLM's attributes of a request's span (`SpanAttributes` there), the latencies in seconds."""
    m, params = out.metrics, request.params
    assert m is not None
    end = m.finished_time or time.monotonic()
    attributes: dict[str, Any] = {
        "gen_ai.response.model": model_name, "gen_ai.request.id": out.request_id,
        "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.max_tokens": params.max_new_tokens, "gen_ai.request.n": 1,
        "gen_ai.usage.num_sequences": 1, "gen_ai.usage.prompt_tokens": out.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": out.num_output_tokens,
        "gen_ai.response.finish_reasons": [out.finish_reason or "unknown"],
        "gen_ai.latency.e2e": end - m.arrival_time}
    if m.first_scheduled_time is not None:
        attributes["gen_ai.latency.time_in_queue"] = m.first_scheduled_time - m.arrival_time
    if m.first_token_time is not None and m.first_scheduled_time is not None:  # the one implies the other
        attributes["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
        attributes["gen_ai.latency.time_in_model_prefill"] = m.first_token_time - m.first_scheduled_time
        last = m.token_times[-1] if m.token_times else m.first_token_time
        attributes["gen_ai.latency.time_in_model_decode"] = last - m.first_token_time
        attributes["gen_ai.latency.time_in_model_inference"] = last - m.first_scheduled_time
    if detailed and len(m.token_times) > 1:
        gaps = [b - a for a, b in zip(m.token_times, m.token_times[1:])]
        attributes["conveyor.latency.inter_token_mean"] = sum(gaps) / len(gaps)
        attributes["conveyor.latency.inter_token_max"] = max(gaps)
    return attributes
