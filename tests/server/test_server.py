"""The OpenAI-compatible server: a real uvicorn server on loopback over a tiny random Llama (in a
thread, and once as a `conveyor serve` subprocess), plus one end-to-end run on the built-in model."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.scaleout.net import free_port
from conveyor.server import BackgroundServer, ServerSettings

from tests.serving_helpers import CHAT_TEMPLATE, metric, wait_healthy
from tests.utils import TinyModel, greedy, random_prompts

KEY = "sk-test"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (context 512) whose word-level tokenizer has a simple chat template."""
    path = tmp_path_factory.mktemp("server_tiny")
    TinyModel("llama", path)
    config_file = path / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def cli_server(tiny_dir: Path):
    """`conveyor serve MODEL` (vLLM's form) in a subprocess (max queue 3), started early so it loads while
    other tests run; yields the process, its URL and its log file. fp32: the queue test compares the texts of
    requests that join the batch at different steps, which only the exact path keeps identical."""
    port = free_port()
    log = tiny_dir / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", str(tiny_dir), "--port",
                                 str(port), "--max-queue", "3", "--num-blocks", "256", "--shutdown-timeout", "10",
                                 "--dtype", "float32", "--enable-tokenizer-info-endpoint"],
                                stdout=out, stderr=subprocess.STDOUT)
    yield proc, f"http://127.0.0.1:{port}", log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir: Path, cli_server) -> LLM:  # cli_server: start the subprocess first
    """fp32: these tests compare outputs across batch compositions, which only the exact path keeps identical."""
    return LLM(tiny_dir, dtype="float32", config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=256))


@pytest.fixture(scope="module")
def url(tiny_llm: LLM):
    with BackgroundServer(tiny_llm, ServerSettings(served_model_names=["tiny", "tiny-alias"], api_key=KEY)) as url:
        yield url


@pytest.fixture()
def http(url: str):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


# -- 1. the official client -----------------------------------------------------------------------
def test_openai_client_matches_llm_generate(url: str, tiny_llm: LLM) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    prompts = [words(p) for p in random_prompts([5, 17], seed=1)]
    expected = tiny_llm.generate(prompts, greedy(12, ignore_eos=False), use_tqdm=False)

    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [e.text for e in expected]
    assert batch.model == "tiny"
    assert batch.usage.prompt_tokens == sum(e.num_prompt_tokens for e in expected)
    assert batch.usage.completion_tokens == sum(e.num_output_tokens for e in expected)
    assert {c.finish_reason for c in batch.choices} == {e.finish_reason for e in expected}

    stream = client.completions.create(model="tiny-alias", prompt=prompts[1], max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[1].text
    assert chunks[-1].usage.completion_tokens == expected[1].num_output_tokens and not chunks[-1].choices

    conversation = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w12 w13 w14"}]
    [reply] = tiny_llm.chat([conversation], greedy(9, ignore_eos=False), use_tqdm=False)
    chat = client.chat.completions.create(model="tiny", messages=conversation, max_completion_tokens=9,
                                          temperature=0, logprobs=True, top_logprobs=3)
    assert chat.choices[0].message.content == reply.text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == reply.num_prompt_tokens and chat.usage.completion_tokens == 9
    content = chat.choices[0].logprobs.content
    assert len(content) == 9 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].logprob == pytest.approx(max(t.logprob for t in content[0].top_logprobs))  # greedy

    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model="tiny", messages=conversation, max_tokens=9, temperature=0, stream=True)]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == reply.text

    # n choices with a seed: choice i is the request with seed + i.
    seeded = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=6, n=2, seed=7, temperature=1.0)
    singles = [client.completions.create(model="tiny", prompt=prompts[0], max_tokens=6, seed=s).choices[0].text
               for s in (7, 8)]
    assert [c.text for c in sorted(seeded.choices, key=lambda c: c.index)] == singles


