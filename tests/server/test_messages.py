"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): the official `anthropic` SDK against
a server on the built-in model (fp32, loopback), raw HTTP for the event stream and the error shapes, and
the reply's translation into content blocks on its own."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import pytest

from conveyor import LLM
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.reasoning import get_reasoning_parser
from conveyor.server.anthropic_messages import MessageReply, chat_messages, thinking_kwargs
from conveyor.server.anthropic_protocol import CountTokensRequest, anthropic_error
from conveyor.server.replies import ReasoningPlan
from conveyor.server.tools import plan_tools

from tests.serving_helpers import metric
from tests.structured_check import check
from tests.utils import greedy, idle

KEY = "sk-messages"
WEATHER = {"name": "get_weather", "description": "Forecast for a city", "input_schema": {
    "type": "object", "required": ["city", "days"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
CLOCK = {"name": "get_time", "description": "Time in a zone", "input_schema": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
MOON = [{"role": "user", "content": "Write one sentence about the moon."}]
SYSTEM = "You answer in one sentence."
GREEDY = {"temperature": 0}  # as extra_body: this SDK's create() has no sampling arguments
ROUND_TRIP = ASK + [
    {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, {
        "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 3}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 24C"}]}]
CHAT_ROUND_TRIP = ASK + [  # the same conversation in chat completions' shape
    {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 24C"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def url(llm: LLM):
    settings = ServerSettings(served_model_names=["smol"], api_key=KEY, enable_auto_tool_choice=True,
                              max_request_bytes=2**20)
    with BackgroundServer(llm, settings) as url:
        yield url


@pytest.fixture(scope="module")
def sdk(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture()
def http(url: str):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


def create(sdk: anthropic.Anthropic, stream: bool, **kwargs: Any) -> anthropic.types.Message:
    """A greedy message, whole or as the SDK's stream helper accumulates it."""
    kwargs = {"model": "smol", "max_tokens": 16, "messages": MOON, "extra_body": GREEDY} | kwargs
    if stream:
        with sdk.messages.stream(**kwargs) as events:
            return events.get_final_message()
    return sdk.messages.create(**kwargs)


def without_ids(message: anthropic.types.Message) -> dict[str, Any]:
    """The message as data, its ids left out and its prompt's tokens counted whole (a second call of the same
    prompt reads from the cache what the first computed)."""
    body = message.model_dump()
    body.pop("id")
    for block in body["content"]:
        block.pop("id", None)
    body["usage"] = body["usage"] | {"input_tokens": prompt_tokens(message.usage), "cache_read_input_tokens": 0}
    return body


def prompt_tokens(usage: anthropic.types.Usage) -> int:
    """The prompt's tokens, computed or read from the prefix cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a server-sent event stream, each event's `event:` and `data:` lines."""
    events = []
    for chunk in response.text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        events.append((name[7:], json.loads(data[6:])))
    return events


# -- replies ---------------------------------------------------------------------------------------
def test_text_reply_is_the_chat_reply_and_streams_to_the_same_message(sdk: anthropic.Anthropic, http: httpx.Client,
                                                                      llm: LLM) -> None:
    [ref] = llm.chat([[{"role": "system", "content": SYSTEM}] + MOON], greedy(16, ignore_eos=False), use_tqdm=False)
    whole = create(sdk, False, system=SYSTEM)
    assert whole.id.startswith("msg_") and (whole.type, whole.role, whole.model) == ("message", "assistant", "smol")
    assert [(b.type, b.text) for b in whole.content] == [("text", ref.text)]
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
    assert whole.stop_sequence is None
    assert (prompt_tokens(whole.usage), whole.usage.output_tokens) == (ref.num_prompt_tokens, ref.num_output_tokens)
    streamed = create(sdk, True, system=[{"type": "text", "text": SYSTEM}])  # one system block = the string
    assert without_ids(streamed) == without_ids(whole)
    thinking = create(sdk, False, system=SYSTEM, thinking={"type": "enabled", "budget_tokens": 1024})
    assert without_ids(thinking) == without_ids(whole)  # no --reasoning-parser, no switch in the template: text

    raw = http.post("/v1/messages", json={"model": "smol", "max_tokens": 16, "system": SYSTEM, "messages": MOON,
                                          "temperature": 0}, headers={"anthropic-version": "2023-06-01"}).json()
    assert list(raw) == ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"]
    assert raw["content"] == [{"type": "text", "text": ref.text}]
    cached = raw["usage"]["cache_read_input_tokens"]  # the same prompt as `whole`'s: its full pages are cached
    assert raw["usage"] == {"input_tokens": ref.num_prompt_tokens - cached, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": cached, "output_tokens": ref.num_output_tokens}
    assert ref.num_prompt_tokens - cached < llm.engine.config.page_size <= cached


def test_streams_are_anthropics_event_sequence(http: httpx.Client) -> None:
    body = {"model": "smol", "max_tokens": 8, "messages": MOON, "temperature": 0}
    whole = http.post("/v1/messages", json=body).json()
    events = sse(http.post("/v1/messages", json=body | {"stream": True}))
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start, block, delta = events[0][1]["message"], events[1][1], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == (
        whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"])
    assert start["usage"]["cache_read_input_tokens"] > 0  # the prompt of `whole`, just before
    assert block == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for _, d in events[2:-3]) == whole["content"][0]["text"]
    assert delta == {"type": "message_delta", "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": None},
                     "usage": {"output_tokens": whole["usage"]["output_tokens"]}}

    forced = {"model": "smol", "max_tokens": 48, "messages": ASK, "temperature": 0, "tools": TOOLS, "stream": True,
              "tool_choice": {"type": "tool", "name": "get_weather"}}
    events = sse(http.post("/v1/messages", json=forced))
    start = events[1][1]["content_block"]
    assert start["type"] == "tool_use" and start["id"].startswith("toolu_") and start["name"] == "get_weather"
    assert start["input"] == {}
    pieces = [d["delta"] for name, d in events if name == "content_block_delta"]
    assert pieces and all(p["type"] == "input_json_delta" for p in pieces)
    check(json.loads("".join(p["partial_json"] for p in pieces)), WEATHER["input_schema"])
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_forced_tool_use_validates_against_the_input_schema(sdk: anthropic.Anthropic, llm: LLM) -> None:
    cases = [dict(stream=s, tool_choice=c) for c in ({"type": "tool", "name": "get_weather"},
                                                     {"type": "any", "disable_parallel_tool_use": True})
             for s in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:  # concurrent: one batch
        replies = list(pool.map(lambda c: create(sdk, messages=ASK, tools=TOOLS, max_tokens=48, **c), cases))
    schemas = {t["name"]: t["input_schema"] for t in TOOLS}
    for case, reply in zip(cases, replies):
        assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"], (case, reply)
        [call] = reply.content
        assert call.id.startswith("toolu_") and isinstance(call.input, dict)
        assert call.name == "get_weather" or case["tool_choice"]["type"] == "any"
        check(call.input, schemas[call.name])
    assert without_ids(replies[0]) == without_ids(replies[1]) and without_ids(replies[2]) == without_ids(replies[3])
    assert idle(llm)


def test_a_tool_result_goes_back_as_chat_completions_sends_it(sdk: anthropic.Anthropic, http: httpx.Client) -> None:
    reply = create(sdk, False, messages=ROUND_TRIP, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=12)
    chat = http.post("/v1/chat/completions", json={"model": "smol", "messages": CHAT_ROUND_TRIP, "tools": [
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}} for t in TOOLS],
        "tool_choice": "none", "max_tokens": 12, "temperature": 0}).json()
    assert reply.content[0].text == chat["choices"][0]["message"]["content"]  # the same prompt, greedy
    assert prompt_tokens(reply.usage) == chat["usage"]["prompt_tokens"]
    tokens = http.post("/tokenize", json={"messages": CHAT_ROUND_TRIP}).json()["tokens"]
    counted = sdk.messages.count_tokens(model="smol", messages=ROUND_TRIP, tools=TOOLS, tool_choice={"type": "none"})
    assert counted.input_tokens == len(tokens)  # tools are not rendered under "none"
    auto = create(sdk, False, messages=ROUND_TRIP, tools=TOOLS, max_tokens=12)  # no tool_choice: "auto"
    assert auto.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert prompt_tokens(auto.usage) == sdk.messages.count_tokens(model="smol", messages=ROUND_TRIP,
                                                                  tools=TOOLS).input_tokens


def test_stop_sequences_and_max_tokens(sdk: anthropic.Anthropic) -> None:
    free = create(sdk, False).content[0].text
    stop = free.split()[3]
    for stream in (False, True):
        stopped = create(sdk, stream, stop_sequences=["never in the reply", stop])
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
        assert stopped.content[0].text == free[:free.index(stop)]
        short = create(sdk, stream, max_tokens=3)
        assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)


def test_count_tokens_is_the_requests_input_tokens(sdk: anthropic.Anthropic) -> None:
    conversation = ROUND_TRIP + [{"role": "assistant", "content": "It will be sunny."},
                                 {"role": "user", "content": [{"type": "text", "text": "And in Lima?"}]}]
    system = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Use the tools."}]
    kwargs = {"model": "smol", "messages": conversation, "system": system, "tools": TOOLS}
    reply = create(sdk, False, max_tokens=4, tool_choice={"type": "any"}, **kwargs)
    assert sdk.messages.count_tokens(**kwargs).input_tokens == prompt_tokens(reply.usage)
    joined = kwargs | {"system": f"{SYSTEM}\nUse the tools."}  # text blocks are joined with newlines
    assert sdk.messages.count_tokens(**joined).input_tokens == prompt_tokens(reply.usage)


def test_a_final_assistant_message_is_continued(sdk: anthropic.Anthropic, http: httpx.Client, llm: LLM) -> None:
    prefill = "The moon is"
    reply = create(sdk, False, messages=MOON + [{"role": "assistant", "content": prefill}], max_tokens=8)
    ids = http.post("/tokenize", json={"messages": MOON}).json()["tokens"] + llm.tokenizer.encode(
        prefill, add_special_tokens=False)
    [ref] = llm.generate([ids], greedy(8, ignore_eos=False), use_tqdm=False)
    assert reply.content[0].text == ref.text and prompt_tokens(reply.usage) == len(ids)


# -- errors and lifecycle --------------------------------------------------------------------------
def test_errors_are_anthropics_on_these_routes_only(url: str, http: httpx.Client, sdk: anthropic.Anthropic,
                                                   llm: LLM) -> None:
    def error(response: httpx.Response, status: int, kind: str) -> str:
        assert response.status_code == status, response.text
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
        return body["error"]["message"]

    ok = {"model": "smol", "max_tokens": 2, "messages": MOON}
    assert "max_tokens" in error(http.post("/v1/messages", json={"model": "smol", "messages": MOON}), 400,
                                 "invalid_request_error")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    assert "image" in error(http.post("/v1/messages", json=ok | {"messages": [{"role": "user", "content": [image]}]}),
                            400, "invalid_request_error")
    assert "nope" in error(http.post("/v1/messages", json=ok | {"tools": TOOLS, "tool_choice": {
        "type": "tool", "name": "nope"}}), 400, "invalid_request_error")
    assert "JSON" in error(http.post("/v1/messages", content=b"{not json", headers={
        "Content-Type": "application/json"}), 400, "invalid_request_error")
    error(http.get("/v1/messages"), 405, "invalid_request_error")
    assert "--max-request-bytes" in error(http.post("/v1/messages/count_tokens", json=ok | {"messages": [
        {"role": "user", "content": "w" * 2**20}]}), 413, "request_too_large")
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=MOON)
    assert missing.value.type == "not_found_error" and "smol" in str(missing.value)
    assert anthropic_error(503, "queue full") == (529, {"type": "error", "error": {"type": "overloaded_error",
                                                                                   "message": "queue full"}})

    count = "/v1/messages/count_tokens"
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        error(httpx.post(f"{url}{count}", json=ok, headers=headers), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(model="smol",
                                                                                             messages=MOON)
    assert denied.value.status_code == 401 and denied.value.type == "authentication_error"
    assert httpx.post(f"{url}{count}", json=ok, headers={"x-api-key": KEY}).json()["input_tokens"] > 0
    assert httpx.post(f"{url}/v1/chat/completions", json={"messages": MOON},
                      headers={"x-api-key": KEY}).status_code == 401  # OpenAI's routes keep their bearer key
    openai_error = http.post("/v1/chat/completions", json={"model": "smol"}).json()
    assert set(openai_error) == {"error"} and openai_error["error"]["param"] == "messages"
    assert http.post("/v1/messages", json=ok).status_code == 200  # still serving
    assert idle(llm)


def test_dropped_clients_are_cancelled_and_free_their_blocks(url: str, http: httpx.Client, llm: LLM) -> None:
    aborted = metric(http.get("/metrics").text, "conveyor:request_success_total", finish_reason="abort")
    long = {"model": "smol", "max_tokens": 2000, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]}
    with http.stream("POST", "/v1/messages", json=long | {"stream": True}) as r:
        assert next(line for line in r.iter_lines() if line == "event: content_block_delta")
    # A client waiting for the whole message that gives up once it runs: cancelled too.
    payload = json.dumps(long).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nx-api-key: {KEY}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 30
        while metric(http.get("/metrics").text, "conveyor:num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 30
    while metric(http.get("/metrics").text, "conveyor:request_success_total", finish_reason="abort") < aborted + 2 \
            or not idle(llm):
        assert time.monotonic() < deadline, llm.stats()
        time.sleep(0.05)


def test_the_routes_are_in_the_openapi_schema(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    responses = schema["paths"]["/v1/messages"]["post"]["responses"]
    assert set(responses) == {"200", "400", "401", "404", "413", "500", "504", "529"}
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "AnthropicErrorResponse" in str(responses["400"])
    assert "/v1/messages/count_tokens" in schema["paths"]
    body = schema["components"]["schemas"]["MessagesRequest"]
    assert {"model", "messages", "max_tokens"} <= set(body["required"])
    assert body["properties"]["model"]["enum"] == ["smol", ""]


# -- the translation, without a server ------------------------------------------------------------
def test_the_conversation_becomes_chat_messages() -> None:
    body = CountTokensRequest.model_validate({"model": "", "system": [{"type": "text", "text": "a"}, {
        "type": "text", "text": "b"}], "messages": ROUND_TRIP[:2] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "sunny"}, {"type": "text", "text": "24C"}]}, {"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                          {"type": "text", "text": "It"}]}]})
    messages, prefill = chat_messages(body)
    assert [m.model_dump(exclude_none=True) for m in messages] == [
        {"role": "system", "content": "a\nb"}, {"role": "user", "content": ASK[0]["content"]},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [{
            "id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris",
                                                                                                  "days": 3}}}]},
        {"role": "tool", "content": "sunny\n24C", "tool_call_id": "toolu_1"}, {"role": "user", "content": "And?"}]
    assert prefill == "It"  # the final assistant message, its thinking left out


def accumulate(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content blocks from stream events, as the SDK's stream helper builds them."""
    blocks: list[dict[str, Any]] = []
    arguments: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta" and e["delta"]["type"] in ("text_delta", "thinking_delta"):
            kind = e["delta"]["type"].removesuffix("_delta")
            blocks[e["index"]][kind] += e["delta"][kind]
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta":
            blocks[e["index"]]["signature"] = e["delta"]["signature"]
        elif e["type"] == "content_block_delta":
            arguments[e["index"]] = arguments.get(e["index"], "") + e["delta"]["partial_json"]
        elif e["index"] in arguments:  # content_block_stop
            blocks[e["index"]]["input"] = json.loads(arguments[e["index"]])
    return blocks


@pytest.mark.parametrize("choice, text, kinds", [
    (None, "Sunny all week.", ["text"]),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Lima", "days": 2}', ["tool_use"]),
    ("required", '[{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}, '
                 '{"name": "get_time", "arguments": {"zone": "UTC"}}]', ["tool_use", "tool_use"]),
    ("auto", 'Checking. <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call> Done.',
     ["text", "tool_use", "text"]),
])
def test_a_reply_streamed_in_pieces_adds_up_to_the_whole(choice: Any, text: str, kinds: list[str]) -> None:
    functions = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS]
    plan = plan_tools(functions if choice else None, choice)
    whole = MessageReply(plan)
    whole.feed(text, True)
    pieces, events = MessageReply(plan), []
    for end in range(len(text) + 1):  # a character at a time
        events += pieces.feed(text[:end], end == len(text))
    content = whole.content()
    assert [b["type"] for b in content] == kinds
    assert [{k: v for k, v in b.items() if k != "id"} for b in accumulate(events)] == [
        {k: v for k, v in b.items() if k != "id"} for b in content]
    assert [e["type"] for e in events].count("content_block_stop") == len(content)


OPEN = "<|im_start|>assistant\n<think>\n"  # a prompt that opens the think block
FUNCTIONS = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS]


def test_thinking_comes_first_and_calls_from_the_answer_only() -> None:
    def call(name: str, arguments: dict) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    thought = f"Maybe {call('get_weather', {})} fits."
    text = f"{thought}\n</think>\n\nChecking. {call('get_time', {'zone': 'CET'})}"
    plan, reasoning = plan_tools(FUNCTIONS, "auto"), ReasoningPlan(get_reasoning_parser("qwen3"), OPEN)
    whole = MessageReply(plan, reasoning)
    whole.feed(text, True)
    content = [{k: v for k, v in b.items() if k != "id"} for b in whole.content()]
    assert content == [{"type": "thinking", "thinking": thought, "signature": ""},
                       {"type": "text", "text": "Checking."},
                       {"type": "tool_use", "name": "get_time", "input": {"zone": "CET"}}]
    for cut in range(len(text) + 1):
        pieces = MessageReply(plan, reasoning)
        events = pieces.feed(text[:cut], False) + pieces.feed(text, True)
        assert [{k: v for k, v in b.items() if k != "id"} for b in accumulate(events)] == content, cut
        deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
        stop = events.index({"type": "content_block_stop", "index": 0})
        assert deltas.count("signature_delta") == 1 and events[stop - 1]["delta"]["type"] == "signature_delta"
    forced = MessageReply(plan_tools(FUNCTIONS, {"type": "function", "function": {"name": "get_time"}}),
                          ReasoningPlan(get_reasoning_parser("qwen3"), "", False))  # constrained: from its start
    forced.feed('{"zone": "UTC"}', True)
    assert [(b["type"], b["input"]) for b in forced.content()] == [("tool_use", {"zone": "UTC"})]
    hidden = MessageReply(plan_tools(None, None), ReasoningPlan(get_reasoning_parser("qwen3"), OPEN, include=False))
    hidden.feed("hmm</think>there", True)  # display: "omitted"
    assert hidden.content() == [{"type": "thinking", "thinking": "", "signature": ""},
                                {"type": "text", "text": "there"}]


def test_thinking_sets_the_templates_switch_and_earlier_thinking_is_the_turns_reasoning() -> None:
    def kwargs(template: str, thinking: dict | None) -> dict:
        return thinking_kwargs(CountTokensRequest(model="", messages=MOON, thinking=thinking), template)

    qwen = "{% if enable_thinking is false %}<think></think>{% endif %}"
    assert kwargs(qwen, {"type": "enabled", "budget_tokens": 2048}) == {"enable_thinking": True}
    assert kwargs(qwen, {"type": "disabled"}) == {"enable_thinking": False}
    assert kwargs(qwen, {"type": "adaptive"}) == kwargs(qwen, None) == {}  # the template's default
    assert kwargs("{{ messages }}", {"type": "disabled"}) == {}  # no switch to set
    body = CountTokensRequest.model_validate({"model": "", "messages": ASK + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]})
    assert chat_messages(body)[0][1].reasoning_content == "Look it up."
