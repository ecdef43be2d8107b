"""The Responses API's pieces without a server: input items as chat turns (earlier reasoning included),
`reasoning.effort` as template variables, the output items and stream events a reply builds (fed whole
or a few characters at a time; reasoning split off first), and the store's bound (and its flag)."""

from __future__ import annotations

import json

import pytest

from conveyor.reasoning import get_reasoning_parser
from conveyor.server import ServerSettings
from conveyor.server.protocol import APIError
from conveyor.server.replies import ReasoningPlan, effort_kwargs
from conveyor.server.responses.items import OutputBuilder, item_turns, output_turns, reasoning_text
from conveyor.server.responses.protocol import ResponsesRequest
from conveyor.server.responses.store import ResponseStore, StoredResponse
from conveyor.server.tools import plan_tools

from tests.serving_helpers import serve_parser

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]


def items(*raw: dict) -> list:
    return ResponsesRequest(input=list(raw)).input  # type: ignore[return-value]


def test_items_become_chat_turns_with_calls_joining_the_assistant_turn() -> None:
    turns = item_turns(items(
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                                          {"type": "input_text", "text": "In Lima."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "b", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call", "call_id": "c3", "name": "a", "arguments": "{}"}))
    assert [(t.role, t.content) for t in turns] == [("developer", "Be brief."), ("user", "Weather?\nIn Lima."),
                                                     ("assistant", "Checking."), ("tool", "sunny"), ("assistant", None)]
    assert [c["id"] for c in turns[2].tool_calls] == ["c1", "c2"] and turns[3].tool_call_id == "c1"
    assert turns[2].tool_calls[1]["function"] == {"name": "b", "arguments": "{\"x\": 1}"}
    assert [c["id"] for c in turns[4].tool_calls] == ["c3"]
    with pytest.raises(APIError, match=r"input\[0\]\.content\[1\] is input_image") as refused:
        item_turns(items({"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                                      {"type": "input_image", "image_url": "data:..."}]}))
    assert refused.value.status == 400 and refused.value.param == "input"


def events_of(plan_args: tuple, text: str, step: int,
              reasoning: ReasoningPlan | None = None) -> tuple[list[dict], list[dict]]:
    """(events, items) of `text` fed `step` characters at a time (each event serialized as it comes)."""
    events: list[dict] = []
    builder = OutputBuilder(plan_tools(*plan_args), reasoning, lambda e: events.append(json.loads(json.dumps(e))))
    for end in range(step, len(text) + step, step):
        builder.feed(text[:end], end >= len(text))
    builder.close("completed")
    return events, builder.items


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_a_required_reply_streams_one_item_per_call(step: int) -> None:
    plan_args = (TOOLS, "required")
    text = '[{"name": "a", "arguments": {"x": [1, 2]}}, {"name": "b", "arguments": {}}]'
    events, built = events_of(plan_args, text, step)
    _, whole = events_of(plan_args, text, len(text))
    assert [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in built] == [
        {k: v for k, v in i.items() if k not in ("id", "call_id")} for i in whole] == [
        {"type": "function_call", "status": "completed", "name": "a", "arguments": '{"x": [1, 2]}'},
        {"type": "function_call", "status": "completed", "name": "b", "arguments": "{}"}]
    kinds = [e["type"] for e in events]
    first_done = kinds.index("response.output_item.done")
    assert kinds[0] == "response.output_item.added" and kinds[first_done + 1] == "response.output_item.added"
    assert kinds[first_done - 1] == "response.function_call_arguments.done" and kinds[-1] == "response.output_item.done"
    for index, item in enumerate(built):
        mine = [e for e in events if e.get("output_index") == index]
        assert {e["item_id"] for e in mine if "item_id" in e} == {item["id"]}
        assert mine[0]["item"]["arguments"] == "" and mine[0]["item"]["status"] == "in_progress"
        assert "".join(e["delta"] for e in mine if e["type"].endswith("arguments.delta")) == item["arguments"]


def test_auto_reply_content_then_a_call_and_plain_text() -> None:
    text = 'Checking. <tool_call>\n{"name": "b", "arguments": {"zone": "CET"}}\n</tool_call>'
    events, built = events_of((TOOLS, "auto"), text, 3)
    assert [i["type"] for i in built] == ["message", "function_call"]
    assert built[0]["content"] == [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]
    assert json.loads(built[1]["arguments"]) == {"zone": "CET"}
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_item.added", 1)  # one at a time
    events, built = events_of(([], None), "Hello there", 2)
    assert built == [{"id": built[0]["id"], "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": "Hello there", "annotations": [], "logprobs": []}]}]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello there"
    assert [e["type"] for e in events][-3:] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done"]
    [turn] = output_turns(built)
    assert (turn.role, turn.content) == ("assistant", "Hello there")


THOUGHT = 'Maybe <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call> fits.'
ANSWER = 'Sure. <tool_call>\n{"name": "b", "arguments": {"zone": "CET"}}\n</tool_call>'


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_reasoning_is_an_item_first_and_calls_come_from_the_answer_only(step: int) -> None:
    reasoning = ReasoningPlan(get_reasoning_parser("qwen3"), "<|im_start|>assistant\n<think>\n")
    events, built = events_of((TOOLS, "auto"), f"{THOUGHT}\n</think>\n\n{ANSWER}", step, reasoning)
    assert [i["type"] for i in built] == ["reasoning", "message", "function_call"]
    thought, message, call = built
    assert thought == {"id": thought["id"], "type": "reasoning", "status": "completed", "summary": [],
                       "content": [{"type": "reasoning_text", "text": THOUGHT}]} and thought["id"].startswith("rs_")
    assert reasoning_text(built) == THOUGHT
    assert message["content"][0]["text"] == "Sure." and (call["name"], call["arguments"]) == ("b", '{"zone": "CET"}')
    mine = [e for e in events if e.get("output_index") == 0]
    assert [e["type"] for e in mine][:2] == ["response.output_item.added", "response.content_part.added"]
    assert [e["type"] for e in mine][-3:] == ["response.reasoning_text.done", "response.content_part.done",
                                              "response.output_item.done"]
    assert mine[0]["item"]["content"] == [] and mine[1]["part"] == {"type": "reasoning_text", "text": ""}
    assert "".join(e["delta"] for e in mine if e["type"] == "response.reasoning_text.delta") == THOUGHT
    assert mine[-3]["text"] == THOUGHT and all(e["item_id"] == thought["id"] for e in mine if "item_id" in e)
    _, cut = events_of(([], None), "still thinking", step, reasoning)  # the block open at the end
    assert [(i["type"], i["content"][0]["text"]) for i in cut] == [("reasoning", "still thinking")]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_logprobs_go_to_the_message_text_their_tokens_made(step: int) -> None:
    """Each feed's entries (one per piece here) go to the message text it adds, or wait for it while the
    parser holds text back; a feed of reasoning only drops them; deltas, part and done event agree."""
    reasoning = ReasoningPlan(get_reasoning_parser("qwen3"), "<|im_start|>assistant\n<think>\n")
    text = "Hmm, so.\n</think>\n\nYes, it is."
    events: list[dict] = []
    builder = OutputBuilder(plan_tools([], None), reasoning, lambda e: events.append(json.loads(json.dumps(e))))
    ends = list(range(step, len(text) + step, step))
    pieces = [{"token": text[end - step:end], "logprob": -0.5} for end in ends]
    for end, piece in zip(ends, pieces):
        builder.feed(text[:end], end >= len(text), [piece])
    builder.close("completed")
    thought, message = builder.items
    assert message["content"][0]["text"] == "Yes, it is."
    kept = message["content"][0]["logprobs"]
    assert [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]] == kept
    assert [e["logprobs"] for e in events if e["type"] == "response.output_text.done"] == [kept]
    assert kept == pieces[len(pieces) - len(kept):]  # the last ones, in order
    answer_start = text.index("Yes")
    assert all(p in kept for p, end in zip(pieces, ends) if end - step >= answer_start)  # the answer's own
    if step < len(text):
        assert pieces[0] not in kept and "logprobs" not in thought["content"][0]


def test_reasoning_items_are_the_next_assistant_turns_reasoning() -> None:
    turns = item_turns(items(
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "ignored"}], "encrypted_content": "x",
         "content": [{"type": "reasoning_text", "text": "Sunny."}]},
        {"type": "function_call", "call_id": "c2", "name": "b", "arguments": "{}"},
        {"type": "reasoning", "summary": []},  # nothing follows it: dropped
        {"role": "user", "content": "Thanks."}))
    assert [(t.role, t.content, t.reasoning_content) for t in turns] == [
        ("user", "Weather?", None), ("assistant", "Checking.", "Look."), ("tool", "sunny", None),
        ("assistant", None, "Sunny."), ("user", "Thanks.", None)]
    assert [c["id"] for c in turns[1].tool_calls] == ["c1"] and [c["id"] for c in turns[3].tool_calls] == ["c2"]


