"""The Responses API through the official openai client, against a server on the built-in model (fp32,
loopback): text, instructions, streaming events, forced function calls and their results (by
previous_response_id and by explicit items), the store, text.format, max_output_tokens, cancel and
disconnects (every KV block back), background responses, and the 4xx answers."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from conveyor import LLM
from conveyor.server import BackgroundServer, ServerSettings

from tests.serving_helpers import long_tiny_llm, random_words, save_long_tiny
from tests.structured_check import check
from tests.utils import idle

WEATHER = {"type": "function", "name": "get_weather", "description": "Forecast for a city", "strict": True,
           "parameters": {"type": "object", "required": ["city", "days"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 16},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
FORECAST = {"type": "object", "required": ["city", "sunny"], "additionalProperties": False,
            "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}}}
ASK = "What will the weather be in Paris for the next 3 days?"
LONG = "Count from 1 to 500, separated by commas."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def url(llm: LLM):
    with BackgroundServer(llm, ServerSettings(served_model_names=["smol"], enable_auto_tool_choice=True)) as url:
        yield url


def settle(llm: LLM) -> None:
    """Until every block is back and no request is left (a cancel's abort lands within a step)."""
    deadline = time.monotonic() + 10
    while not idle(llm):
        assert time.monotonic() < deadline, llm.stats()
        time.sleep(0.02)


def test_text_reply_is_the_chat_reply_with_instructions_as_system(client: openai.OpenAI, llm: LLM) -> None:
    reply = client.responses.create(model="smol", input="What is the capital of France?", instructions="Be brief.",
                                    max_output_tokens=24, temperature=0, metadata={"run": "1"})
    chat = client.chat.completions.create(model="smol", max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}])
    assert reply.output_text == chat.choices[0].message.content and "Paris" in reply.output_text
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.status == "completed"
    assert reply.model == "smol" and reply.instructions == "Be brief." and reply.metadata == {"run": "1"}
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = reply.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert reply.temperature == 0 and reply.top_p == 1 and reply.tool_choice == "none" and reply.tools == []
    assert client.responses.retrieve(reply.id).output_text == reply.output_text
    assert idle(llm)


def test_stream_events_build_the_whole_reply(client: openai.OpenAI, llm: LLM) -> None:
    kwargs = {"model": "smol", "input": "What is the capital of Italy?", "max_output_tokens": 32, "temperature": 0}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                    "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == final.output_text == whole.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id} and final.id == events[0].response.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == text
    assert idle(llm)


def test_forced_function_call_validates_and_streams_like_the_whole(client: openai.OpenAI, llm: LLM) -> None:
    kwargs = {"model": "smol", "input": ASK, "tools": [WEATHER], "max_output_tokens": 48, "temperature": 0,
              "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = client.responses.create(**kwargs)
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    check(json.loads(call.arguments), WEATHER["parameters"])
    assert whole.status == "completed" and whole.tool_choice.name == "get_weather"
    assert whole.tools[0].name == "get_weather" and whole.output_text == ""
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert "response.content_part.added" not in kinds and kinds[-1] == "response.completed"
    added = next(e for e in events if e.type == "response.output_item.added").item
    assert added.type == "function_call" and added.arguments == "" and added.name == "get_weather"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert streamed == done.arguments == events[-1].response.output[0].arguments == call.arguments
    assert idle(llm)


def test_a_call_result_continues_by_previous_id_or_by_explicit_items(client: openai.OpenAI, llm: LLM) -> None:
    first = client.responses.create(model="smol", input=ASK, tools=[WEATHER], max_output_tokens=48, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C all three days."}
    chained = client.responses.create(model="smol", previous_response_id=first.id, input=[result],
                                      max_output_tokens=16, temperature=0)
    explicit = client.responses.create(model="smol", store=False, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result])
    assert chained.previous_response_id == first.id and chained.output_text
    assert (chained.output_text, chained.usage.input_tokens) == (explicit.output_text, explicit.usage.input_tokens)
    # the same conversation again: its full pages came from the prefix cache
    assert explicit.usage.input_tokens_details.cached_tokens >= chained.usage.input_tokens - 16 > 0
    # The first response's whole output goes back as items too (ids and statuses ignored).
    echoed = client.responses.create(model="smol", store=False, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        *[item.model_dump(exclude_none=True) for item in first.output], result])
    assert echoed.output_text == chained.output_text
    assert idle(llm)


