"""Reasoning through the Responses and Messages APIs (`--reasoning-parser qwen3`), with the official openai and
anthropic clients against a server on the built-in model whose chat template opens a think block unless
`enable_thinking` is false: a `reasoning` item or a `thinking` block first, then the answer; streamed as the
APIs' reasoning deltas, adding up to the whole reply; the APIs' thinking switches (`reasoning.effort`,
`thinking`) set the template's; earlier reasoning goes back to a template that renders it."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from conveyor import LLM
from conveyor.reasoning.think_tags import Qwen3Parser
from conveyor.server import BackgroundServer

from tests.serving_helpers import THINK_NOTE, THINK_TEMPLATE, settles, think_settings
from tests.utils import greedy

# The built-in model echoes this (greedy), closing the block the template opened: reasoning, then an answer.
ECHO = "Echo: The user greets me.</think>Hello!"
NOTE = {"system_note": THINK_NOTE}  # the server's default template kwargs
OFF = NOTE | {"enable_thinking": False}
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 12}}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", chat_template=THINK_TEMPLATE)


@pytest.fixture(scope="module")
def url(llm: LLM):
    with BackgroundServer(llm, think_settings()) as url:
        yield url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sdk(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)


def reference(llm: LLM, conversation: list[dict[str, Any]], kwargs: dict[str, Any], tokens: int = 40) -> tuple:
    """(reasoning, answer, output) of the greedy reply offline, split as the server splits it."""
    [out] = llm.chat([conversation], greedy(tokens, ignore_eos=False), use_tqdm=False, chat_template_kwargs=kwargs)
    reasoning, answer = Qwen3Parser(llm.render_chat_text(conversation, chat_template_kwargs=kwargs)).parse(out.text)
    return reasoning, answer, out


def without_ids(value: Any) -> Any:
    """A response or message as plain data, its ids and times left out (they differ between two calls), and
    the stream helper's `parsed` text."""
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    if isinstance(value, dict):
        if value.get("cache_read_input_tokens"):  # Anthropic's usage: the prompt counted whole
            value = value | {"input_tokens": value["input_tokens"] + value["cache_read_input_tokens"],
                             "cache_read_input_tokens": 0}
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created_at", "completed_at", "parsed")}
    return without_ids(value.model_dump()) if hasattr(value, "model_dump") else value