@pytest.mark.parametrize("template, effort, kwargs", [
    ("{% if enable_thinking is false %}off{% endif %}", "none", {"enable_thinking": False}),
    ("{% if enable_thinking is false %}off{% endif %}", "low", {"enable_thinking": True}),
    ("{% if enable_thinking is false %}off{% endif %}", None, {}),  # the template's default
    ("{% if thinking %}on{% endif %}", "high", {"thinking": True}),  # DeepSeek V3.1's and Granite's switch
    ("Reasoning: {{ reasoning_effort }}", "high", {"reasoning_effort": "high"}),  # gpt-oss's
    ("{{ messages }}", "high", {}),  # no switch: nothing set
])
def test_effort_sets_the_switch_the_template_reads(template: str, effort: str | None, kwargs: dict) -> None:
    assert effort_kwargs(template, effort) == kwargs


def test_the_store_drops_the_least_recently_used_finished_response() -> None:
    store = ResponseStore(capacity=2)
    entries = {k: StoredResponse({"id": k}) for k in "abcd"}
    for k in "abd":
        entries[k].done.set()
    store.put("a", entries["a"])
    store.put("b", entries["b"])
    assert store.get("a") is entries["a"]  # a is now the most recent
    store.put("c", entries["c"])  # running: never dropped
    assert store.get("b") is None and len(store) == 2
    store.put("d", entries["d"])
    assert store.get("a") is None and store.get("c") is entries["c"] and store.get("d") is entries["d"]
    assert store.pop("c") is entries["c"] and store.pop("c") is None
    none = ResponseStore(capacity=0)
    none.put("a", entries["a"])
    assert none.get("a") is None


def test_the_stores_bound_is_a_server_flag() -> None:
    assert ServerSettings.from_args(serve_parser().parse_args([])).max_stored_responses == 1024
    none = ServerSettings.from_args(serve_parser().parse_args(["--max-stored-responses", "0"]))
    assert none.max_stored_responses == 0
    with pytest.raises(ValueError, match="--max-stored-responses must be >= 0"):
        ServerSettings.from_args(serve_parser().parse_args(["--max-stored-responses", "-1"]))