def test_completion_prompt_logprobs_as_vllm(http: httpx.Client, tiny_llm: LLM) -> None:
    prompt = random_prompts([9], seed=2)[0]
    [expected] = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=2),
                                   use_tqdm=False)
    body = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                              "prompt_logprobs": 2}).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for token, entry, ours in zip(prompt[1:], entries[1:], expected.prompt_logprobs[1:]):
        assert {int(t): e["logprob"] for t, e in entry.items()} == pytest.approx(ours)
        assert [e["rank"] for e in entry.values()] == [v.rank for v in ours.values()]  # the prompt token's too
        assert [e["rank"] for e in entry.values()][:2] == [1, 2] and entry[str(token)]["decoded_token"] == f"w{token}"
    plain = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    conversation = [{"role": "user", "content": words(prompt)}]
    rendered = tiny_llm.render_chat(conversation)
    [chat_expected] = tiny_llm.generate([rendered], SamplingParams(max_new_tokens=1, prompt_logprobs=0),
                                        use_tqdm=False)
    chat = http.post("/v1/chat/completions", json={"messages": conversation, "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == len(rendered) and chat["prompt_logprobs"][0] is None
    assert [e[str(t)]["logprob"] for t, e in zip(rendered[1:], chat["prompt_logprobs"][1:])] == pytest.approx(
        [e[t] for t, e in zip(rendered[1:], chat_expected.prompt_logprobs[1:])], abs=1e-5)
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
        response = http.post("/v1/completions", json={"prompt": prompt} | bad)
        assert response.status_code == 400 and "prompt_logprobs" in response.text


@pytest.mark.slow
def test_completion_echo_as_lm_evaluation_harness_reads_it(url: str, http: httpx.Client, tiny_llm: LLM) -> None:
    """echo puts the prompt before the text and its tokens' logprobs before the reply's (the first null);
    with max_tokens 0, the prompt alone. lm-evaluation-harness scores a continuation by summing
    `token_logprobs[ctxlen:-1]` of {echo, logprobs 1, max_tokens 1}."""
    context, continuation = random_prompts([6, 4], seed=3)
    prompt = context + continuation
    [offline] = tiny_llm.generate([prompt], greedy(3, prompt_logprobs=1, logprobs=1), use_tqdm=False)
    expected_lps = [None] + [entry[t] for t, entry in zip(prompt[1:], offline.prompt_logprobs[1:])]

    scored = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                                "echo": True}).json()["choices"][0]
    token_lps = scored["logprobs"]["token_logprobs"]
    assert len(token_lps) == len(prompt) + 1 and token_lps[0] is None and scored["logprobs"]["top_logprobs"][0] is None
    assert sum(token_lps[len(context):-1]) == pytest.approx(sum(expected_lps[len(context):]), abs=1e-5)
    reply = scored["text"].removeprefix(words(prompt))
    assert reply != scored["text"] and reply and offline.text.startswith(reply)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    alone = client.completions.create(model="tiny", prompt=words(prompt), max_tokens=0, echo=True, logprobs=2)
    choice = alone.choices[0]
    assert choice.text == words(prompt) and choice.logprobs.tokens == [f"w{t}" for t in prompt]
    assert choice.logprobs.token_logprobs == pytest.approx(expected_lps, abs=1e-5)
    assert all(len(top) == 2 and max(top.values()) >= lp
               for top, lp in zip(choice.logprobs.top_logprobs[1:], expected_lps[1:]))
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == len(prompt)

    both = client.completions.create(model="tiny", prompt=words(prompt), max_tokens=3, echo=True, logprobs=1,
                                     temperature=0, n=2)
    for choice in both.choices:
        assert choice.text == words(prompt) + offline.text
        assert choice.logprobs.token_logprobs[len(prompt):] == pytest.approx(
            [lp[t] for t, lp in zip(offline.token_ids, offline.logprobs)], abs=1e-5)
    assert both.usage.completion_tokens == 6

    chunks = list(client.completions.create(model="tiny", prompt=words(prompt), max_tokens=3, echo=True, logprobs=1,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(words(prompt)) and "".join(texts) == words(prompt) + offline.text
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == len(prompt) + 3
    assert chunks[-1].usage.completion_tokens == 3
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == words(prompt)
    assert chunks[-1].usage.completion_tokens == 0

    refused = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_vllm_request_fields_over_http(http: httpx.Client, tiny_llm: LLM) -> None:
    """vLLM's extra fields: include_stop_str_in_output, allowed_token_ids, bad_words, return_token_ids,
    return_tokens_as_token_ids and cache_salt, on both endpoints; stop_reason names the
    stop; the fields Conveyor lacks (right truncation) are a 400 when set."""
    prompt = random_prompts([7], seed=5)[0]
    [free] = tiny_llm.generate([prompt], greedy(8), use_tqdm=False)
    stop = free.text.split()[3]
    base = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    kept = http.post("/v1/completions", json=base | {"stop": [stop], "include_stop_str_in_output": True,
                                                      "return_token_ids": True}).json()["choices"][0]
    assert kept["text"] == free.text[:free.text.index(stop) + len(stop)] and kept["stop_reason"] == stop
    assert kept["prompt_token_ids"] == prompt and kept["token_ids"] == free.token_ids[:4]
    allowed = [5, 6, 7]
    restricted = http.post("/v1/completions", json=base | {"allowed_token_ids": allowed, "bad_words": ["w6"],
                                                           "logprobs": 1, "return_tokens_as_token_ids": True}).json()
    tokens = restricted["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and {int(t.removeprefix("token_id:")) for t in tokens} <= {5, 7}
    chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json=base | {
        "stream": True, "return_token_ids": True}).iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert sum((c["choices"][0]["token_ids"] for c in chunks if c["choices"]), []) == free.token_ids
    continuous = [json.loads(line[6:]) for line in http.post("/v1/completions", json=base | {
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).iter_lines()
        if line.startswith("data: {")]
    sent = [c["usage"]["completion_tokens"] for c in continuous]  # vLLM's: the usage so far in every chunk
    assert sent == sorted(sent) and sent[0] >= 1 and sent[-1] == 8 and len(sent) > 2
    assert all(c["usage"]["prompt_tokens"] == len(prompt) for c in continuous)

    conversation = [{"role": "user", "content": "w12 w13"}]
    chat = http.post("/v1/chat/completions", json={"messages": conversation, "max_tokens": 4, "temperature": 0,
                                                   "return_token_ids": True, "ignore_eos": True}).json()
    assert chat["prompt_token_ids"] == tiny_llm.render_chat(conversation)
    assert len(chat["choices"][0]["token_ids"]) == 4 and chat["choices"][0]["stop_reason"] is None
    rag = "{% for d in documents %}[{{ d.title }}: {{ d.text }}] {% endfor %}" + CHAT_TEMPLATE
    text = tiny_llm.render_chat_text(conversation, chat_template=rag, documents=[{"title": "w7", "text": "w8 w9"}])
    assert text.startswith("[w7: w8 w9] ")  # vLLM's documents, for templates that read them
    assert http.post("/v1/chat/completions", json={"messages": conversation, "max_tokens": 1,
                                                   "documents": [{"text": "w8"}]}).status_code == 200
    salted = http.post("/v1/completions", json=base | {"max_tokens": 2, "cache_salt": "tenant"})
    assert salted.status_code == 200
    refused = http.post("/v1/completions", json=base | {"truncation_side": "right"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncation_side"
    assert http.post("/v1/completions", json=base | {"use_beam_search": False, "max_tokens": 1}).status_code == 200


def test_builtin_model_with_openai_client() -> None:
    llm = LLM(config=ContinuousBatchingConfig(num_blocks=256))
    with BackgroundServer(llm) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        [model] = client.models.list().data
        assert model.id == llm.model_path.name
        prompt = "The capital of France is"
        [ref] = llm.generate([prompt], greedy(8, ignore_eos=False), use_tqdm=False)
        out = client.completions.create(model=model.id, prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == ref.text and out.usage.completion_tokens == ref.num_output_tokens
        messages = [{"role": "user", "content": "Write one sentence about the moon."}]
        [reply] = llm.chat([messages], greedy(12, ignore_eos=False), use_tqdm=False)
        chat = client.chat.completions.create(model=model.id, messages=messages, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content == reply.text
        assert chat.choices[0].finish_reason == reply.finish_reason
        stream = client.chat.completions.create(model=model.id, messages=messages, max_tokens=12, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.text


# -- 2. concurrency --------------------------------------------------------------------------------
def test_32_concurrent_streams_match_non_streamed(url: str, http: httpx.Client) -> None:
    prompts = random_prompts([3 + 7 * i % 40 for i in range(32)], seed=2)
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0}

    async def stream_one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[str, str | None]:
        text, finish = [], None
        async with client.stream("POST", "/v1/completions", json=body | {"prompt": prompt, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
        return "".join(text), finish

    async def main() -> list[tuple[str, str | None]]:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            return await asyncio.gather(*(stream_one(c, p) for p in prompts))

    streamed = asyncio.run(main())
    whole = http.post("/v1/completions", json=body | {"prompt": prompts}).json()
    choices = sorted(whole["choices"], key=lambda c: c["index"])
    assert [(c["text"], c["finish_reason"]) for c in choices] == streamed


# -- 3. disconnects --------------------------------------------------------------------------------
def test_dropped_clients_are_cancelled_and_free_their_cache(url: str, http: httpx.Client) -> None:
    before = http.get("/metrics").text
    idle_usage = metric(before, "conveyor:kv_cache_usage_perc")
    aborted = metric(before, "conveyor:request_success_total", finish_reason="abort")
    long = {"model": "tiny", "max_tokens": 480, "ignore_eos": True, "temperature": 0}

    assert http.get("/load").json() == {"server_load": 0}
    with http.stream("POST", "/v1/completions", json=long | {"prompt": "w7 w8", "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert http.get("/load").json() == {"server_load": 1}  # vLLM's, for load-aware routers
    # A non-streaming client that gives up once its request runs: it is cancelled too.
    payload = json.dumps(long | {"prompt": "w9 w10"}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 10
        while metric(http.get("/metrics").text, "conveyor:num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    deadline = time.monotonic() + 10
    while True:
        text = http.get("/metrics").text
        if (metric(text, "conveyor:request_success_total", finish_reason="abort") == aborted + 2
                and metric(text, "conveyor:kv_cache_usage_perc") == idle_usage
                and metric(text, "conveyor:num_requests_running") == 0):
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    # Both stopped well before their 480 tokens.
    assert metric(text, "conveyor:generation_tokens_total") - metric(before, "conveyor:generation_tokens_total") < 900
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert metric(text, f"conveyor:{name}_count") > 0, name
    for name in ("num_requests_waiting", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total"):
        assert re.search(rf"^conveyor:{name}\{{", text, re.M), name
    assert metric(text, "conveyor:request_success_total", finish_reason="length") > 0


# -- 4. bad input ----------------------------------------------------------------------------------
def test_bad_requests_get_openai_errors(url: str, http: httpx.Client) -> None:
    def error(response: httpx.Response, status: int) -> dict:
        assert response.status_code == status, response.text
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err

    long = words([5] * 600)
    err = error(http.post("/v1/completions", json={"prompt": long, "max_tokens": 8}), 400)
    assert "600" in err["message"] and "512" in err["message"] and err["code"] == "context_length_exceeded"
    err = error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}), 400)
    assert "60" in err["message"] and "512" in err["message"]
    assert "temperature" in error(http.post("/v1/completions", json={"prompt": "w5", "temperature": -1}),
                                  400)["message"]
    assert "messages" in error(http.post("/v1/chat/completions", json={"messages": []}), 400)["message"]
    error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}],
                                                  "top_logprobs": 2}), 400)
    error(http.post("/v1/completions", json={"prompt": [5, 999999]}), 400)
    assert error(httpx.post(f"{url}/v1/completions", json={"prompt": "w5"}), 401)["code"] == "invalid_api_key"
    error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{url}/health").status_code == 200  # health stays open
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/version").json() == {"version": importlib.metadata.version("conveyor")}
    assert error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "w5"}), 404)["param"] == "model"
    assert error(http.post("/v1/completions", json={"prompt": 5}), 400)["param"] == "prompt"
    assert "JSON" in error(http.post("/v1/completions", content=b"{not json",
                                     headers={"Content-Type": "application/json"}), 400)["message"]
    error(http.post("/v1/completions", json={"max_tokens": 3}), 400)  # no prompt

    ok = http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                             "total_tokens": 5}
    tokens = http.post("/tokenize", json={"prompt": "w5 w6"}).json()
    assert tokens == {"count": 2, "max_model_len": 512, "tokens": [5, 6], "token_strs": None}
    chat_tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": "w7"}]}).json()["tokens"]
    assert chat_tokens == [3, 7, 4, 5]
    assert http.post("/detokenize", json={"tokens": [5, 6]}).json() == {"prompt": "w5 w6"}
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "tiny-alias"]
    assert http.get("/v1/models/tiny-alias").json() == http.get("/v1/models").json()["data"][1]  # models.retrieve
    assert error(http.get("/v1/models/"), 404)["code"] == "model_not_found"  # an empty name too
    missing = error(http.get("/v1/models/org/other"), 404)
    assert missing["code"] == "model_not_found" and "Served: tiny, tiny-alias" in missing["message"]
    off = error(http.get("/tokenizer_info"), 404)  # vLLM's endpoint is off unless asked for
    assert "--enable-tokenizer-info-endpoint" in off["message"]


def test_engine_failure_is_a_500_or_a_stream_error_event(http: httpx.Client, tiny_llm: LLM,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(chunks: object) -> None:
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(tiny_llm.engine.runner, "execute", broken)
    body = {"prompt": "w5 w6", "max_tokens": 4}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 500 and "simulated device failure" in r.json()["error"]["message"]
    with http.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}],
                                                          "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert http.post("/v1/completions", json=body).status_code == 200