# -- the Responses API ----------------------------------------------------------------------------
def test_a_response_is_its_reasoning_item_then_the_message(client: openai.OpenAI, llm: LLM) -> None:
    thought, answer, ref = reference(llm, [{"role": "user", "content": ECHO}], NOTE)
    assert thought and answer and ref.finish_reason == "stop"
    kwargs = {"model": "smol", "input": ECHO, "max_output_tokens": 40, "temperature": 0}
    reply = client.responses.create(**kwargs, reasoning={"effort": "medium"})
    assert reply.status == "completed" and [i.type for i in reply.output] == ["reasoning", "message"]
    item, message = reply.output
    assert item.id.startswith("rs_") and item.summary == [] and item.status == "completed"
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", thought)]
    assert reply.output_text == message.content[0].text == answer and reply.reasoning.effort == "medium"
    usage = reply.usage
    assert (usage.input_tokens, usage.output_tokens) == (ref.num_prompt_tokens, ref.num_output_tokens)
    assert usage.output_tokens_details.reasoning_tokens == len(llm.tokenizer.encode(thought, add_special_tokens=False))
    assert without_ids(client.responses.retrieve(reply.id).output) == without_ids(reply.output)  # stored whole

    with client.responses.stream(**kwargs, reasoning={"effort": "medium"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert without_ids(final) == without_ids(reply)  # greedy: the streamed response is the same
    kinds = [e.type for e in events if getattr(e, "output_index", None) == 0]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-3:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    hidden = client.responses.create(**kwargs, reasoning={"effort": "medium"}, extra_body={"include_reasoning": False})
    assert [i.type for i in hidden.output] == ["message"] and hidden.output_text == answer  # vLLM's field
    settles(llm)


def test_effort_none_turns_thinking_off(client: openai.OpenAI, llm: LLM) -> None:
    _, answer, ref = reference(llm, [{"role": "user", "content": "What is the capital of France?"}], OFF, 16)
    for stream in (False, True):
        kwargs = {"model": "smol", "input": "What is the capital of France?", "max_output_tokens": 16,
                  "temperature": 0, "reasoning": {"effort": "none"}}
        if stream:
            with client.responses.stream(**kwargs) as events:
                reply = events.get_final_response()
        else:
            reply = client.responses.create(**kwargs)
        assert [i.type for i in reply.output] == ["message"] and reply.output_text == answer
        usage = reply.usage
        assert usage.input_tokens == ref.num_prompt_tokens and usage.output_tokens_details.reasoning_tokens == 0
    settles(llm)


def test_chat_reasoning_effort_none_turns_thinking_off(client: openai.OpenAI, llm: LLM) -> None:
    """OpenAI's chat `reasoning_effort`, read as the Responses API's (vLLM's rule); the request's own
    chat_template_kwargs win over it."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    _, answer, ref = reference(llm, question, OFF, 16)
    reply = client.chat.completions.create(model="smol", messages=question, max_tokens=16, temperature=0,
                                           reasoning_effort="none")
    assert reply.choices[0].message.content == answer and reply.usage.prompt_tokens == ref.num_prompt_tokens
    thinking = client.chat.completions.create(model="smol", messages=question, max_tokens=16, temperature=0,
                                              reasoning_effort="none",
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.usage.prompt_tokens == len(llm.render_chat(question, chat_template_kwargs=NOTE))
    assert thinking.usage.prompt_tokens != ref.num_prompt_tokens
    settles(llm)


def test_earlier_reasoning_goes_back_to_the_template(client: openai.OpenAI, llm: LLM) -> None:
    first = client.responses.create(model="smol", input=ECHO, max_output_tokens=40, temperature=0)
    item, message = first.output
    answered = {"role": "assistant", "content": message.content[0].text, "reasoning_content": item.content[0].text}
    conversation = [{"role": "user", "content": ECHO}, answered, {"role": "user", "content": "Thanks."}]
    expected = len(llm.render_chat(conversation, chat_template_kwargs=NOTE))
    follow = client.responses.create(model="smol", previous_response_id=first.id, input="Thanks.", max_output_tokens=1)
    assert follow.usage.input_tokens == expected
    items = [{"role": "user", "content": ECHO}, *[o.model_dump(exclude_none=True) for o in first.output],
             {"role": "user", "content": "Thanks."}]
    sent = client.responses.create(model="smol", input=items, max_output_tokens=1, store=False)
    assert sent.usage.input_tokens == expected
    settles(llm)


def test_a_forced_call_follows_the_reasoning(client: openai.OpenAI, llm: LLM) -> None:
    """As vLLM's: the constraint applies after the block the prompt opened (here cut by a budget)."""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
    ask = "Weather in Paris?"
    kwargs = {"model": "smol", "input": ask, "max_output_tokens": 48, "temperature": 0, "tools": [tool],
              "tool_choice": {"type": "function", "name": "get_weather"}}
    reply = client.responses.create(**kwargs, extra_body={"thinking_token_budget": 4})
    thought, call = reply.output
    assert thought.type == "reasoning" and 0 < len(llm.tokenizer.encode(thought.content[0].text)) <= 4
    assert call.type == "function_call" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    off = client.responses.create(**kwargs, reasoning={"effort": "none"})  # the template closes the block
    [call] = off.output  # the constraint writes the whole reply
    assert call.type == "function_call" and set(json.loads(call.arguments)) == {"city"}
    settles(llm)


# -- the Messages API -----------------------------------------------------------------------------
def create(sdk: anthropic.Anthropic, stream: bool, **kwargs: Any) -> tuple[anthropic.types.Message, list]:
    """A greedy message, whole or as the SDK's stream helper accumulates it, and the stream's events."""
    kwargs = {"model": "smol", "max_tokens": 40, "messages": [{"role": "user", "content": ECHO}],
              "extra_body": {"temperature": 0}} | kwargs
    if not stream:
        return sdk.messages.create(**kwargs), []
    with sdk.messages.stream(**kwargs) as events:
        seen = list(events)
        return events.get_final_message(), seen


def test_a_message_is_its_thinking_block_then_the_text(sdk: anthropic.Anthropic, llm: LLM) -> None:
    thought, answer, ref = reference(llm, [{"role": "user", "content": ECHO}], NOTE)
    enabled = {"type": "enabled", "budget_tokens": 1024}
    whole, _ = create(sdk, False, thinking=enabled)
    assert [b.type for b in whole.content] == ["thinking", "text"] and whole.stop_reason == "end_turn"
    assert (whole.content[0].thinking, whole.content[0].signature, whole.content[1].text) == (thought, "", answer)
    assert (whole.usage.input_tokens + whole.usage.cache_read_input_tokens, whole.usage.output_tokens) == (
        ref.num_prompt_tokens, ref.num_output_tokens)
    streamed, events = create(sdk, True, thinking=enabled)
    assert without_ids(streamed) == without_ids(whole)
    assert "".join(e.thinking for e in events if e.type == "thinking") == thought
    assert [e.signature for e in events if e.type == "signature"] == [""]
    assert without_ids(create(sdk, False)[0]) == without_ids(whole)  # no `thinking`: the template's default, on
    settles(llm)


def test_thinking_disabled_is_text_only(sdk: anthropic.Anthropic, llm: LLM) -> None:
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    _, answer, ref = reference(llm, ask, OFF, 16)
    for stream in (False, True):
        message, _ = create(sdk, stream, messages=ask, max_tokens=16, thinking={"type": "disabled"})
        assert [(b.type, b.text) for b in message.content] == [("text", answer)]
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == ref.num_prompt_tokens
    counted = sdk.messages.count_tokens(model="smol", messages=ask, thinking={"type": "disabled"})
    assert counted.input_tokens == ref.num_prompt_tokens
    settles(llm)


def test_a_forced_tool_use_and_earlier_thinking(sdk: anthropic.Anthropic, llm: LLM) -> None:
    tool = {"name": "get_weather", "input_schema": WEATHER}
    message, _ = create(sdk, False, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                        tool_choice={"type": "tool", "name": "get_weather"}, thinking={"type": "disabled"})
    [use] = message.content  # thinking off (Anthropic's rule with a forced tool): the constraint writes the reply
    assert use.type == "tool_use" and set(use.input) == {"city"} and message.stop_reason == "tool_use"
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
                                               use.model_dump(exclude_none=True)]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    counted = sdk.messages.count_tokens(model="smol", messages=turns, tools=[tool])
    unthought = sdk.messages.count_tokens(model="smol", messages=turns[:1] + [
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]}] + turns[2:], tools=[tool])
    assert counted.input_tokens > unthought.input_tokens  # the template renders the turn's reasoning
    settles(llm)


