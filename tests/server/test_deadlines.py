"""Deadlines on the server: `--request-timeout` (the default) and each request's `request_timeout` field. A
request still running past it ends its stream with an error event, one still waiting answers 504 (OpenAI's
error object, or Anthropic's `timeout_error` on /v1/messages, a failed response on /v1/responses); each is
counted as finish_reason "timeout" in /metrics, and every block comes back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from conveyor import LLM
from conveyor.server import BackgroundServer, ServerSettings

from tests.serving_helpers import long_tiny_llm, metric, save_long_tiny, serve_parser, settles


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = long_tiny_llm(save_long_tiny(tmp_path_factory.mktemp("deadlines")), num_blocks=256, max_requests_per_batch=1)
    yield llm
    llm.shutdown()


def test_request_timeout_flag() -> None:
    assert ServerSettings.from_args(serve_parser().parse_args(["--request-timeout", "2.5"])).request_timeout == 2.5
    assert ServerSettings.from_args(serve_parser().parse_args([])).request_timeout is None
    with pytest.raises(ValueError, match="--request-timeout must be a number of seconds > 0, got 0.0"):
        ServerSettings.from_args(serve_parser().parse_args(["--request-timeout", "0"]))


def test_requests_past_their_deadline(llm: LLM) -> None:
    """One slot (max_num_seqs 1): a long stream holds it until the server's 0.5 s default ends it; three
    requests sent meanwhile with request_timeout 0.05 s end while still waiting."""
    async def scenario(url: str) -> tuple[list[str], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            events: list[str] = []
            async with http.stream("POST", "/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2000,
                                                                    "ignore_eos": True, "stream": True}) as stream:
                lines = stream.aiter_lines()
                events.append(await anext(lines))  # the first token: it holds the only slot
                short = {"request_timeout": 0.05, "max_tokens": 5}
                waiting = asyncio.gather(
                    http.post("/v1/completions", json={"prompt": "w7"} | short),
                    http.post("/v1/messages", json={"model": "", "messages": [{"role": "user", "content": "w7"}]} | short),
                    http.post("/v1/responses", json={"input": "w7", "request_timeout": 0.05, "max_output_tokens": 5}))
                events += [line async for line in lines]
                return [e for e in events if e], await waiting

    with BackgroundServer(llm, ServerSettings(request_timeout=0.5)) as url:
        events, (completion, message, response) = asyncio.run(scenario(url))
        metrics = httpx.get(f"{url}/metrics").text
    assert events[-1] == "data: [DONE]" and events[0].startswith("data: {") and '"text":' in events[0]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("request_timeout", "server_error")
    assert error["message"].startswith("the request did not finish within its request_timeout of 0.5 s (running, ")
    assert completion.status_code == 504 and completion.json()["error"]["code"] == "request_timeout"
    assert "request_timeout of 0.05 s (waiting in the queue for" in completion.json()["error"]["message"]
    assert message.status_code == 504 and message.json()["error"]["type"] == "timeout_error", message.text
    assert response.status_code == 504 and "request_timeout of 0.05 s" in response.json()["error"]["message"]
    assert metric(metrics, "conveyor:request_success_total", finish_reason="timeout") == 4
    settles(llm)
