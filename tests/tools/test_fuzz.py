"""Schemathesis against the server's own OpenAPI schema, every operation, in bounded examples
(`python -m tools.fuzz` is the longer run): no 5xx, every answer documented, schema-breaking bodies
rejected, the server healthy and the pool idle after."""

from __future__ import annotations

import io

import httpx
import pytest

from conveyor import LLM
from conveyor.server import BackgroundServer, ServerSettings

from tests.serving_helpers import long_tiny_llm, save_long_tiny

pytest.importorskip("schemathesis", reason="needs schemathesis (the test extra)")

from tools.fuzz import clamp, fuzz, print_report

KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return long_tiny_llm(save_long_tiny(tmp_path_factory.mktemp("fuzz_tiny"), context=512), num_blocks=256)


def test_schema_carries_the_servers_bounds(llm: LLM) -> None:
    with BackgroundServer(llm, ServerSettings(served_model_names=["tiny"])) as url:
        schema = httpx.get(f"{url}/openapi.json").json()
    text = str(schema)
    assert "x-conveyor-bound" not in text and "HTTPValidationError" not in text and "'422'" not in text
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"enum": ["tiny", ""]} in props["model"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": 511} in props["max_tokens"]["anyOf"]  # 0: with echo
    assert "299" in str(props["prompt"])  # token ids below the vocabulary size
    chat = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]
    assert chat["enum"] == ["system", "developer", "user", "assistant", "tool"]
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(responses) == {"200", "400", "401", "404", "413", "500", "503", "504"}
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


def test_clamp_keeps_values_valid_and_short() -> None:
    body = {"max_tokens": 10**9, "n": 5.0, "prompt": ["a", "b", "c", "d", "e"], "min_tokens": 7}
    assert clamp(body) == {"max_tokens": 8, "n": 3, "prompt": ["a", "b", "c"], "min_tokens": 4}
    assert clamp({"prompt": list(range(10))})["prompt"] == list(range(10))  # one prompt of token ids
    assert clamp({"n": 0, "max_tokens": True}) == {"n": 0, "max_tokens": True}  # invalid stays invalid
    assert clamp([1, 2]) == [1, 2]
    assert clamp({"messages": [{"role": "tool"}]})["max_tokens"] == 8  # absent: not the whole context
    assert clamp({"prompt": [1], "max_tokens": None})["max_tokens"] == 8  # null means absent
    assert "max_tokens" not in clamp({"messages": [], "max_completion_tokens": 3})
    assert clamp({"messages": []}, fill_max_tokens=False) == {"messages": []}  # required (Anthropic's): stays absent
    assert clamp({"input": "hi"}) == {"input": "hi", "max_output_tokens": 8}  # the Responses API
    assert clamp({"input": "hi", "request_timeout": 1e-35}) == {"input": "hi", "max_output_tokens": 8}  # no 504
    assert clamp({"input": [{}] * 5, "max_output_tokens": 99}) == {"input": [{}] * 3, "max_output_tokens": 8}
    tools = [{"type": "function", "name": "f"}]
    named = {"input": "hi", "tools": tools, "tool_choice": {"type": "function", "name": "g"}}
    assert clamp(named)["tool_choice"] == "none"  # names no tool given: a 400 the schema cannot foresee
    assert "structured_outputs" not in clamp({"input": "hi", "structured_outputs": {"x": 1}})
    assert clamp({"input": "hi", "structured_outputs": {"regex": "a+"}})["structured_outputs"] == {"regex": "a+"}
    kept = {"input": "hi", "tools": tools, "tool_choice": {"type": "function", "name": "f"}}
    assert clamp(dict(kept))["tool_choice"] == kept["tool_choice"]
    chat = {"messages": [], "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    assert clamp(chat)["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert clamp({"input": "hi", "tool_choice": "required"})["tool_choice"] == "none"
    assert clamp({"messages": [], "max_tokens": 1, "tool_choice": {"type": "tool", "name": "g"}})["tool_choice"] == {
        "type": "none"}  # Anthropic's shape


def test_fuzz_every_operation(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    with BackgroundServer(llm, ServerSettings(served_model_names=["tiny"], api_key=KEY)) as url:
        report = fuzz(url, examples=12, api_key=KEY, seed=0)
        paths = httpx.get(f"{url}/openapi.json").json()["paths"]
    print_report(report)
    print(capsys.readouterr().out)  # shown with -s
    assert sorted(report.operations) == sorted(f"{m.upper()} {p}" for p, ops in paths.items() for m in ops)
    assert len(report.operations) >= 11
    assert report.server_errors == 0 and not report.failures, report.examples
    assert report.healthy_after
    statuses = report.as_dict()["per_operation"]
    for op in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /tokenize",
               "POST /detokenize"):
        # a body outside the schema is a 400, or a 404 where it also names a model not served (checked first,
        # before the bounds the schema carries from this server's limits, as vLLM does)
        negative = statuses[op]["negative"]
        assert set(negative) <= {400, 404} and negative.get(400, 0) > 0, (op, negative)
        assert statuses[op]["positive"].get(200, 0) >= 6, (op, statuses[op])  # most fitting bodies are served
    for op in ("POST /v1/messages", "POST /v1/messages/count_tokens"):  # Anthropic's: some fitting bodies served
        assert statuses[op]["positive"].get(200, 0) > 0, (op, statuses[op])
    s = llm.stats()
    assert s.running_requests == s.waiting_requests == 0 and s.free_blocks == s.total_blocks


def test_a_request_without_answer_is_a_reported_failure(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout (or reset) on one operation is counted against it and the run goes on to the others."""
    import requests
    import schemathesis

    call = schemathesis.Case.call

    def timing_out(case: schemathesis.Case, *args: object, **kwargs: object) -> object:
        if case.operation.label == "POST /tokenize":
            raise requests.ReadTimeout("read timed out (simulated)")
        return call(case, *args, **kwargs)

    monkeypatch.setattr(schemathesis.Case, "call", timing_out)
    with BackgroundServer(llm, ServerSettings(served_model_names=["tiny"], api_key=KEY)) as url:
        report = fuzz(url, examples=2, api_key=KEY, seed=0)
    buffer = io.StringIO()
    print_report(report, buffer)
    out = buffer.getvalue()
    assert not report.ok and report.failures[("POST /tokenize", "ReadTimeout")] == 4  # 2 positive + 2 negative
    assert report.by_status()[0] == 4 and "FAILED POST /tokenize: ReadTimeout x4" in out and "no answer" in out
    assert sum(n for (op, _, _), n in report.requests.items() if op == "POST /detokenize") == 4  # went on
    assert report.healthy_after
