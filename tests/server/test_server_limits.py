"""The front never stalls: request bodies over the limit are 413s before they are parsed, prompts too long
to fit the context are 400s before they are tokenized, tokenizing and templates run off the event loop,
and /health answers within a second while several 20 MB prompts are being refused."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.limits import default_max_request_bytes, prompt_char_limit

from tests.serving_helpers import save_json_tiny
from tests.utils import tiny_tokenizer

BIG = 20 * 10**6


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = save_json_tiny(tmp_path_factory.mktemp("json_tiny"))
    return LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=256))


def health_while(url: str, work: list[threading.Thread]) -> list[float]:
    """/health latencies, polled every 50 ms while `work` runs (at least once: a fast 413 can beat the
    first poll)."""
    for thread in work:
        thread.start()
    latencies = []
    with httpx.Client(timeout=30) as client:
        while True:
            started = time.monotonic()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.monotonic() - started)
            if not any(t.is_alive() for t in work):
                break
            time.sleep(0.05)
    for thread in work:
        thread.join()
    return latencies


def big_requests(url: str, answers: list[httpx.Response]) -> list[threading.Thread]:
    """Two chat and two completion requests with 20 MB prompts, each on its own thread."""
    text = "the weather in Lima " * (BIG // 20)
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
              ("/v1/completions", {"prompt": text, "max_tokens": 4})] * 2

    def send(path: str, body: dict) -> None:
        answers.append(httpx.post(url + path, content=json.dumps(body).encode(), timeout=120,
                                  headers={"content-type": "application/json"}))

    return [threading.Thread(target=send, args=b) for b in bodies]


def served(llm: LLM, **settings: object) -> Iterator[str]:
    with BackgroundServer(llm, ServerSettings(**settings)) as url:
        yield url


@pytest.mark.parametrize("limit, status, words", [(None, 413, "--max-request-bytes"),
                                                  (64 * 2**20, 400, "characters")])
def test_health_answers_while_20mb_prompts_are_refused(llm: LLM, limit: int | None, status: int,
                                                       words: str) -> None:
    """By default the bodies are over the limit (413, unread); raised, they are read and the prompts refused
    by their length (400, untokenized). Either way /health answers within a second and work goes on."""
    for url in served(llm, max_request_bytes=limit):
        answers: list[httpx.Response] = []
        small: list[httpx.Response] = []
        work = big_requests(url, answers) + [threading.Thread(target=lambda: small.append(httpx.post(
            f"{url}/v1/completions", json={"prompt": "Lima", "max_tokens": 3, "ignore_eos": True}, timeout=60)))]
        latencies = health_while(url, work)
        assert latencies and max(latencies) < 1.0, latencies
        assert [a.status_code for a in answers] == [status] * 4
        assert all(words in a.json()["error"]["message"] for a in answers), answers[0].text
        assert small[0].status_code == 200 and small[0].json()["usage"]["completion_tokens"] == 3


def test_no_prompt_that_fits_is_refused_by_its_length(llm: LLM) -> None:
    """A prompt of the longest token repeated just under the context passes the length check and runs; one
    character past the bound is refused without tokenizing."""
    tokenizer = llm.tokenizer
    limit = prompt_char_limit(tokenizer, llm.max_model_len)
    assert limit is not None
    strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    words = [i for i, s in enumerate(strings) if s.startswith("Ġ") and s[1:].isalpha()]  # " word": one token
    piece = tokenizer.decode([max(words, key=lambda i: len(strings[i]))])
    fits = piece * (llm.max_model_len - 8)
    assert len(tokenizer.encode(fits)) <= llm.max_model_len - 8 and len(fits) <= limit
    for url in served(llm):
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": fits, "max_tokens": 1}, timeout=60)
        assert ok.status_code == 200, ok.text
        over = httpx.post(f"{url}/v1/completions", json={"prompt": "a" * (limit + 1), "max_tokens": 1}, timeout=60)
        assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
        assert "characters" in over.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(llm: LLM) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"a" * 2**16
        yield b'"}'

    for url in served(llm, max_request_bytes=2**20):
        json_body = {"content-type": "application/json"}
        reply = httpx.post(f"{url}/v1/completions", content=chunks(), headers=json_body, timeout=60)  # chunked
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
        small = httpx.post(f"{url}/v1/completions", content=iter([b'{"prompt": "Lima", "max_tokens": 2}']),
                           headers=json_body, timeout=60)
        assert small.status_code == 200, small.text


def test_limits_follow_the_context_and_the_tokenizer() -> None:
    assert default_max_request_bytes(2048) == 16 * 2**20 and default_max_request_bytes(2**17) == 256 * 2**17
    assert prompt_char_limit(tiny_tokenizer(), 512) is None  # word-level, whitespace dropped: no bound


def test_truncate_prompt_tokens_keeps_the_tail(llm: LLM) -> None:
    """vLLM's `truncate_prompt_tokens` on both endpoints: an over-long prompt keeps its last N tokens (chat:
    of the rendered conversation) instead of a 400, -1 keeps what fits beside max_tokens, even a text over
    the character bound is taken (its tail is what counts); without it the prompt is still refused."""
    tokenizer = llm.get_tokenizer()
    text = " ".join(["the weather in Lima"] * (llm.max_model_len // 2))
    tail = tokenizer.encode(text)[-20:]
    for url in served(llm):
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 4}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        kept = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 4, "temperature": 0,
                                                          "truncate_prompt_tokens": 20}, timeout=60).json()
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": tail, "max_tokens": 4, "temperature": 0},
                           timeout=60).json()
        assert kept["usage"]["prompt_tokens"] == 20 and kept["choices"][0]["text"] == plain["choices"][0]["text"]
        fit = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 4, "truncate_prompt_tokens": -1},
                         timeout=60).json()
        assert fit["usage"]["prompt_tokens"] == llm.max_model_len - 4
        huge = httpx.post(f"{url}/v1/completions", json={"prompt": "a" * (prompt_char_limit(
            tokenizer, llm.max_model_len) + 1), "max_tokens": 2, "truncate_prompt_tokens": 8}, timeout=60)
        assert huge.status_code == 200 and huge.json()["usage"]["prompt_tokens"] == 8
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": text}], "max_tokens": 4, "truncate_prompt_tokens": -1}, timeout=60)
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == llm.max_model_len - 4
        no_room = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": text}], "truncate_prompt_tokens": -1}, timeout=60)
        assert no_room.status_code == 400 and "give max_tokens" in no_room.json()["error"]["message"]
        for bad in (-2, 0):
            answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "truncate_prompt_tokens": bad}, timeout=60)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "truncate_prompt_tokens", answer.text
