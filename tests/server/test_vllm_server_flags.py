"""vLLM's server flags a copied `vllm serve` command line carries: --return-tokens-as-token-ids,
--enable-force-include-usage, --enable-prompt-tokens-details, --response-role, --root-path,
--disable-fastapi-docs, --enable-request-id-headers (and the engine's --async-scheduling), --uds,
--disable-access-log-for-endpoints, and those taken without effect or refused with what to do."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from conveyor import LLM
from conveyor.cli_args import config_from_args
from conveyor.server import BackgroundServer, ServerSettings, build_app

from tests.serving_helpers import CHAT_TEMPLATE, serve_parser
from tests.utils import TinyModel, idle, random_prompts

FLAGS = ["--return-tokens-as-token-ids", "--enable-force-include-usage", "--enable-prompt-tokens-details",
         "--response-role", "bot", "--root-path", "/llm", "--enable-request-id-headers", "--async-scheduling",
         "--max-logprobs", "3"]


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = tiny_llama.llm(page_size=4, num_blocks=128, allow_block_sharing=True)
    llm.tokenizer.chat_template = CHAT_TEMPLATE
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def http(llm: LLM) -> Iterator[httpx.Client]:
    settings = ServerSettings.from_args(serve_parser().parse_args(FLAGS))
    with BackgroundServer(llm, settings) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def test_the_flags_parse_into_settings_and_config() -> None:
    args = serve_parser().parse_args(FLAGS)
    settings = ServerSettings.from_args(args)
    assert (settings.return_tokens_as_token_ids, settings.enable_force_include_usage,
            settings.enable_prompt_tokens_details, settings.enable_request_id_headers) == (True,) * 4
    assert (settings.response_role, settings.root_path, settings.max_logprobs) == ("bot", "/llm", 3)
    with pytest.raises(ValueError, match="--max-logprobs"):
        ServerSettings.from_args(serve_parser().parse_args(["--max-logprobs", "-2"]))
    ServerSettings.from_args(serve_parser().parse_args(["--chat-template-content-format", "string"]))
    with pytest.raises(ValueError, match="joined into one string"):
        ServerSettings.from_args(serve_parser().parse_args(["--chat-template-content-format", "openai"]))
    assert config_from_args(args).use_async_batching is True
    assert config_from_args(serve_parser().parse_args([])).use_async_batching is None


def test_usage_tokens_and_roles_as_the_flags_say(http: httpx.Client, llm: LLM) -> None:
    prompt = random_prompts([20], seed=40)[0]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    first = http.post("/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(t.startswith("token_id:") for t in first["choices"][0]["logprobs"]["tokens"])
    again = http.post("/v1/completions", json=body | {"return_tokens_as_token_ids": False}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # four full pages of 4 cached
    assert not any(t.startswith("token_id:") for t in again["choices"][0]["logprobs"]["tokens"])
    lines = [line for line in http.post("/v1/completions", json=body | {"stream": True}).iter_lines()
             if line.startswith("data: {")]
    assert json.loads(lines[-1][6:])["usage"]["completion_tokens"] == 3  # usage though the stream did not ask
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5 w6"}],
                                                   "max_tokens": 2}).json()
    assert chat["choices"][0]["message"]["role"] == "bot"
    chat_body = {"messages": [{"role": "user", "content": "w5"}], "logprobs": True}
    for url, request, field in (("/v1/completions", body, "logprobs"), ("/v1/completions", body, "prompt_logprobs"),
                                ("/v1/chat/completions", chat_body, "top_logprobs")):
        refused = http.post(url, json=request | {field: 4})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
        assert "at most 3" in refused.json()["error"]["message"]
    assert idle(llm)


def test_docs_root_path_and_request_ids(http: httpx.Client, llm: LLM) -> None:
    assert http.get("/v1/models").status_code == 200  # as a proxy that strips the root path forwards it
    schema = http.get("/openapi.json").json()
    assert schema["servers"] == [{"url": "/llm"}]  # the docs' links go through it
    logprobs = schema["components"]["schemas"]["CompletionRequest"]["properties"]["logprobs"]
    assert {"type": "integer", "minimum": 0, "maximum": 3} in logprobs["anyOf"]
    assert http.get("/docs").status_code == 200
    closed = build_app(llm, ServerSettings.from_args(serve_parser().parse_args(["--disable-fastapi-docs"])))
    assert closed.docs_url is None and closed.redoc_url is None and closed.openapi_url is None
    mine = http.get("/health", headers={"X-Request-Id": "abc-123"})
    assert mine.headers["x-request-id"] == "abc-123"
    ids = {http.get("/health").headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)
    with http.stream("POST", "/v1/completions", json={"prompt": "w5", "max_tokens": 2, "stream": True}) as r:
        assert r.headers["x-request-id"] and list(r.iter_lines())


def test_a_unix_socket_and_an_access_log_without_probes(tiny_llama: TinyModel, tmp_path) -> None:
    """`conveyor serve MODEL --uds PATH --disable-access-log-for-endpoints /health,/metrics`: it answers on the
    socket, logs no access line for the probes and one for the rest; vLLM's flags that change nothing here
    (with a value or without) are taken with a note, a multi-node one is refused naming what to do."""
    sock, log = tmp_path / "conveyor.sock", tmp_path / "serve.log"
    argv = [sys.executable, "-m", "conveyor.cli", "serve", str(tiny_llama.path), "--uds", str(sock), "--dtype",
            "float32", "--num-blocks", "64", "--disable-access-log-for-endpoints", "/health,/metrics",
            "--stream-interval", "4", "--use-tqdm-on-load"]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://conveyor", timeout=5) as c:
            deadline = time.monotonic() + 90
            while not sock.exists() or c.get("/health").status_code != 200:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert c.get("/metrics?x=1").status_code == 200
            assert c.get("/v1/models").json()["data"][0]["id"]
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert '"GET /v1/models HTTP/1.1" 200' in text and "/health" not in text and "/metrics" not in text, text
    assert "--stream-interval 4: no effect" in text and "--use-tqdm-on-load: no effect" in text
    refused = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve", "--headless"], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "--headless (vLLM's) is not supported: one machine per" in refused.stderr


def test_reset_prefix_cache_in_dev_mode(tiny_llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's POST /reset_prefix_cache: a 404 unless VLLM_SERVER_DEV_MODE=1; then the cached prefixes are gone
    (the loop resets between two steps), or a 409 while a request is in flight; behind the API key."""
    llm = tiny_llama.llm(page_size=4, num_blocks=128)
    body = {"prompt": random_prompts([24], seed=41)[0], "max_tokens": 2}
    with BackgroundServer(llm) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/reset_prefix_cache").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with BackgroundServer(llm, ServerSettings(api_key="k")) as url, httpx.Client(
            base_url=url, timeout=60, headers={"Authorization": "Bearer k"}) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        assert llm.engine.allocator.num_cached_blocks > 0
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 401
        assert client.post("/reset_prefix_cache").status_code == 200
        assert llm.engine.allocator.num_cached_blocks == 0
        step = llm.engine.step
        monkeypatch.setattr(llm.engine, "step", lambda: time.sleep(0.01) or step())  # steps that last
        long = body | {"max_tokens": 200, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=long) as stream:
            lines = stream.iter_lines()  # kept: a generator dropped closes the stream, which cancels the request
            next(lines)  # the request is running
            busy = client.post("/reset_prefix_cache")
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "requests_in_flight"
    assert idle(llm)
