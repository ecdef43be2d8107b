"""llama.cpp's request fields over the API (mapped: `n_predict`, `grammar`, `json_schema`, `cache_prompt`;
refused by name unless off: its samplers), and the unknown fields the server ignores, logged once per
name; on a tiny random model whose byte-level tokenizer can spell JSON."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.server import BackgroundServer
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.request_fields import token_limit

from tests.serving_helpers import save_json_tiny
from tests.structured_check import check
from tests.utils import idle

ASK = [{"role": "user", "content": "What is the weather in Lima?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = save_json_tiny(tmp_path_factory.mktemp("json_tiny"))
    return LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=256))


@pytest.fixture(scope="module")
def url(llm: LLM):
    with BackgroundServer(llm) as url:
        yield url


@pytest.fixture()
def http(url: str):
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def test_llama_cpp_fields_are_mapped_or_refused_by_name(http: httpx.Client, llm: LLM) -> None:
    def post(path: str, **body) -> httpx.Response:
        """Chat with ASK, or a completion of "Hello"."""
        base = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "Hello"}
        return http.post(path, json=base | body)

    chat_path, completions = "/v1/chat/completions", "/v1/completions"
    assert post(chat_path, n_predict=5, ignore_eos=True).json()["usage"]["completion_tokens"] == 5
    assert post(completions, n_predict=3, ignore_eos=True).json()["usage"]["completion_tokens"] == 3
    assert post(completions, max_tokens=3, n_predict=3, ignore_eos=True).status_code == 200
    assert token_limit(ChatCompletionRequest(messages=ASK, n_predict=-1)) is None  # the rest of the context
    answer = post(chat_path, grammar='root ::= "yes" | "no"', cache_prompt=True).json()["choices"][0]["message"]
    assert answer["content"] in ("yes", "no")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # closed: a random model stops
    for body in ({"json_schema": schema}, {"response_format": {"type": "json_object", "schema": schema}}):
        check(json.loads(post(chat_path, max_tokens=30, **body).json()["choices"][0]["message"]["content"]), schema)
    defaults = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1, "repeat_penalty": 1.0, "mirostat_tau": 5, "id_slot": -1}
    assert post(chat_path, max_tokens=1, **defaults).status_code == 200  # llama.cpp's off values, accepted
    for body, param in (({"mirostat": 2}, "mirostat"), ({"repeat_penalty": 1.1}, "repeat_penalty"),
                        ({"n_probs": 5}, "n_probs"), ({"n_predict": 0}, "n_predict"),
                        ({"n_predict": 4, "max_tokens": 5}, "n_predict"),
                        ({"grammar": 'root ::= "a"', "json_schema": schema}, "json_schema")):
        for path in (chat_path, completions):
            response = post(path, **body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, (path, response.text)
    assert "use repetition_penalty" in post(chat_path, repeat_penalty=1.1).json()["error"]["message"]
    function = {"name": "f", "parameters": {"type": "object"}}
    for body, param in (({"functions": [function]}, "functions"), ({"function_call": {"name": "f"}}, "function_call"),
                        ({"modalities": ["text", "audio"]}, "modalities"),
                        ({"web_search_options": {}}, "web_search_options")):
        refused = post(chat_path, **body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert "send them as tools" in post(chat_path, functions=[function]).json()["error"]["message"]
    assert post(chat_path, max_tokens=1, modalities=["text"], function_call="auto").status_code == 200
    assert idle(llm)


def test_an_unknown_field_is_logged_once_per_name(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="conveyor.server")
    for _ in range(2):
        assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, "frobnicate": 1,
                                                       "mirostat_eta": 0.1, "metadata": {"k": "v"},
                                                       "store": False}).status_code == 200  # OpenAI's: no warning
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "quux": "x"}).status_code == 200
    ignored = [r.getMessage() for r in caplog.records if "is not supported and is ignored" in r.getMessage()]
    assert sorted(ignored) == ["/v1/chat/completions: request field 'frobnicate' is not supported and is ignored "
                               "(logged once per field name)", "/v1/completions: request field 'quux' is not "
                               "supported and is ignored (logged once per field name)"]
