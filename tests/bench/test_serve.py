"""Tests of `conveyor bench serve` against a tiny fake OpenAI-compatible streaming server (standard
library only, on 127.0.0.1 with a free port) that streams a known number of chunks with known
delays, fails on request, drops connections and records the peak number of requests in flight."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import socket
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from conveyor.bench import main
from conveyor.kernels import vector_flags
from conveyor.bench.serve import benchmark
from conveyor.bench.serve_client import RequestResult, api_urls, build_payload
from conveyor.bench.serve_load import arrival_times, synthetic_text_workload
from conveyor.bench.serve_stats import compute_metrics, percentile, summarize_ms
from conveyor.bench.workloads import BenchRequest, Workload

MODEL = "fake-model"


# -- the fake server ------------------------------------------------------------------------------
class FakeServer:
    """Streams `max_tokens` token chunks per request: a role-only chunk at once (chat; as
    llama-server does before prefill), the first token after `ttft` s, the others `itl` s apart,
    then a bare finish chunk, a usage chunk (unless usage=False) and [DONE]. A prompt containing
    FAIL500 gets HTTP 500, DROP gets one token then a dropped connection, STALL never finishes,
    LINGER keeps the body open for 3 s after [DONE], EMPTY generates only an EOS (a closing chunk
    without text, usage 1 token)."""

    def __init__(self, ttft: float = 0.05, itl: float = 0.02, usage: bool = True) -> None:
        self.ttft, self.itl, self.usage = ttft, itl, usage
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.connections: set = set()
        self.active = self.peak = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, *args) -> None:
                pass

            def _json(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _event(self, obj) -> None:
                data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

            def do_GET(self) -> None:
                fake.paths.append(self.path)
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append(body)
                    fake.paths.append(self.path)
                    fake.connections.add(self.client_address)
                    fake.active += 1
                    fake.peak = max(fake.peak, fake.active)
                try:
                    self._stream(body)
                finally:
                    with fake.lock:
                        fake.active -= 1

            def _stream(self, body: dict) -> None:
                chat = self.path.endswith("/chat/completions")
                prompt = body["messages"][0]["content"] if chat else body["prompt"]
                if "FAIL500" in prompt:
                    self._json(500, {"error": {"message": "injected failure"}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(choice: dict) -> dict:
                    return {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                            "model": body["model"], "choices": [{"index": 0, "finish_reason": None} | choice]}

                if chat:
                    self._event(chunk({"delta": {"role": "assistant", "content": None}}))
                n = 0 if "EMPTY" in prompt else body["max_tokens"]
                if n == 0:  # an EOS at once: only a closing chunk, after the prefill
                    time.sleep(fake.ttft)
                for i in range(n):
                    time.sleep(fake.ttft if i == 0 else fake.itl)
                    self._event(chunk({"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}))
                    if "DROP" in prompt:
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if "STALL" in prompt:
                        fake.stopping.wait(10)
                        self.close_connection = True
                        return
                # a separate finish chunk without text (as llama-server's; not a token)
                reason = "stop" if n == 0 else "length"
                self._event(chunk({"delta": {}, "finish_reason": reason} if chat
                                  else {"text": "", "finish_reason": reason}))
                if fake.usage:
                    self._event({"id": "x", "choices": [], "usage": {
                        "prompt_tokens": len(prompt.split()), "completion_tokens": max(n, 1),
                        "total_tokens": len(prompt.split()) + n}})
                self._event("[DONE]")
                if "LINGER" in prompt:  # keeps the body open after [DONE]
                    fake.stopping.wait(3)
                self.wfile.write(b"0\r\n\r\n")

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128

            def handle_error(self, request, client_address) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def workload(prompts: list[str], max_new_tokens: int = 4, ignore_eos: bool = False) -> Workload:
    return Workload(name="test", requests=[BenchRequest(max_new_tokens=max_new_tokens, prompt=p,
                                                        ignore_eos=ignore_eos) for p in prompts])


def run(server: FakeServer, wl: Workload, **kwargs) -> dict:
    kwargs.setdefault("test_request", False)
    kwargs.setdefault("progress", False)
    return asyncio.run(benchmark(server.url, wl, **kwargs))


# -- statistics -----------------------------------------------------------------------------------
def test_percentile_matches_numpy_on_known_samples():
    samples = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0, 5.0]
    for q in (0, 10, 25, 50, 90, 99, 100):
        assert percentile(samples, q) == pytest.approx(float(np.percentile(samples, q)))
    assert percentile(list(range(1, 11)), 50) == 5.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_ms_known_values():
    s = summarize_ms([0.001, 0.002, 0.003, 0.004])  # seconds in, milliseconds out
    assert s["mean"] == pytest.approx(2.5)
    assert s["median"] == pytest.approx(2.5)
    assert s["std"] == pytest.approx(math.sqrt(1.25))  # population std, as numpy / vllm
    assert s["p90"] == pytest.approx(3.7)
    assert s["p99"] == pytest.approx(3.97)
    assert summarize_ms([]) == {"mean": None, "median": None, "std": None, "p90": None, "p99": None}


def test_compute_metrics_tpot_formula_and_throughputs():
    results = [
        RequestResult(index=0, success=True, start_s=0.0, ttft_s=0.1, latency_s=0.5, itl_s=[0.2, 0.2],
                      output_tokens=5, output_tokens_source="usage", prompt_tokens=10),
        RequestResult(index=1, success=True, start_s=0.2, ttft_s=0.3, latency_s=0.3, itl_s=[],
                      output_tokens=1, output_tokens_source="usage", prompt_tokens=6),  # no TPOT
        RequestResult(index=2, success=False, error="HTTP 500", start_s=0.1),
    ]
    assert results[0].tpot_s == pytest.approx((0.5 - 0.1) / (5 - 1))
    assert results[1].tpot_s is None and results[2].tpot_s is None
    m = compute_metrics(results, 2.0, request_rate=4.0)
    assert (m["completed"], m["failed"], m["num_prompts"]) == (2, 1, 3)
    assert m["total_input_tokens"] == 16 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(11.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0) and m["p99_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["mean_e2el_ms"] == pytest.approx(400.0)
    assert m["max_concurrent_requests"] == 2  # [0, 0.5) and [0.2, 0.5) overlap
    assert m["errors"] == {"HTTP 500": 1}
    assert m["request_rate"] == 4.0
    assert compute_metrics([], 1.0)["mean_ttft_ms"] is None


# -- arrivals -------------------------------------------------------------------------------------
def test_poisson_arrivals_reproducible_with_the_right_rate():
    a = arrival_times(20000, 4.0, seed=7, normalize=False)
    assert a == arrival_times(20000, 4.0, seed=7, normalize=False)
    assert a != arrival_times(20000, 4.0, seed=8, normalize=False)
    gaps = np.diff([0.0] + a)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)          # mean rate 4 req/s
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV 1
    assert np.mean(gaps < 0.25) == pytest.approx(1 - math.exp(-1), abs=0.02)  # P(gap < mean) of Exp
    # vllm's normalisation: the last request goes out at exactly N / rate
    b = arrival_times(100, 10.0, seed=3)
    assert b[-1] == pytest.approx(10.0) and b == sorted(b) and b[0] > 0
    assert b == arrival_times(100, 10.0, seed=3)
    # more regular with burstiness > 1 (gamma shape 4: CV 1/2), all at once for inf
    g = np.diff([0.0] + arrival_times(20000, 4.0, seed=1, burstiness=4.0, normalize=False))
    assert g.mean() == pytest.approx(0.25, rel=0.03) and g.std() / g.mean() == pytest.approx(0.5, rel=0.05)
    assert arrival_times(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 0.0)


# -- against the fake server ----------------------------------------------------------------------
def test_streams_are_timed_against_the_injected_delays():
    ttft, itl, n = 0.05, 0.02, 6
    with FakeServer(ttft=ttft, itl=itl) as server:
        report = run(server, workload([f"hello world {i}" for i in range(8)], max_new_tokens=n))
    r = report["results"][0]
    assert report["model_id"] == MODEL  # the first of GET /v1/models
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["total_output_tokens"] == 8 * n and r["output_tokens_from_usage"] == 8
    assert r["total_input_tokens"] == 8 * 3
    for req in r["requests"]:
        assert req["success"] and req["output_tokens"] == n and req["token_chunks"] == n  # role chunk not a token
        assert req["finish_reason"] == "length"
        assert req["ttft_s"] >= ttft  # the role-only chunk sent at once does not start the TTFT
        assert len(req["itl_s"]) == n - 1
        assert req["tpot_s"] == pytest.approx((req["latency_s"] - req["ttft_s"]) / (n - 1))
        assert req["latency_s"] == pytest.approx(req["ttft_s"] + sum(req["itl_s"]))
    # figures in ms, close to the injected delays (loose upper bounds: a shared 2-core machine)
    assert ttft * 1000 <= r["median_ttft_ms"] < ttft * 1000 + 60
    assert itl * 1000 * 0.8 <= r["median_itl_ms"] < itl * 1000 + 25
    assert itl * 1000 * 0.9 <= r["median_tpot_ms"] < itl * 1000 + 25
    tpots = [(q["latency_s"] - q["ttft_s"]) / (n - 1) * 1000 for q in r["requests"]]
    assert r["mean_tpot_ms"] == pytest.approx(statistics.mean(tpots))
    assert r["mean_e2el_ms"] >= (ttft + (n - 1) * itl) * 1000 * 0.95
    assert r["duration"] >= ttft + (n - 1) * itl
    assert r["output_throughput"] == pytest.approx(8 * n / r["duration"])


def test_payloads_chat_and_completions():
    wl = synthetic_text_workload(5, 3, 2, seed=1)
    assert all(len(r.prompt.split()) == 5 and r.ignore_eos for r in wl.requests)
    assert synthetic_text_workload(5, 3, 2, seed=1).requests[0].prompt == wl.requests[0].prompt
    with FakeServer(ttft=0.0, itl=0.0) as server:
        chat = run(server, wl, model="m1")
        comp = run(server, workload(["plain prompt"], max_new_tokens=2), endpoint="/v1/completions", model="m2")
        bodies, paths = list(server.bodies), list(server.paths)
    assert chat["results"][0]["completed"] == 2 and comp["results"][0]["completed"] == 1
    assert comp["results"][0]["total_output_tokens"] == 2
    assert "/v1/models" not in paths  # --model given: no discovery
    assert [p for p in paths if p != "/metrics"] == ["/v1/chat/completions"] * 2 + ["/v1/completions"]
    assert paths.count("/metrics") == 2  # before each run (a server without Conveyor's counters: not after)
    assert chat["results"][0]["prefix_cache"] is None
    c = bodies[0]
    assert c["messages"] == [{"role": "user", "content": wl.requests[0].prompt}] or \
        c["messages"] == [{"role": "user", "content": wl.requests[1].prompt}]
    for b in bodies:
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True} and b["temperature"] == 0
    assert {b["max_tokens"] for b in bodies[:2]} == {3} and bodies[0]["model"] == "m1"
    assert bodies[0]["ignore_eos"] is True
    p = bodies[2]
    assert p["prompt"] == "plain prompt" and "messages" not in p and "ignore_eos" not in p
    assert p["max_tokens"] == 2 and p["model"] == "m2"
    assert build_payload(BenchRequest(max_new_tokens=4, prompt="x"), model="m", chat=True)["max_tokens"] == 4


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_an_eos_at_once_is_a_success_timed_by_the_closing_chunk(endpoint):
    with FakeServer(ttft=0.03, itl=0.01) as server:
        r = run(server, workload(["EMPTY reply", "full reply"], max_new_tokens=3), endpoint=endpoint)["results"][0]
    assert (r["completed"], r["failed"]) == (2, 0)
    empty, full = sorted(r["requests"], key=lambda q: q["index"])
    assert empty["output_tokens"] == 1 and empty["finish_reason"] == "stop" and empty["ttft_s"] >= 0.03
    assert empty["itl_s"] == [] and empty["tpot_s"] is None
    assert full["token_chunks"] == 3 and len(full["itl_s"]) == 2  # its closing chunk is no token


def test_output_tokens_counted_from_chunks_without_usage():
    with FakeServer(ttft=0.0, itl=0.0, usage=False) as server:
        r = run(server, workload(["a b", "c d"], max_new_tokens=5))["results"][0]
    assert r["completed"] == 2 and r["total_output_tokens"] == 10
    assert r["output_tokens_from_usage"] == 0 and r["input_tokens_reported"] == 0
    assert all(q["output_tokens_source"] == "chunks" for q in r["requests"])


def test_failures_are_counted_not_raised():
    with FakeServer(ttft=0.01, itl=0.01) as server:
        started = time.perf_counter()
        report = run(server, workload(["ok one", "FAIL500 please", "DROP it", "STALL forever", "ok two"],
                                      max_new_tokens=3), timeout_s=0.5)
        elapsed = time.perf_counter() - started
    r = report["results"][0]
    assert (r["completed"], r["failed"]) == (2, 3)
    by_index = {q["index"]: q for q in r["requests"]}
    assert by_index[1]["status"] == 500 and by_index[1]["error"].startswith("HTTP 500")
    assert "injected failure" in by_index[1]["error"]
    assert not by_index[2]["success"] and by_index[2]["error"]  # dropped mid-stream
    assert "timed out" in by_index[3]["error"]
    assert by_index[0]["success"] and by_index[4]["success"]
    assert r["total_output_tokens"] == 6  # failed requests' tokens are not counted
    assert sum(r["errors"].values()) == 3
    assert elapsed < 3.0  # bounded by the request timeout


def test_max_concurrency_is_respected():
    with FakeServer(ttft=0.03, itl=0.01) as server:
        r = run(server, workload([f"p {i}" for i in range(10)], max_new_tokens=3), max_concurrency=3)["results"][0]
        peak = server.peak
    assert r["completed"] == 10
    assert peak == 3
    assert r["max_concurrent_requests"] <= 3
    with FakeServer(ttft=0.03, itl=0.01) as server:
        run(server, workload([f"p {i}" for i in range(10)], max_new_tokens=3))
        assert server.peak > 3  # uncapped at rate inf: (nearly) all at once


def test_request_rate_spaces_the_sends():
    with FakeServer(ttft=0.0, itl=0.0) as server:
        r = run(server, workload([f"p {i}" for i in range(10)], max_new_tokens=2), request_rates=[50.0],
                seed=3)["results"][0]
    expected = arrival_times(10, 50.0, seed=3)
    starts = sorted((q["index"], q["arrival_s"], q["start_s"]) for q in r["requests"])
    assert [a for _, a, _ in starts] == pytest.approx(expected)
    for _, arrival, start in starts:
        assert arrival - 0.002 <= start < arrival + 0.1
    assert r["duration"] >= 10 / 50.0 and r["request_rate"] == 50.0


def test_connections_are_reused_and_lingering_streams_succeed(monkeypatch):
    import conveyor.bench.serve_client as serve_client

    monkeypatch.setattr(serve_client, "_DRAIN_AFTER_DONE_S", 0.2)
    with FakeServer(ttft=0.0, itl=0.0) as server:
        r = run(server, workload([f"p {i}" for i in range(5)], max_new_tokens=2), max_concurrency=1)["results"][0]
        assert r["completed"] == 5 and len(server.connections) == 1  # the body is read to its end: keep-alive
        started = time.perf_counter()
        r = run(server, workload(["LINGER a", "LINGER b"], max_new_tokens=2))["results"][0]
        assert time.perf_counter() - started < 2.0
    assert r["completed"] == 2 and r["failed"] == 0


def test_api_urls():
    assert api_urls("http://127.0.0.1:8000/", "/v1/completions") == \
        ("http://127.0.0.1:8000/v1/completions", "http://127.0.0.1:8000/v1/models")
    assert api_urls("http://h:1/v1", "/v1/chat/completions")[0] == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError):
        api_urls("127.0.0.1:8000", "/v1/completions")


# -- command line ---------------------------------------------------------------------------------
def test_cli_sweep_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "sweep.png"
    with FakeServer(ttft=0.01, itl=0.005) as server:
        rc = main(["serve", "--base-url", server.url, "--synthetic-input-len", "6", "--synthetic-output-len", "4",
                   "--num-prompts", "6", "--request-rates", "40,inf", "--seed", "2", "--out", str(out),
                   "--plot", str(png), "--no-progress"])
        n_posts = len(server.bodies)
    assert rc == 0
    assert n_posts == 1 + 2 * 6  # the untimed test request, then both runs
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Request-rate sweep" in text and "P99 TTFT (ms):" in text
    report = json.loads(out.read_text())
    assert report["model_id"] == MODEL and report["config"]["request_rates"] == [40.0, "inf"]
    assert [r["request_rate"] for r in report["results"]] == [40.0, "inf"]
    assert all(r["completed"] == 6 and r["total_output_tokens"] == 24 for r in report["results"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_single_run_failure_exit_code_and_latency_plot(tmp_path, capsys):
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"name": "mini", "max_new_tokens": 3, "prompts": ["fine", "FAIL500 here", "fine too"]}))
    png = tmp_path / "lat.png"
    with FakeServer(ttft=0.0, itl=0.0) as server:
        rc = main(["serve", "--base-url", server.url + "/v1", "--workload", str(wl), "--endpoint", "/v1/completions",
                   "--max-concurrency", "2", "--plot", str(png), "--no-progress"])
        assert all("ignore_eos" not in b for b in server.bodies)
    assert rc == 1  # a request failed
    text = capsys.readouterr().out
    assert "Failed requests:                         1" in text and "HTTP 500" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_unreachable_server_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match="cannot reach"):
        main(["serve", "--base-url", f"http://127.0.0.1:{port}", "--synthetic-input-len", "2",
              "--synthetic-output-len", "2", "--num-prompts", "1", "--no-progress", "--request-timeout", "5"])
    with pytest.raises(SystemExit, match="not both"):
        main(["serve", "--base-url", "http://127.0.0.1:1", "--request-rate", "1", "--request-rates", "1,2",
              "--num-prompts", "1", "--synthetic-input-len", "1", "--synthetic-output-len", "1"])


def test_cli_reports_an_external_server_as_such(tmp_path, capsys):
    out = tmp_path / "serve.json"
    with FakeServer(ttft=0.0, itl=0.0) as server:
        assert main(["serve", "--base-url", server.url, "--synthetic-input-len", "2", "--synthetic-output-len", "2",
                     "--num-prompts", "1", "--no-progress", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["server"] == {"launched": False} and report["environment"]["cpu_flags"] == vector_flags()
    assert "Server: external, in its own dtype and weights; this machine's CPU flags" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--base-url", "http://127.0.0.1:1", "--dtype", "bfloat16"], "--dtype apply only with --launch"),
    (["--base-url", "http://127.0.0.1:1", "--quantization", "int8", "--launch-model", "m"],
     "--launch-model, --quantization apply only with --launch"),
    ([], "give --base-url of a running server, or --launch"),
    (["--launch", "--base-url", "http://127.0.0.1:1"], "--base-url or --launch, not both"),
    (["--launch", "--launch-args", "--num-blocks 64 --port=9"], r"drop \['--port=9'\]"),
])
def test_cli_launch_argument_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["serve", *argv, "--synthetic-input-len", "1", "--synthetic-output-len", "1", "--num-prompts", "1"])


def test_cli_launches_our_server_in_the_mode_asked_for(tiny_llama, tmp_path, capsys):
    """--launch starts `conveyor serve` as a subprocess with --dtype/--quantization and the engine options,
    reports what it resolved, and stops it (the port is free again afterwards)."""
    out = tmp_path / "serve.json"
    assert main(["serve", "--launch", "--launch-model", str(tiny_llama.path), "--quantization", "int8",
                 "--launch-args", "--num-blocks 64 --max-batch-tokens 32", "--endpoint", "/v1/completions",
                 "--synthetic-input-len", "3", "--synthetic-output-len", "2", "--num-prompts", "2", "--no-progress",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    server = report["server"]
    assert server["launched"] and server["quantization"] == "int8" and server["dtype"] in ("bfloat16", "float32")
    assert server["model_path"] == str(tiny_llama.path) and server["cpu_flags"] == vector_flags()
    assert server["command"][-4:] == ["--num-blocks", "64", "--max-batch-tokens", "32"]
    assert report["results"][0]["completed"] == 2 and report["results"][0]["total_output_tokens"] == 4
    assert f"Server: Conveyor launched for the run ({server['dtype']}, weights int8)" in capsys.readouterr().out
    port = int(server["base_url"].rsplit(":", 1)[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the server is gone


def test_a_launched_server_that_dies_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="exited with status"):
        main(["serve", "--launch", "--launch-model", str(tmp_path / "missing"), "--synthetic-input-len", "1",
              "--synthetic-output-len", "1", "--num-prompts", "1", "--no-progress"])


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_only(monkeypatch, capsys):
    with FakeServer(ttft=0.0, itl=0.001) as server:
        argv = ["serve", "--base-url", server.url, "--synthetic-input-len", "4", "--synthetic-output-len", "3",
                "--num-prompts", "4", "--no-test-request"]
        assert main(argv) == 0
        piped = capsys.readouterr().err
        assert "4/4" not in piped and "output tok/s" not in piped  # piped: no bar
        terminal = FakeTerminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(argv) == 0
        bar = terminal.getvalue()
        assert "4/4" in bar and re.search(r"\d+\.\d output tok/s", bar)
        monkeypatch.setattr(sys, "stderr", FakeTerminal())
        assert main(argv + ["--no-progress"]) == 0
        assert "output tok/s" not in sys.stderr.getvalue()