# -- thinking budgets -----------------------------------------------------------------------------
def test_a_thinking_budget_cuts_the_reasoning_and_the_answer_follows(client: openai.OpenAI, llm: LLM) -> None:
    """The server's qwen3 parser gives the engine its markers (the LLM was built without): vLLM's
    thinking_token_budget on chat, Anthropic's budget_tokens mapped onto it."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    [free] = llm.chat([ask], greedy(40, ignore_eos=False), use_tqdm=False, chat_template_kwargs=NOTE)
    reply = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0,
                                           extra_body={"thinking_token_budget": 3})
    message = reply.choices[0].message.model_dump()
    assert message["reasoning_content"] == llm.tokenizer.decode(free.outputs[0].token_ids[:3]).strip()
    assert message["content"] and "</think>" not in message["content"]
    unbounded = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0,
                                               extra_body={"thinking_token_budget": -1})
    assert unbounded.choices[0].message.model_dump()["reasoning_content"] == Qwen3Parser(
        llm.render_chat_text(ask, chat_template_kwargs=NOTE)).parse(free.outputs[0].text)[0]
    chosen = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0, extra_body={
        "thinking_token_budget": 3, "structured_outputs": {"choice": ["Paris", "Rome"]}}).choices[0].message
    assert chosen.model_dump()["reasoning_content"] == message["reasoning_content"]  # the constraint after it
    assert chosen.content in ("Paris", "Rome")
    settles(llm)


def test_anthropic_budget_tokens_is_the_engines_budget() -> None:
    from conveyor.server.anthropic_messages import sampling_fields
    from conveyor.server.anthropic_protocol import MessagesRequest

    def budget(thinking: dict | None, budgets: bool = True) -> int | None:
        body = MessagesRequest(model="", max_tokens=4096, messages=[{"role": "user", "content": "Hi"}],
                               **({"thinking": thinking} if thinking else {}))
        return sampling_fields(body, budgets).thinking_token_budget

    assert budget({"type": "enabled", "budget_tokens": 2048}) == 2048
    assert budget({"type": "enabled", "budget_tokens": 2048}, budgets=False) is None  # no markers, or a forced call
    assert budget({"type": "adaptive"}) is None and budget(None) is None
