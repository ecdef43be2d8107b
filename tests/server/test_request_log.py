"""The request log (`--enable-log-requests`): one line per engine request when it ends, with its id, prompt
length, parameters, outcome and timings, the prompt only with `--log-prompts`; `--log-format json` lines
that parse (in process, and from a `conveyor serve` subprocess with `--disable-uvicorn-access-log`)."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conveyor import LLM
from conveyor.scaleout.net import free_port
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.log_format import JSONFormatter, uvicorn_logging

from tests.serving_helpers import metric, serve_parser, wait_healthy
from tests.utils import TinyModel, all_free


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel) -> Iterator[LLM]:
    llm = tiny_llama.llm(num_blocks=64)
    yield llm
    llm.shutdown()


@pytest.fixture
def request_lines() -> Iterator[io.StringIO]:
    """What the request log writes, one JSON object per line."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JSONFormatter())
    logger = logging.getLogger("conveyor.server.requests")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(level)


def complete(url: str, **body: object) -> httpx.Response:
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "w5 w6 w7"} | body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer


def test_each_request_is_one_line_with_its_outcome_and_timings(llm: LLM, request_lines: io.StringIO) -> None:
    settings = ServerSettings(enable_log_requests=True, log_prompts=True, max_log_len=5)
    with BackgroundServer(llm, settings) as url:
        rid = complete(url, max_tokens=4, n=2, temperature=0.5, seed=3, ignore_eos=True).json()["id"]
        complete(url, prompt=[5, 6, 7, 8, 9, 10, 11], max_tokens=2, ignore_eos=True)
    lines = [json.loads(line) for line in request_lines.getvalue().splitlines()]
    assert sorted(e["request_id"] for e in lines[:2]) == [f"{rid}-0", f"{rid}-1"]
    first = next(e for e in lines if e["request_id"] == f"{rid}-1")
    assert (first["event"], first["level"], first["logger"]) == ("request", "INFO", "conveyor.server.requests")
    assert (first["prompt_tokens"], first["output_tokens"], first["finish_reason"]) == (3, 4, "length")
    assert first["params"] == {"max_new_tokens": 4, "temperature": 0.5, "seed": 4, "ignore_eos": True}
    assert first["prompt"] == "w5 w6 w7"  # the server's prompts are token ids: decoded
    assert 0 <= first["queue_time_s"] <= first["ttft_s"] <= first["e2e_s"] < 60
    assert first["message"].startswith(f"request {rid}-1 ended: length, 4 tokens out; prompt 3 tokens; params ")
    assert lines[2]["prompt"] == "w5 w6 w7 w8 w9"  # --max-log-len 5: the first 5 of 7 ids
    assert len(lines) == 3 and all_free(llm)


def test_prompts_only_with_log_prompts_and_nothing_when_off(llm: LLM, request_lines: io.StringIO) -> None:
    with BackgroundServer(llm, ServerSettings(enable_log_requests=True)) as url:
        complete(url, max_tokens=2)
    with BackgroundServer(llm) as url:
        complete(url, max_tokens=2)
    [line] = [json.loads(line) for line in request_lines.getvalue().splitlines()]
    assert "prompt" not in line and line["prompt_tokens"] == 3
    with pytest.raises(ValueError, match="--log-prompts takes effect only with --enable-log-requests"):
        ServerSettings.from_args(serve_parser().parse_args(["--log-prompts"]))
    with pytest.raises(ValueError, match="--enable-log-outputs takes effect only with --enable-log-requests"):
        ServerSettings.from_args(serve_parser().parse_args(["--enable-log-outputs"]))
    assert all_free(llm)


def test_outputs_with_enable_log_outputs_cut_to_max_log_len(llm: LLM, request_lines: io.StringIO) -> None:
    settings = ServerSettings.from_args(serve_parser().parse_args(["--enable-log-requests", "--enable-log-outputs"]))
    with BackgroundServer(llm, settings) as url:
        text = complete(url, max_tokens=4, ignore_eos=True).json()["choices"][0]["text"]
    with BackgroundServer(llm, ServerSettings(enable_log_requests=True, enable_log_outputs=True, max_log_len=3)) as url:
        complete(url, max_tokens=4, ignore_eos=True)
    whole, cut = [json.loads(line) for line in request_lines.getvalue().splitlines()]
    assert whole["output"] == text and len(cut["output"]) == 3 and "prompt" not in whole
    assert all_free(llm)


def test_uvicorn_lines_in_json_and_without_the_access_log() -> None:
    args = serve_parser().parse_args(["--log-format", "json", "--disable-uvicorn-access-log"])
    settings = ServerSettings.from_args(args)
    config = uvicorn_logging(settings.log_format, not settings.disable_uvicorn_access_log)
    assert config["access_log"] is False
    assert {f["()"] for f in config["log_config"]["formatters"].values()} == {"conveyor.server.log_format.JSONFormatter"}
    assert "JSONFormatter" not in json.dumps(uvicorn_logging("text", True))
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "POST", "/v1/completions", "1.1", 200), None)
    entry = json.loads(JSONFormatter().format(record))
    assert entry["message"] == '127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200'
    assert (entry["method"], entry["path"], entry["status"]) == ("POST", "/v1/completions", 200)


def test_conveyor_serve_logs_json_lines(tiny_llama: TinyModel, tmp_path: Path) -> None:
    """Every line `conveyor serve --log-format json` writes parses (the model's loading, uvicorn's start, the
    request log), and with --disable-uvicorn-access-log there is no access line."""
    port, log = free_port(), tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", str(tiny_llama.path), "--port",
                                 str(port), "--num-blocks", "64", "--dtype", "float32", "--log-format", "json",
                                 "--enable-log-requests", "--disable-uvicorn-access-log"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        rid = complete(url, max_tokens=3, ignore_eos=True).json()["id"]  # sampled: an EOS would end it early
        deadline = time.monotonic() + 10
        while metric(httpx.get(f"{url}/metrics").text, "conveyor:kv_cache_usage_perc") > 0:  # every block back
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert any(e["logger"] == "conveyor" and "loaded" in e["message"] for e in lines)
    assert any(e["logger"] == "uvicorn.error" for e in lines)
    [request] = [e for e in lines if e.get("event") == "request"]
    assert (request["request_id"], request["output_tokens"]) == (f"{rid}-0", 3)
    assert not [e for e in lines if e["logger"] == "uvicorn.access"]
