"""Tool calls parsed from scripted model output (Hermes blocks), and tool-choice plans, without a model."""

from __future__ import annotations

import json

import pytest

from conveyor.server.protocol import APIError, ChatMessage
from conveyor.server.tool_parsers import HermesToolParser, parser_for
from conveyor.server.tools import ToolPlan, conversation, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCRIPT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')


def test_hermes_blocks_become_calls_and_the_rest_is_content() -> None:
    content, calls = HermesToolParser().parse(SCRIPT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert HermesToolParser().parse("no tools here") == ("no tools here", [])
    content, calls = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')  # EOS before closing
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    content, calls = HermesToolParser().parse("<tool_call>not json</tool_call> tail")
    assert calls == [] and content == "<tool_call>not json</tool_call> tail"
    assert parser_for("llama") is HermesToolParser


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_fed_piece_by_piece_the_parser_gives_the_same_reply(step: int) -> None:
    parser, content, calls = HermesToolParser(), "", []
    for end in range(step, len(SCRIPT) + step, step):
        piece, new = parser.feed(SCRIPT[:end], finished=end >= len(SCRIPT))
        assert "<" not in piece  # a partial tag is held back, never sent as content
        content += piece
        calls += new
    whole_content, whole_calls = HermesToolParser().parse(SCRIPT)
    assert content == whole_content and [(c.name, c.arguments) for c in calls] == [
        (c.name, c.arguments) for c in whole_calls]


def streamed(plan: ToolPlan, text: str, step: int) -> tuple[dict, dict]:
    """(the deltas merged as the openai client does, the whole message)."""
    reply, merged = plan.reply(), {"content": "", "calls": {}}
    for end in range(step, len(text) + step, step):
        delta = reply.feed(text[:end], end >= len(text), end >= len(text))
        merged["content"] += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            slot = merged["calls"].setdefault(piece["index"], {"name": "", "arguments": ""})
            slot["name"] += piece.get("function", {}).get("name", "")
            slot["arguments"] += piece["function"].get("arguments", "")
            assert "id" not in piece or piece["id"].startswith("call_")
    return merged, plan.reply().message(text, True)


@pytest.mark.parametrize("step", [1, 4])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(step: int) -> None:
    required = plan_tools([WEATHER, TIME], "required", None)
    merged, message = streamed(required, '{"name": "get_weather", "arguments": {"city": "Paris"}}', step)
    assert merged["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert message["content"] is None and message["tool_calls"][0]["function"] == merged["calls"][0]
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    merged, message = streamed(named, '{"tz": "UTC"}', step)
    assert merged["calls"] == {0: {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    assert message["tool_calls"][0]["function"] == merged["calls"][0]
    merged, message = streamed(plan_tools([WEATHER, TIME], "auto", None), SCRIPT, step)
    assert merged["content"] == message["content"] == "Let me check."
    assert [merged["calls"][i] for i in (0, 1)] == [c["function"] for c in message["tool_calls"]]


def test_required_constraint_offers_each_tool_and_named_its_arguments() -> None:
    required = plan_tools([WEATHER, TIME], "required", None).constraint
    options = required.json["anyOf"]
    assert [o["properties"]["name"] for o in options] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert options[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None).constraint
    assert named.json == WEATHER["function"]["parameters"]
    assert plan_tools([WEATHER], "auto", None).constraint is None and not plan_tools(None, None, None).active


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], "sometimes", "tool_choice"), ([WEATHER], {"type": "function", "function": {"name": "nope"}},
                                              "tool_choice"),
    (None, "required", "tool_choice"), ([{"type": "retrieval"}], "auto", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "auto", "tools"),
])
def test_bad_tools_or_tool_choice_are_400s_naming_the_field(tools, choice, param: str) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice, None)
    assert info.value.status == 400 and info.value.param == param


def test_tool_messages_are_written_hermes_style_for_a_template_without_tools() -> None:
    messages = [ChatMessage(role="user", content="Weather?"),
                ChatMessage(role="assistant", content=None, tool_calls=[
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]),
                ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    roles = {"user": "user", "assistant": "assistant", "system": "system"}
    turns, tools = conversation(messages, plan_tools([WEATHER], "auto", None), "{{ m['content'] }}", roles)
    assert tools is None and turns[0]["role"] == "system" and "<tools>" in turns[0]["content"]
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in turns[2]["content"]
    assert turns[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    turns, tools = conversation(messages, plan_tools([WEATHER], "auto", None), "{% if tools %}", roles)
    assert tools == [WEATHER] and turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert turns[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
