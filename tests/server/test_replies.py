"""One chat reply assembled from its growing text, without a model: the reasoning split off first, tool
calls read from the answer only, echo and role; streamed deltas at any cut add up to the whole message."""

from __future__ import annotations

import json

import pytest

from conveyor.reasoning import get_reasoning_parser
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.replies import ChatReply, ReasoningPlan, plan_reasoning, role_and_echo, template_options
from conveyor.server.tools import ToolPlan, plan_tools

OPEN = "<|im_start|>assistant\n<think>\n"
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
CALL_F = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
CALL_G = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
TEXT = f"Should I use {CALL_F}? No.\n</think>\n\nSure. {CALL_G}"


def streamed(reply: ChatReply, text: str, cut: int) -> dict:
    """The deltas of feeding text[:cut] then the whole text, merged as a client merges them."""
    merged: dict = {"reasoning_content": "", "content": "", "tool_calls": []}
    for piece, finished in ((text[:cut], False), (text, True)):
        delta = reply.feed(piece, finished)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        merged["content"] += delta.get("content", "")
        merged["tool_calls"] += [(c["function"]["name"], c["function"]["arguments"])
                                 for c in delta.get("tool_calls", [])]
    return merged


def test_the_whole_message_and_any_split_stream_agree() -> None:
    plan = plan_tools(TOOLS, "auto")
    reasoning = ReasoningPlan(get_reasoning_parser("qwen3"), OPEN)
    whole = ChatReply(reasoning, plan)
    message = whole.message(TEXT)
    assert message["reasoning_content"] == message["reasoning"] == f"Should I use {CALL_F}? No."
    assert message["content"] == "Sure." and message["role"] == "assistant"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("g", {})]  # the call in the reasoning is not made
    for cut in range(len(TEXT) + 1):
        merged = streamed(ChatReply(reasoning, plan), TEXT, cut)
        assert merged == {"reasoning_content": message["reasoning_content"], "content": "Sure.",
                          "tool_calls": [("g", "{}")]}, cut
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"


def test_without_a_parser_the_reply_is_content_as_written() -> None:
    reply = ChatReply(ReasoningPlan(), ToolPlan())
    assert reply.message(" <think>x</think> y") == {"role": "assistant", "content": " <think>x</think> y"}
    assert streamed(ChatReply(ReasoningPlan(), ToolPlan()), "ab", 1) == {"reasoning_content": "", "content": "ab",
                                                                         "tool_calls": []}


def test_hidden_reasoning_and_an_echo() -> None:
    hidden = ChatReply(ReasoningPlan(get_reasoning_parser("qwen3"), OPEN, include=False), ToolPlan(), echo="Hi. ")
    assert hidden.message("hmm</think>there") == {"role": "assistant", "content": "Hi. there",
                                                   "reasoning_content": None, "reasoning": None}
    assert hidden.opening() == {"role": "assistant", "content": "Hi. "}


@pytest.mark.parametrize("body, role, echo", [
    ({"echo": True}, "assistant", ""),  # the last message is the user's: not echoed
    ({"echo": True, "add_generation_prompt": False, "continue_final_message": True}, "assistant", "Dear"),
    ({"add_generation_prompt": False}, "assistant", ""),
])
def test_role_and_echo_follow_vllm(body: dict, role: str, echo: str) -> None:
    messages = [{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Dear"}]
    asked = ChatCompletionRequest(messages=messages[:1] if body == {"echo": True} else messages, **body)
    assert role_and_echo(asked) == (role, echo)


def test_template_options_and_the_plan() -> None:
    options = template_options({"enable_thinking": False}, {"enable_thinking": True, "note": "n"})
    assert options == {"add_generation_prompt": True, "continue_final_message": False,
                       "chat_template_kwargs": {"enable_thinking": False, "note": "n"}}
    qwen3 = get_reasoning_parser("qwen3")
    assert plan_reasoning(qwen3, OPEN, options["chat_template_kwargs"], False).thinking is False
    assert plan_reasoning(qwen3, OPEN, {}, True) == ReasoningPlan(qwen3, "", False)  # constrained: from its start
    assert plan_reasoning(None, OPEN, {}, False).reply() is None
