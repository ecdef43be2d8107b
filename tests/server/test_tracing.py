"""OpenTelemetry traces (`--otlp-traces-endpoint`): a span per request reaches a local OTLP receiver, over
HTTP/protobuf (a few lines of http.server) and over gRPC, with vLLM's attribute names, the caller's
`traceparent` as its parent, an error status for a request that timed out, and with
`--collect-detailed-traces` the request's milestones as events; without the packages, a clear error."""

from __future__ import annotations

import gzip
import http.server
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from conveyor import LLM
from conveyor.cli import main
from conveyor.errors import MissingDependencyError
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.tracing import TracingSettings

from tests.serving_helpers import serve_parser
from tests.utils import TinyModel, all_free

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
LATENCIES = ["gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
             "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode",
             "gen_ai.latency.time_in_model_inference"]


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel) -> Iterator[LLM]:
    llm = tiny_llama.llm(num_blocks=64)
    yield llm
    llm.shutdown()


def http_receiver(spans: list[Any]) -> tuple[http.server.ThreadingHTTPServer, str]:
    """An OTLP/HTTP receiver: each POST's ExportTraceServiceRequest, its spans kept with their resource."""
    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            keep(trace_service_pb2.ExportTraceServiceRequest.FromString(body), spans)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"  # no path: the exporter's gets /v1/traces


def grpc_receiver(spans: list[Any]) -> tuple[grpc.Server, str]:
    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            keep(request, spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}"


def keep(request: Any, spans: list[Any]) -> None:
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            spans += [(resource_spans.resource, span) for span in scope_spans.spans]


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_span_per_request_reaches_the_collector(llm: LLM, protocol: str) -> None:
    spans: list[Any] = []
    server, endpoint = http_receiver(spans) if protocol != "grpc" else grpc_receiver(spans)
    settings = ServerSettings(tracing=TracingSettings(endpoint, protocol, detailed=True), served_model_names=["tiny"])
    with BackgroundServer(llm, settings) as url, httpx.Client(base_url=url, timeout=60) as client:
        answer = client.post("/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 4, "ignore_eos": True,
                                                      "temperature": 0.5}, headers={
            "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        late = client.post("/v1/completions", json={"prompt": "w8", "max_tokens": 400, "ignore_eos": True,
                                                    "request_timeout": 0.001})
    if protocol == "grpc":  # the server's shutdown exported what was left
        server.stop(None)
    else:
        server.shutdown()
    assert answer.status_code == 200 and late.status_code == 504
    assert len(spans) == 2 and all_free(llm)
    resource, span = next(s for s in spans if s[1].trace_id.hex() == TRACE_ID)
    assert {a.key: value(a.value) for a in resource.attributes}["service.name"] == "conveyor"
    assert (span.name, span.parent_span_id.hex(), span.kind) == ("llm_request", PARENT_ID, 2)  # SERVER
    attributes = {a.key: value(a.value) for a in span.attributes}
    assert attributes["gen_ai.request.id"] == answer.json()["id"] + "-0"
    assert (attributes["gen_ai.response.model"], attributes["gen_ai.usage.prompt_tokens"],
            attributes["gen_ai.usage.completion_tokens"], attributes["gen_ai.response.finish_reasons"],
            attributes["gen_ai.request.temperature"], attributes["gen_ai.request.max_tokens"]) == (
        "tiny", 3, 4, ["length"], 0.5, 4)
    queue, ttft, e2e, prefill, decode, inference = (attributes[name] for name in LATENCIES)
    assert 0 <= queue <= ttft <= e2e and 0 < prefill <= ttft and 0 <= decode <= inference <= e2e
    assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9, abs=2e6)
    assert [e.name for e in span.events] == ["arrived", "scheduled", "first_token", "finished"]
    assert attributes["conveyor.latency.inter_token_max"] >= attributes["conveyor.latency.inter_token_mean"] > 0
    [timed_out] = [s for _, s in spans if s is not span]
    assert timed_out.status.code == 2 and "request_timeout of 0.001 s" in timed_out.status.message  # ERROR
    assert {a.key: value(a.value) for a in timed_out.attributes}["gen_ai.response.finish_reasons"] == ["timeout"]


def test_tracing_flags_and_the_protocol_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    args = serve_parser().parse_args(["--otlp-traces-endpoint", "http://collector:4318", "--collect-detailed-traces",
                                      "model,worker"])
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert ServerSettings.from_args(args).tracing == TracingSettings("http://collector:4318", "http/protobuf", True)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    assert TracingSettings.from_args(serve_parser().parse_args(["--otlp-traces-endpoint", "x:4317"])).protocol == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="traces go over OTLP as grpc or http/protobuf"):
        TracingSettings.from_args(args)
    with pytest.raises(ValueError, match="--collect-detailed-traces takes effect only with --otlp-traces-endpoint"):
        TracingSettings.from_args(serve_parser().parse_args(["--collect-detailed-traces", "all"]))
    assert TracingSettings.from_args(serve_parser().parse_args([])) is None


def test_without_the_packages_serve_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'conveyor\[otel\]'"):
        TracingSettings.from_args(serve_parser().parse_args(["--otlp-traces-endpoint", "localhost:4317"]))
    assert main(["serve", "--otlp-traces-endpoint", "localhost:4317"]) == 2  # before any model loads
    assert "--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter" in capsys.readouterr().err
