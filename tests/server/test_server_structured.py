"""Structured outputs, logit_bias and tools over the API, with the official openai client, against a
server on the built-in model (fp32, loopback)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conveyor import LLM
from conveyor.server import BackgroundServer, ServerSettings

from tests.structured_check import check
from tests.utils import idle

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["city", "days", "units", "hourly", "alerts", "where"],
    "properties": {
        "city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]}, "hourly": {"type": "boolean"},
        "alerts": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 2},
        "where": {"type": "object", "required": ["lat", "lon"], "additionalProperties": False,
                  "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}},
    },
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city", "parameters": {
    "type": "object", "required": ["city", "days"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": {
    "type": "object", "required": ["zone"], "additionalProperties": False,
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def url(llm: LLM):
    with BackgroundServer(llm, ServerSettings(served_model_names=["smol"], enable_auto_tool_choice=True)) as url:
        yield url


def chat(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as {name, arguments}, finish reason), streamed through the client's helper or not."""
    kwargs = {"model": "smol", "messages": ASK, "max_tokens": 96} | kwargs
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            choice = events.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def test_json_schema_and_json_object_replies_parse_and_validate(client: openai.OpenAI, llm: LLM) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    cases = [dict(stream=s, temperature=t, seed=k, response_format=f) for s in (False, True) for t in (0.0, 0.7)
             for k, f in enumerate((schema_format, {"type": "json_object"}))]
    with ThreadPoolExecutor(len(cases)) as pool:  # concurrent: one batch
        replies = list(pool.map(lambda c: chat(client, **c), cases))
    for case, (content, calls, reason) in zip(cases, replies):
        assert reason == "stop" and not calls, (case, content)
        value = json.loads(content)
        if case["response_format"] is schema_format:
            check(value, SCHEMA)
        else:
            assert isinstance(value, dict)
    assert replies[0] == replies[4] and replies[1] == replies[5]  # greedy: streamed == whole
    assert idle(llm)


def test_structured_outputs_extra_field_and_logit_bias(client: openai.OpenAI, llm: LLM) -> None:
    def complete(**extra) -> str:
        return client.completions.create(model="smol", prompt="Answer:", max_tokens=12, temperature=0,
                                         extra_body=extra).choices[0].text
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", complete(structured_outputs={"regex": r"[A-Z]{2}-[0-9]{3}"}))
    assert complete(structured_outputs={"choice": ["alpha", "beta"]}) in ("alpha", "beta")
    assert complete(structured_outputs={"grammar": 'root ::= "yes" | "no"'}) in ("yes", "no")
    zone = CLOCK["function"]["parameters"]
    check(json.loads(complete(structured_outputs={"json": zone})), zone)
    # vLLM's earlier names, which it now drops (unconstrained output there): honoured here
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", complete(guided_regex=r"[A-Z]{2}-[0-9]{3}"))
    assert complete(guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    check(json.loads(complete(guided_json=zone)), zone)
    token = llm.tokenizer.encode(" banana")[0]
    biased = client.completions.create(model="smol", prompt="Answer:", max_tokens=3, temperature=0,
                                       logit_bias={str(token): 100})
    assert llm.tokenizer.encode(biased.choices[0].text) == [token] * 3


def test_a_structural_tag_constrains_what_follows_its_trigger(client: openai.OpenAI, url: str) -> None:
    """vLLM's structural tag, through `structured_outputs` and `response_format`: the trigger is the reply's own
    first token (which free text leaves as the unconstrained greedy pick), so the structure's begin, a body
    following the schema and its end come next."""
    first = client.completions.create(model="smol", prompt="Answer:", max_tokens=1, temperature=0).choices[0].text
    zone = CLOCK["function"]["parameters"]
    tag = {"triggers": [first], "structures": [{"begin": first + " call ", "schema": zone, "end": "!"}]}
    text = client.completions.create(model="smol", prompt="Answer:", max_tokens=40, temperature=0,
                                     extra_body={"structured_outputs": {"structural_tag": tag}}).choices[0].text
    head, _, rest = text.partition(first + " call ")
    assert head == "" and "!" in rest, text
    check(json.loads(rest[:rest.index("!")]), zone)
    reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": "Answer:", "max_tokens": 40, "temperature": 0, "response_format": {"type": "structural_tag"} | tag})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == text
    bad = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": "Answer:", "max_tokens": 4, "response_format": {"type": "structural_tag", "triggers": ["<x"],
                                                                 "structures": tag["structures"]}})
    assert bad.status_code == 400 and "starts with none of the triggers" in bad.json()["error"]["message"]


def test_named_and_required_tool_calls_validate_and_stream_like_the_whole(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    # Sampled, "required" may repeat calls up to max_tokens (SmolLM2 does with some seeds): this seed stops.
    cases = [dict(stream=s, temperature=t, seed=2, tools=TOOLS, tool_choice=c)
             for c in (named, "required") for s in (False, True) for t in (0.0, 0.7)]
    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(lambda c: chat(client, **c), cases))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for case, (content, calls, reason) in zip(cases, replies):
        assert reason == "tool_calls" and not content and calls, (case, content, calls)
        assert len(calls) == 1 or case["tool_choice"] == "required"  # required: parallel calls allowed
        assert all(c["id"].startswith("call_") for c in calls)
        if case["tool_choice"] is named:
            assert calls[0]["name"] == "get_weather"
        for call in calls:
            check(json.loads(call["arguments"]), schemas[call["name"]])
    strip = [[{k: v for k, v in c.items() if k != "id"} for c in calls] for _, calls, _ in replies]
    assert strip[0] == strip[2] and strip[4] == strip[6]  # greedy: the streamed deltas reassemble to the call


def test_an_auto_tool_call_is_parsed_from_the_output(client: openai.OpenAI) -> None:
    """The output is forced (a regex) to a Hermes block, as a tool-using model would write it."""
    block = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    for stream in (False, True):
        content, calls, reason = chat(client, stream, tools=TOOLS, tool_choice="auto", temperature=0,
                                      extra_body={"structured_outputs": {"regex": "Checking\\. " + re.escape(block)}})
        assert (content, reason) == ("Checking.", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": "CET"})]
    content, calls, reason = chat(client, False, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0)
    assert not calls and reason == "length" and content


def test_tool_results_render_through_the_template(client: openai.OpenAI, url: str, llm: LLM) -> None:
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]
    tokens = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    text = llm.tokenizer.decode(tokens)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in text
    content, _, reason = chat(client, False, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    assert reason in ("length", "stop")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objecto"}}}},
     "response_format", "objecto"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= ( "}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "[0-9"}, "guided_regex", "regex"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice", "give one constraint"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 300}}, "logit_bias", "-100, 100"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "token ids"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
])
def test_invalid_constraints_are_400s_and_the_server_keeps_serving(url: str, llm: LLM, body: dict, param: str,
                                                                   words: str) -> None:
    reply = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4} | body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert idle(llm)
