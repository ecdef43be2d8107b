"""Forced, required and strict-schema outputs of a tiny random model (a byte-level BPE tokenizer that can
spell JSON) under the server's grammars: the replies stop on their own, their arguments parse and
validate against the schema with `additionalProperties` absent read as closed, and streams reassemble
to the whole replies. A random model writes whatever the grammar lets it: only a closed schema stops it."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import transformers
from tokenizers import Tokenizer

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.protocol import ChatCompletionRequest
from conveyor.server.response_format import body_constraint
from conveyor.server.serving import drops_a_marker
from conveyor.structured.strict import close_schema
from conveyor.tool_parsers.json_formats import HermesParser, MistralParser

from tests.serving_helpers import save_json_tiny
from tests.structured_check import check
from tests.utils import idle

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {  # no additionalProperties
    "type": "object", "required": ["city", "unit", "where"],                     # anywhere: read as closed
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]},
                   "where": {"type": "object", "required": ["lat"], "properties": {
                       "lat": {"type": "integer", "minimum": -90, "maximum": 90}}}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]},
                                                           "dst": {"type": "boolean"}}}}}
SCHEMAS = {t["function"]["name"]: close_schema(t["function"]["parameters"]) for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Lima?"}]
@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = save_json_tiny(tmp_path_factory.mktemp("json_tiny"))
    return LLM(path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=256))


@pytest.fixture(scope="module")
def url(llm: LLM):
    with BackgroundServer(llm, ServerSettings(enable_auto_tool_choice=True)) as url:
        yield url


def chat(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str | None, list[dict], str]:
    kwargs = {"model": "", "messages": ASK, "max_tokens": 120, "temperature": 0} | kwargs
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            choice = events.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
    return choice.message.content or None, calls, choice.finish_reason  # a stream's role chunk carries ""


def test_forced_and_required_calls_stop_with_valid_closed_arguments(client: openai.OpenAI, llm: LLM) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    # A sampled list of parallel calls may also repeat calls up to the token limit (a random model, like a small
    # one, can): the seed is one where it stops, so that the test checks every reply whole.
    cases = [dict(stream=s, tools=[WEATHER, CLOCK], tool_choice=c, parallel_tool_calls=p, temperature=t, seed=4)
             for c, p in ((named, True), ("required", False), ("required", True)) for s in (False, True)
             for t in (0.0, 1.0)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda c: chat(client, **c), cases))
    for case, (content, calls, reason) in zip(cases, replies):
        assert reason == "tool_calls" and not content and calls, (case, content, calls, reason)
        if case["tool_choice"] is named or not case["parallel_tool_calls"]:
            assert len(calls) == 1
        for call in calls:
            check(json.loads(call["arguments"]), SCHEMAS[call["name"]])  # closed: no property beyond the listed
    for k in range(0, len(cases), 4):  # streamed == whole (same seed, same sampling)
        assert replies[k] == replies[k + 2] and replies[k + 1] == replies[k + 3]
    assert idle(llm)


def test_a_strict_json_schema_is_closed_and_a_plain_one_is_not(client: openai.OpenAI) -> None:
    schema = WEATHER["function"]["parameters"]
    strict = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    for stream in (False, True):
        content, _, reason = chat(client, stream, response_format=strict)
        assert reason == "stop"
        check(json.loads(content), close_schema(schema))
    plain = ChatCompletionRequest(messages=ASK, response_format={"type": "json_schema", "json_schema": {
        "name": "w", "schema": schema}})
    assert body_constraint(plain)[0].json == schema  # today's JSON Schema reading: open
    closed = ChatCompletionRequest(messages=ASK, response_format=strict)
    assert body_constraint(closed)[0].json == close_schema(schema) != schema


def test_auto_parses_what_the_model_writes(client: openai.OpenAI) -> None:
    """Forced by a regex to a Hermes block (the default parser for a template without tools)."""
    block = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    for stream in (False, True):
        content, calls, reason = chat(client, stream, tools=[WEATHER, CLOCK], tool_choice="auto",
                                      extra_body={"structured_outputs": {"regex": "Sure\\. " + re.escape(block)}})
        assert (content, reason) == ("Sure.", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": "CET"})]


def test_special_tokens_reach_the_text_when_a_parsers_markers_need_them(llm: LLM) -> None:
    bos = llm.tokenizer.bos_token_id
    forced = SamplingParams(max_new_tokens=2, temperature=0, logit_bias={bos: 100})
    kept = SamplingParams(max_new_tokens=2, temperature=0, logit_bias={bos: 100}, skip_special_tokens=False)
    assert [o.text for o in llm.generate(["hi", "hi"], [forced, kept], use_tqdm=False)] == ["", "<s><s>"]
    copy = Tokenizer.from_str(llm.tokenizer.backend_tokenizer.to_str())  # adding tokens changes a backend
    mistral = transformers.PreTrainedTokenizerFast(tokenizer_object=copy,
                                                   additional_special_tokens=["[TOOL_CALLS]"])
    assert drops_a_marker(mistral, MistralParser) and not drops_a_marker(mistral, HermesParser)
