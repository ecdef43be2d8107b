"""Reasoning over the API (`--reasoning-parser qwen3`) on the built-in model, with a chat template whose
generation prompt opens a think block unless `enable_thinking` is false; and the chat template options
(`chat_template_kwargs`, the server's defaults, `add_generation_prompt`, `continue_final_message`,
`echo`, an assistant's earlier `reasoning_content`)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from conveyor import LLM
from conveyor.reasoning import REASONING_PARSERS
from conveyor.reasoning.think_tags import Qwen3Parser
from conveyor.server import BackgroundServer, ServerSettings

from tests.serving_helpers import THINK_NOTE, THINK_TEMPLATE, settles, think_settings
from tests.structured_check import check
from tests.utils import greedy

ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
    k: {"type": "string"}}}}} for n, k in (("get_weather", "city"), ("get_time", "zone"))]


@pytest.fixture(scope="module")
def llm() -> LLM:
    """Constraints from the first token, reasoning included (vLLM's enable_in_reasoning): they script replies
    whose blocks the parser reads (test_server_reasoning_apis has the default, a constraint after them)."""
    return LLM(dtype="float32", chat_template=THINK_TEMPLATE, structured_outputs_config={"enable_in_reasoning": True})


@pytest.fixture(scope="module")
def url(llm: LLM):
    with BackgroundServer(llm, think_settings()) as url:
        yield url


@pytest.fixture()
def http(url: str):
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def chat(http: httpx.Client, stream: bool, **body) -> dict:
    """reasoning, content, calls [(name, arguments)], finish and role of one choice, from the whole reply or
    from the stream's deltas concatenated; `reasoning` checked against vLLM's alias field."""
    body = {"messages": ASK, "max_tokens": 16, "temperature": 0} | body
    if not stream:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        message = choice["message"]
        assert message.get("reasoning") == message.get("reasoning_content")
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
        return {"reasoning": message.get("reasoning_content"), "content": message["content"], "calls": calls,
                "finish": choice["finish_reason"], "role": message["role"]}
    reasoning, content, calls, finish, role = "", "", [], None, None
    with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content")
            role = delta.get("role", role)
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in delta.get("tool_calls", [])]
            finish = choice["finish_reason"] or finish
    return {"reasoning": reasoning or None, "content": content or None, "calls": calls, "finish": finish, "role": role}


def test_an_open_think_block_is_reasoning_and_thinking_off_is_content(http: httpx.Client, llm: LLM) -> None:
    note = {"system_note": THINK_NOTE}  # the server's default template kwargs
    [thought] = llm.chat([ASK], greedy(16, ignore_eos=False), use_tqdm=False, chat_template_kwargs=note)
    assert "</think>" not in thought.text and thought.text.strip()  # the block is still open at the end
    for stream in (False, True):
        reply = chat(http, stream)
        assert (reply["reasoning"], reply["content"], reply["finish"]) == (thought.text.strip(), None,
                                                                            thought.finish_reason)
    off = note | {"enable_thinking": False}
    assert llm.render_chat_text(ASK, chat_template_kwargs=off).endswith("<think>\n\n</think>\n\n")
    [plain] = llm.chat([ASK], greedy(16, ignore_eos=False), use_tqdm=False, chat_template_kwargs=off)
    for stream in (False, True):
        reply = chat(http, stream, chat_template_kwargs={"enable_thinking": False})
        assert (reply["reasoning"], reply["content"], reply["finish"]) == (None, plain.text, plain.finish_reason)
    settles(llm)


def test_the_openai_client_reads_reasoning_content(url: str, llm: LLM) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    forced = {"structured_outputs": {"regex": r"<think>\nThe user asks for a capital\.\n</think>\n\nParis\."}}
    message = client.chat.completions.create(model="smol", messages=ASK, max_tokens=40,
                                             extra_body=forced).choices[0].message
    assert (message.reasoning_content, message.content) == ("The user asks for a capital.", "Paris.")
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model="smol", messages=ASK, max_tokens=40, stream=True, extra_body=forced) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == "Paris."
    settles(llm)


def test_a_reply_that_writes_its_block_splits_alike_streamed_and_whole(http: httpx.Client, llm: LLM) -> None:
    """A constrained reply begins where the constraint does: its block is reasoning because it writes
    `<think>`, whatever the prompt left open."""
    forced = {"structured_outputs": {"regex": r"<think>\nThe user asks for a capital\.\n</think>\n\nParis\."},
              "max_tokens": 40}
    for stream in (False, True):
        reply = chat(http, stream, **forced)
        assert (reply["reasoning"], reply["content"], reply["finish"]) == ("The user asks for a capital.", "Paris.",
                                                                            "stop")
        hidden = chat(http, stream, include_reasoning=False, **forced)
        assert (hidden["reasoning"], hidden["content"]) == (None, "Paris.")
        raw = chat(http, stream, reasoning_format="none", **forced)  # llama.cpp's: not split for this request
        assert (raw["reasoning"], raw["content"]) == (None, "<think>\nThe user asks for a capital.\n</think>\n\nParis.")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    reply = chat(http, False, max_tokens=40, response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": schema}})
    assert reply["reasoning"] is None  # the prompt's open block does not swallow a constrained answer
    check(json.loads(reply["content"]), schema)
    settles(llm)


def test_tool_calls_are_read_from_the_answer_only(http: httpx.Client, llm: LLM) -> None:
    def block(name: str, arguments: dict) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    text = (f"<think>\nMaybe {block('get_weather', {'city': 'Paris'})} fits.\n</think>\n\n"
            f"{block('get_time', {'zone': 'CET'})}")
    for stream in (False, True):
        reply = chat(http, stream, tools=TOOLS, tool_choice="auto", max_tokens=120,
                     structured_outputs={"regex": re.escape(text)})
        assert reply["calls"] == [("get_time", {"zone": "CET"})] and reply["finish"] == "tool_calls"
        assert reply["content"] is None and reply["reasoning"].startswith("Maybe <tool_call>")
        assert "get_weather" in reply["reasoning"]
    settles(llm)


def test_a_reasoning_stream_cancelled_midway_gives_back_its_blocks(url: str, llm: LLM) -> None:
    body = {"messages": ASK, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    deltas = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and "role" not in (delta := json.loads(line[6:])["choices"][0]["delta"]):
                deltas.append(delta)
                if len(deltas) == 4:
                    break
    assert all(set(d) == {"reasoning_content", "reasoning"} for d in deltas)  # the open block streams as reasoning
    settles(llm)


def test_template_options_continue_echo_and_kwargs(http: httpx.Client, llm: LLM) -> None:
    opened = ASK + [{"role": "assistant", "content": "The capital of France is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    [ref] = llm.chat([opened], greedy(6, ignore_eos=False), use_tqdm=False,
                     chat_template_kwargs={"system_note": THINK_NOTE}, **options)
    for stream in (False, True):
        reply = chat(http, stream, messages=opened, max_tokens=6, echo=True, **options)
        assert (reply["role"], reply["content"], reply["reasoning"]) == ("assistant", opened[-1]["content"] + ref.text,
                                                                         None)
        assert chat(http, stream, messages=opened, max_tokens=6, **options)["content"] == ref.text
    assert chat(http, False, messages=ASK, max_tokens=1, add_generation_prompt=False)["role"] == "user"  # as vLLM

    def prompt_tokens(**body) -> int:
        return http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1} | body).json()["usage"][
            "prompt_tokens"]

    assert prompt_tokens() == len(llm.render_chat(ASK, chat_template_kwargs={"system_note": THINK_NOTE}))
    answered = [ASK[0], {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}, ASK[0]]
    rendered = len(llm.render_chat(answered, chat_template_kwargs={"system_note": THINK_NOTE}))
    assert prompt_tokens(messages=answered) == rendered  # an earlier reasoning goes to a template that renders it
    unthought = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in answered]
    assert prompt_tokens(messages=unthought) < rendered
    other = {"system_note": "Be brief."}  # the request's kwargs go over the server's defaults
    assert prompt_tokens(chat_template_kwargs=other) == len(llm.render_chat(ASK, chat_template_kwargs=other))
    for body, param in (({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs")):
        response = http.post("/v1/chat/completions", json={"messages": opened} | body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    settles(llm)


def test_markers_the_tokenizer_holds_as_special_tokens_reach_the_parser(llm: LLM,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A format whose markers are special tokens (gpt-oss's channels) reads replies decoded with them:
    here `<|im_start|>` plays the marker, forced by a logit bias."""
    class Special(Qwen3Parser):
        name, special = "special", ("<|im_start|>",)

    monkeypatch.setitem(REASONING_PARSERS, "special", Special)
    marker = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = {"messages": ASK, "max_tokens": 2, "logit_bias": {str(marker): 100}}
    for name, text in (("special", "<|im_start|><|im_start|>"), ("qwen3", None)):
        with BackgroundServer(llm, ServerSettings(reasoning_parser=name)) as url:
            message = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert message["reasoning_content"] == text, name  # the open block: reasoning, markers kept or dropped
    settles(llm)