# -- 5, 6. the CLI server: bounded queue, graceful SIGTERM ------------------------------------------
def test_max_queue_rejects_with_503_and_loses_nothing(cli_server) -> None:
    proc, url, log = cli_server
    wait_healthy(proc, url, log)
    body = {"prompt": "w5 w6 w7", "max_tokens": 48, "ignore_eos": True, "temperature": 0}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(10)))

    responses = asyncio.run(main())
    accepted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code != 200]
    assert len(accepted) >= 3 and rejected
    for r in rejected:
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in accepted)
    assert len({r.json()["choices"][0]["text"] for r in accepted}) == 1
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200  # room again
    info = httpx.get(f"{url}/tokenizer_info").json()  # --enable-tokenizer-info-endpoint
    assert info["eos_token"] and info["chat_template"] == CHAT_TEMPLATE and "tokenizer_class" in info
    assert not {"vocab_file", "name_or_path"} & set(info)


def test_sigterm_drains_in_flight_requests_and_exits_0(cli_server) -> None:
    proc, url, log = cli_server
    wait_healthy(proc, url, log)
    body = {"prompt": "w5", "max_tokens": 200, "ignore_eos": True, "stream": True}
    choices, events = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if not events:  # the stream is running: SIGTERM, then new requests get 503 while it finishes
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                while httpx.get(f"{url}/health").status_code == 200:
                    assert time.monotonic() - signalled < 5
                refused = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 2})
                assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
                assert refused.json()["error"]["code"] == "server_shutting_down"
            events.append(line)
            if line != "data: [DONE]":
                choices.append(json.loads(line[6:])["choices"][0])
    assert events[-1] == "data: [DONE]" and choices[-1]["finish_reason"] == "length"
    assert proc.wait(timeout=15) == 0
    text = log.read_text()
    assert "KV cache capacity 4096 tokens" in text and "shutting down" in text
    assert "reasoning: not split from the answer (--reasoning-parser)" in text