def test_store_false_and_deleted_responses_are_not_found(client: openai.OpenAI, url: str) -> None:
    unstored = client.responses.create(model="smol", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    reply = httpx.post(f"{url}/v1/responses", timeout=60,
                       json={"input": "Hi", "max_output_tokens": 2, "previous_response_id": unstored.id})
    assert reply.status_code == 404 and reply.json() == {"error": {
        "message": f"Previous response with id '{unstored.id}' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}}
    stored = client.responses.create(model="smol", input="Hi", max_output_tokens=2, reasoning={"effort": "low"})
    assert stored.reasoning.effort == "low"  # accepted and echoed; nothing reads it yet
    client.responses.delete(stored.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(stored.id)


def test_a_server_that_stores_nothing_answers_but_keeps_nothing(tmp_path_factory: pytest.TempPathFactory) -> None:
    tiny = long_tiny_llm(save_long_tiny(tmp_path_factory.mktemp("no_store"), context=256), num_blocks=64)
    with BackgroundServer(tiny, ServerSettings(max_stored_responses=0)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reply = client.responses.create(model="", input="w5 w6", max_output_tokens=3)
        assert reply.usage.output_tokens <= 3 and reply.store
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(reply.id)
        with pytest.raises(openai.BadRequestError, match="--max-stored-responses"):
            client.responses.create(model="", input="w5 w6", max_output_tokens=3, background=True)
    assert idle(tiny)


def test_output_logprobs_are_chats_and_stream_in_the_deltas(client: openai.OpenAI, llm: LLM) -> None:
    ask = "Name three colours."
    kwargs = {"model": "smol", "input": ask, "max_output_tokens": 12, "temperature": 0}
    reply = client.responses.create(**kwargs, include=["message.output_text.logprobs"], top_logprobs=2)
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": ask}], max_tokens=12,
                                          temperature=0, logprobs=True, top_logprobs=2)
    [part] = reply.output[0].content
    assert part.text == chat.choices[0].message.content and reply.top_logprobs == 2
    assert [lp.model_dump() for lp in part.logprobs] == [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert len(part.logprobs) == reply.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    events = list(client.responses.create(**kwargs, include=["message.output_text.logprobs"], top_logprobs=2,
                                          stream=True))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    final = events[-1].response
    assert [lp.model_dump() for lp in deltas] == [lp.model_dump() for lp in part.logprobs]
    assert final.output[0].content[0].logprobs == part.logprobs
    plain = client.responses.create(**kwargs, top_logprobs=2)  # no include: none, as OpenAI's
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == reply.output_text
    assert idle(llm)


def test_vllms_sampling_fields_are_chats(client: openai.OpenAI, llm: LLM) -> None:
    ask = "Write a short poem about rivers."
    extra = {"seed": 7, "top_k": 20, "min_p": 0.02, "repetition_penalty": 1.1, "presence_penalty": 0.4, "stop": [","]}
    reply = client.responses.create(model="smol", input=ask, max_output_tokens=32, temperature=1.0,
                                    extra_body=extra)
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": ask}],
                                          max_tokens=32, temperature=1.0, extra_body=extra)
    assert reply.output_text == chat.choices[0].message.content and "," not in reply.output_text
    kept = client.responses.create(model="smol", input=ask, max_output_tokens=32, temperature=1.0,
                                   extra_body=extra | {"include_stop_str_in_output": True})
    assert kept.output_text.startswith(reply.output_text) and kept.output_text.endswith(",")
    chosen = client.responses.create(model="smol", input="Pick a colour.", max_output_tokens=8,
                                     extra_body={"structured_outputs": {"choice": ["crimson", "teal"]}})
    assert chosen.output_text in ("crimson", "teal")
    assert idle(llm)


def test_truncation_auto_drops_the_oldest_turns_until_the_input_fits(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tiny = long_tiny_llm(save_long_tiny(tmp_path_factory.mktemp("truncation"), context=256), num_blocks=64)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": random_words(i, 50)} for i in range(7)]
    with BackgroundServer(tiny, ServerSettings()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kwargs = {"model": "", "max_output_tokens": 8, "temperature": 0}
        with pytest.raises(openai.BadRequestError, match="context length") as refused:
            client.responses.create(input=turns, **kwargs)
        assert refused.value.body["code"] == "context_length_exceeded"
        cut = client.responses.create(input=turns, truncation="auto", **kwargs)
        tail = client.responses.create(input=turns[4:], **kwargs)  # 3 turns of 52 tokens and w5 fit; 5 do not
        assert cut.truncation == "auto" and cut.usage.input_tokens == tail.usage.input_tokens == 3 * 52 + 1
        assert cut.output_text == tail.output_text
        again = client.responses.create(input="w9", previous_response_id=cut.id, truncation="auto", **kwargs)
        assert again.usage.input_tokens <= 256 - 8 and again.status != "failed"  # the stored turns are all of them
        with pytest.raises(openai.BadRequestError, match="context length"):  # one turn too long: nothing to drop
            client.responses.create(input=random_words(0, 300), truncation="auto", **kwargs)
    assert idle(tiny)


def test_text_format_json_schema_and_json_object_parse(client: openai.OpenAI, llm: LLM) -> None:
    schema = {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}
    reply = client.responses.create(model="smol", input="Describe the weather in Lima as JSON.", temperature=0,
                                    max_output_tokens=48, text={"format": schema})
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    check(json.loads(reply.output_text), FORECAST)
    loose = client.responses.create(model="smol", temperature=0, max_output_tokens=48,
                                    input="Give the weather in Lima as a JSON object with keys city and sunny.",
                                    text={"format": {"type": "json_object"}})
    assert loose.status == "completed" and isinstance(json.loads(loose.output_text), dict)
    assert idle(llm)


def test_max_output_tokens_ends_incomplete(client: openai.OpenAI, llm: LLM) -> None:
    reply = client.responses.create(model="smol", input=LONG, max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 3 and reply.output[0].status == "incomplete" and reply.completed_at is None
    events = list(client.responses.create(model="smol", input=LONG, max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == reply.output_text
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"
    assert idle(llm)


def test_cancel_or_disconnect_mid_stream_gives_every_block_back(client: openai.OpenAI, llm: LLM) -> None:
    kwargs = {"model": "smol", "input": LONG, "max_output_tokens": 400, "temperature": 0, "stream": True}
    events, cancelled = [], None
    for event in client.responses.create(**kwargs):
        events.append(event)
        if event.type == "response.output_text.delta" and cancelled is None:
            cancelled = client.responses.cancel(events[0].response.id)
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 400
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "error"]
    assert events[-1].code == "response_cancelled" and events[-2].item.status == "incomplete"
    assert client.responses.cancel(cancelled.id).status == "cancelled"  # again: the same answer
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model="smol", input="Hi", max_output_tokens=1).id)
    settle(llm)

    with client.responses.create(**kwargs) as stream:  # the client leaves after the first token
        first = next(e for e in stream if e.type == "response.created").response.id
        next(e for e in stream if e.type == "response.output_text.delta")
    deadline = time.monotonic() + 10
    while (left := client.responses.retrieve(first)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert left.status == "cancelled" and left.usage.output_tokens < 400 and left.output[0].content[0].text
    settle(llm)


def test_background_responses_run_without_the_client(client: openai.OpenAI, llm: LLM) -> None:
    started = client.responses.create(model="smol", input="Hi", max_output_tokens=8, temperature=0, background=True)
    assert started.status == "in_progress" and started.background and started.output == []
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(started.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.status in ("completed", "incomplete") and done.output_text
    long = client.responses.create(model="smol", input=LONG, max_output_tokens=400, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 400
    settle(llm)


def test_an_engine_failure_is_a_500_or_a_failed_stream(client: openai.OpenAI, llm: LLM,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(chunks: object) -> None:
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    with pytest.raises(openai.InternalServerError, match="simulated device failure"):
        client.responses.create(model="smol", input="Hi", max_output_tokens=4)
    events = list(client.responses.create(model="smol", input="Hi", max_output_tokens=4, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "simulated device failure" in failed.error.message
    assert client.responses.retrieve(failed.id).status == "failed"
    monkeypatch.undo()
    assert client.responses.create(model="smol", input="Hi", max_output_tokens=2).status in ("completed", "incomplete")
    settle(llm)


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400,
     "input", "input_image"),
    ({"input": "Hi", "background": True, "stream": True}, 400, "background", "not streamed"),
    ({"input": "Hi", "background": True, "store": False}, 400, "background", "store"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice",
     "nope"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     400, "tool_choice", "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objecto"}}}}, 400,
     "text", "objecto"),
    ({"input": "Hi", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"choice": ["a"]}}, 400,
     "structured_outputs", "give one"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, 400, "top_logprobs",
     "--max-logprobs"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools", "function"),
    ({"input": "Hi", "model": "gpt-5"}, 404, "model", "gpt-5"),
    ({"input": []}, 400, "input", "empty"),
])
def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(url: str, llm: LLM, body: dict, status: int,
                                                                     param: str, words: str) -> None:
    reply = httpx.post(f"{url}/v1/responses", json={"max_output_tokens": 4} | body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = httpx.post(f"{url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2
    assert idle(llm)
