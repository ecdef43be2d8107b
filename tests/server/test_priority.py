"""The `priority` field on every generating endpoint (vLLM's, with `--scheduling-policy priority`): a request
of priority 0 sent while one of priority 5 holds the only slot and one of priority 10 waits preempts the
running one and is answered first, the waiting one last; without priority scheduling a priority other than 0
is a 400 naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from conveyor import LLM
from conveyor.server import BackgroundServer

from tests.serving_helpers import long_tiny_llm, metric, save_long_tiny, settles
from tests.utils import all_free


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = long_tiny_llm(save_long_tiny(tmp_path_factory.mktemp("priority")), num_blocks=256, max_requests_per_batch=1,
                        scheduler_type="priority")
    yield llm
    llm.shutdown()


def test_the_urgent_request_is_answered_first(llm: LLM) -> None:
    async def scenario(url: str) -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async def send(name: str, path: str, body: dict) -> httpx.Response:
                answer = await http.post(path, json=body)
                done.append(name)
                return answer

            running = asyncio.create_task(send("running", "/v1/completions", {
                "prompt": "w5 w6", "max_tokens": 400, "ignore_eos": True, "priority": 5}))
            while metric((await http.get("/metrics")).text, "conveyor:num_requests_running") < 1:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(send("waiting", "/v1/completions", {
                "prompt": "w7", "max_tokens": 4, "ignore_eos": True, "priority": 10}))
            while metric((await http.get("/metrics")).text, "conveyor:num_requests_waiting") < 1:
                await asyncio.sleep(0.01)
            urgent = await send("urgent", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "w8"}], "max_tokens": 4, "priority": 0})
            answers = [urgent, await running, await waiting]
            answers += [await http.post("/v1/responses", json={"input": "w9", "max_output_tokens": 3, "priority": 2}),
                        await http.post("/v1/messages", json={"model": "", "max_tokens": 3, "priority": -1,
                                                               "messages": [{"role": "user", "content": "w9"}]})]
            assert [a.status_code for a in answers] == [200] * 5, [a.text for a in answers]
            metrics = (await http.get("/metrics")).text
        assert metric(metrics, "conveyor:num_preemptions_total") >= 1
        return done

    with BackgroundServer(llm) as url:
        assert asyncio.run(scenario(url)) == ["urgent", "running", "waiting"]
        schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]
    assert "maximum" not in schema["CompletionRequest"]["properties"]["priority"]  # any priority (below 2**63)
    settles(llm)


def test_priority_needs_priority_scheduling(tmp_path_factory: pytest.TempPathFactory) -> None:
    llm = long_tiny_llm(save_long_tiny(tmp_path_factory.mktemp("fcfs")), num_blocks=64)
    with BackgroundServer(llm) as url:
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 2, "priority": 3})
        zero = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 2, "priority": 0})
        schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]
    for body in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "MessagesRequest"):
        assert (schema[body]["properties"]["priority"]["minimum"], schema[body]["properties"]["priority"]["maximum"]) \
            == (0, 0), body  # the schema says what this server takes
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "needs priority scheduling" in refused.json()["error"]["message"] and zero.status_code == 200
    assert all_free(llm)
    llm.shutdown()
