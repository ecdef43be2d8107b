"""Tool calls parsed from recorded model output, per format (the outputs are those of vLLM's own parser
tests, tests/tool_parsers/), whole and streamed; tool-choice plans and their constraints, without a model."""

from __future__ import annotations

import json

import pytest

from conveyor.server.protocol import APIError, ChatMessage
from conveyor.tool_parsers import TOOL_PARSERS, detect_parser, get_parser
from conveyor.tool_parsers.json_formats import HermesParser, MistralParser
from conveyor.server.tools import ToolPlan, conversation, plan_tools, required_calls
from conveyor.structured.strict import close_schema

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
SCRIPT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')
DALLAS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
AREA = {"type": "function", "function": {"name": "calculate_area", "parameters": {"type": "object", "properties": {
    "shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"}}}}}
TYPES = {"type": "function", "function": {"name": "test_types", "parameters": {"type": "object", "properties": {
    "int_param": {"type": "integer"}, "float_param": {"type": "number"}, "bool_param": {"type": "boolean"},
    "str_param": {"type": "string"}, "obj_param": {"type": "object"},
    "maybe_int": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "unit": {"enum": ["C", "F"]}}}}}
DS_WEATHER = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Tokyo\", \"unit\": "
              "\"celsius\"}\n```<｜tool▁call▁end｜>")
DS_HOTELS = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>search_hotels\n```json\n{\"location\": \"Tokyo\", "
             "\"check_in\": \"2025-01-15\"}\n```<｜tool▁call▁end｜>")
MORE_TYPES = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
              "passed_test=True, aliases=['John', 'Johnny'])")

# (parser, model output, content, [(name, arguments)])
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX", "unit": '
     '"fahrenheit"}}\n</tool_call>', None, [("get_current_weather", DALLAS)]),
    ("hermes", SCRIPT, "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", "no tools here", "no tools here", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),  # EOS before closing
    ("hermes", "<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}', None,
     [("searchTool", {"query": "test query", "limit": 10})]),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test1"}}; {"name": "getOpenIncidentsTool", '
     '"parameters": {}}; {"name": "searchTool", "parameters": {"query": "test2"}}', None,
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]),
    ("llama3_json", '<|python_tag|>{"name": "searchTool", "arguments": {"query": "test {value} [complex]", "nested": '
     '{"inner": "more {brackets}"}}}', None,
     [("searchTool", {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}})]),
    ("llama3_json", '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}', None,
     [("parserTool", {"text": 'He said "Hello {world}"'})]),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.',
     "I used {searchTool} for this.", [("searchTool", {"query": "test"})]),
    ("llama3_json", '{"name": "toolWithoutParams"}', '{"name": "toolWithoutParams"}', []),
    ("llama3_json", '{"name": "invalidTool", "parameters": {invalid json}', '{"name": "invalidTool", "parameters": '
     '{invalid json}', []),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', None, [("add", {"a": 3.5, "b": 4})]),
    ("mistral", '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', None,
     [("get_age", {"name": "John Doe"})]),
    ("mistral", 'Hello[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": '
     '"get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]', "Hello",
     [("add", {"a": 3.5, "b": 4}), ("get_current_weather", {"city": "San Francisco", "state": "CA",
                                                            "unit": "celsius"})]),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', None,
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ("mistral", '[TOOL_CALLS]get_current_weather[ARGS]{"city": "San Francisco", "state": "CA", "unit": "celsius"}',
     None, [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]),
    ("qwen3_xml", "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n"
     "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>",
     None, [("get_current_weather", DALLAS)]),
    ("qwen3_xml", "Let me calculate that area for you.<tool_call>\n<function=calculate_area>\n<parameter=shape>\n"
     "circle\n</parameter>\n<parameter=dimensions>\n{\"radius\": 15.5}\n</parameter>\n<parameter=precision>\n3\n"
     "</parameter>\n</function>\n</tool_call>", "Let me calculate that area for you.",
     [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})]),
    ("qwen3_xml", "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n"
     "<parameter=dimensions>\n{\"width\": 10, \n \"height\": 20}\n</parameter>\n</function>\n</tool_call>", None,
     [("get_current_weather", {"city": "Dallas"}),
      ("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}})]),
    ("qwen3_xml", "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>", None,
     [("get_current_weather", {"city": "Dallas"})]),  # no <tool_call> around it
    ("granite", '<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', None,
     [("get_weather", {"city": "Tokyo"})]),
    ("granite", '<|tool_call|> [\n  {"name": "get_weather", "arguments": {"city": "Tokyo"}},\n  {"name": "get_time", '
     '"arguments": {"timezone": "Asia/Tokyo"}}\n]', None,
     [("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})]),
    ("granite", 'Let me check the weather for you.\n<|tool_call|> [{"name": "get_weather", "arguments": {"city": '
     '"Tokyo"}}]\nI\'ll get that information.', "Let me check the weather for you.\n\nI'll get that information.",
     [("get_weather", {"city": "Tokyo"})]),
    ("granite", '<tool_call> [{\n  "name": "test_function",\n  "arguments": {\n    "quoted": "He said \\"hello\\"",\n'
     '    "unicode": "emoji: 🎉"\n  }\n}]', None, [("test_function", {"quoted": 'He said "hello"',
                                                                       "unicode": "emoji: 🎉"})]),
    ("granite", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>', None,
     [("get_weather", {"city": "Tokyo"})]),  # Granite 4
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius')]", None,
     [("get_weather", {"city": "San Francisco", "metric": "celsius"})]),
    ("pythonic", f"[get_weather(city='San Francisco', metric='celsius'), {MORE_TYPES}, get_weather(), "
     "do_something_cool(steps=[], additional_data={})]", None,
     [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
      ("register_user", {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
                         "role": None, "passed_test": True, "aliases": ["John", "Johnny"]}),
      ("get_weather", {}), ("do_something_cool", {"steps": [], "additional_data": {}})]),
    ("pythonic", r"[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]", None,
     [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
    ("pythonic", "[bad(x=b'z'), get_weather(city='San Francisco', metric='celsius')]", None,
     [("get_weather", {"city": "San Francisco", "metric": "celsius"})]),
    ("pythonic", '<|python_start|>[get_weather(city="LA", metric="C")]<|python_end|>', None,
     [("get_weather", {"city": "LA", "metric": "C"})]),
    ("pythonic", "How can I help you today? [1] is a footnote.", "How can I help you today? [1] is a footnote.", []),
    ("pythonic", "[1, 2]", "[1, 2]", []),
    ("olmo3", "<function_calls>\nget_weather(city='San Francisco', metric='celsius')\nregister_user(name=\"John\", "
     "age=37, role=null, passed_test=true, aliases=[\"J\"])\n</function_calls>", None,
     [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
      ("register_user", {"name": "John", "age": 37, "role": None, "passed_test": True, "aliases": ["J"]})]),
    ("olmo3", "Let me check.\n<function_calls>\nget_weather(city=\"LA\", metric=\"C\")\n</function_calls>",
     "Let me check.", [("get_weather", {"city": "LA", "metric": "C"})]),
    ("olmo3", "<function_calls>\nnot a call\n</function_calls>", "<function_calls>\nnot a call\n</function_calls>",
     []),
    ("deepseek_v3", f"<｜tool▁calls▁begin｜>{DS_WEATHER}<｜tool▁calls▁end｜>", None,
     [("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ("deepseek_v3", f"Let me check.<｜tool▁calls▁begin｜>{DS_WEATHER}{DS_HOTELS}<｜tool▁calls▁end｜>", "Let me check.",
     [("get_weather", {"city": "Tokyo", "unit": "celsius"}),
      ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": "
     "\"Tokyo\"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     "```json\n{\"city\": \"Tokyo\"\n```<｜tool▁call▁end｜>", []),  # broken JSON: content, its markup kept
    ("deepseek_v31", "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Tokyo\"}"
     "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Sure.",
     [("get_weather", {"city": "Tokyo"}), ("get_time", {})]),
]


def whole(name: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = get_parser(name)([AREA["function"], TYPES["function"]]).parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", RECORDED,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(RECORDED)])
def test_recorded_outputs_parse_whole_and_streamed_alike(name: str, text: str, content: str | None,
                                                         calls: list) -> None:
    assert whole(name, text) == (content, calls)
    for step in (1, 2, 5, 11):  # the deltas concatenated equal the whole reply, however the text is cut
        parser, streamed, got = get_parser(name)([AREA["function"], TYPES["function"]]), "", []
        for end in range(step, len(text) + step, step):
            piece, new = parser.feed(text[:end], finished=end >= len(text))
            streamed += piece
            got += [(c.name, json.loads(c.arguments)) for c in new]
        assert (streamed or None, got) == (content, calls), step


def test_a_partial_marker_is_held_back_and_content_streams_before_the_call() -> None:
    parser = HermesParser()
    assert parser.feed("Let me check.\n<tool", finished=False) == ("Let me check.", [])
    assert parser.feed("Let me check.\n<tool_call>\n{\"name\": \"f\", \"arg", finished=False) == ("", [])
    content, calls = parser.feed("Let me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
                                 finished=False)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    assert all(c.id.startswith("call_") for c in calls)


def test_pieces_keep_the_replys_order_of_content_and_calls() -> None:
    reply = 'Checking. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> Done. <tool_call>\n{"name": "g", ' \
            '"arguments": {"x": 1}}\n</tool_call>'
    pieces = HermesParser().pieces(reply, finished=True)
    assert [p if isinstance(p, str) else (p.name, p.arguments) for p in pieces] == [
        "Checking.", ("f", "{}"), "  Done.", ("g", '{"x": 1}')]
    assert HermesParser().feed(reply, finished=True)[0] == "Checking.  Done."  # feed: the same, content joined


def test_qwen3_xml_values_take_the_type_of_their_schema() -> None:
    text = ("<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n<parameter=float_param>\n"
            "3.14\n</parameter>\n<parameter=bool_param>\ntrue\n</parameter>\n<parameter=str_param>\nhello world\n"
            "</parameter>\n<parameter=obj_param>\n{\"key\": \"value\"}\n</parameter>\n<parameter=maybe_int>\n5\n"
            "</parameter>\n<parameter=unit>\nC\n</parameter>\n<parameter=other>\n007\n</parameter>\n</function>\n"
            "</tool_call>")
    assert whole("qwen3_xml", text)[1] == [("test_types", {
        "int_param": 42, "float_param": 3.14, "bool_param": True, "str_param": "hello world",
        "obj_param": {"key": "value"}, "maybe_int": 5, "unit": "C", "other": "007"})]


def test_mistral_call_ids_are_nine_letters_or_digits() -> None:
    _, calls = MistralParser().parse('[TOOL_CALLS]add{"a": 1}')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


@pytest.mark.parametrize("template, name", [
    ("{%- for tool_call in message.tool_calls %}<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ k }}>",
     "qwen3_xml"),
    ("{%- if message.tool_calls %}[TOOL_CALLS][{{ tool_calls|tojson }}]", "mistral"),
    ("<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ tool['type'] }}<｜tool▁sep｜>{{ name }}\n```json\n",
     "deepseek_v3"),
    ("<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>{{ args }}", "deepseek_v31"),
    ("<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}", "granite"),
    ("<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("<|start_header_id|>user<|end_header_id|>Respond in the format {\"name\": function name, \"parameters\": ...}",
     "llama3_json"),
    ("<|header_start|>assistant<|header_end|>", "llama3_json"),
    ("<|python_start|>", "pythonic"),
    ("{{- '<function_calls>' + tool_calls + '</function_calls>' }}", "olmo3"),
    ("<|im_start|>{{- '<tool_call>\\n{\"name\": \"' }}", "hermes"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "hermes"), (None, "hermes"),
])
def test_the_parser_is_read_off_the_chat_template(template: str | None, name: str) -> None:
    assert detect_parser(template) == name


def test_parser_names_are_vllms_and_an_unknown_one_lists_them() -> None:
    assert {"hermes", "llama3_json", "mistral", "qwen3_xml", "qwen3_coder", "granite", "pythonic",
            "deepseek_v3", "deepseek_v31"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="llama3_json"):
        get_parser("hermes2")


def streamed(plan: ToolPlan, text: str, step: int) -> tuple[dict, dict]:
    """(the deltas merged as the openai client does, the whole message)."""
    reply, merged = plan.reply(), {"content": "", "calls": {}}
    for end in range(step, len(text) + step, step):
        delta = reply.feed(text[:end], end >= len(text))
        merged["content"] += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            slot = merged["calls"].setdefault(piece["index"], {"name": "", "arguments": ""})
            slot["name"] += piece.get("function", {}).get("name", "")
            slot["arguments"] += piece["function"].get("arguments", "")
            assert "id" not in piece or piece["id"].startswith("call_")
    return merged, plan.reply().message(text)


@pytest.mark.parametrize("step", [1, 4])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_calls(step: int) -> None:
    required = plan_tools([WEATHER, TIME], "required")
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    merged, message = streamed(required, text, step)
    assert merged["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                               1: {"name": "get_time", "arguments": "{}"}}
    assert message["content"] is None and [c["function"] for c in message["tool_calls"]] == [
        merged["calls"][0], merged["calls"][1]]
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    merged, message = streamed(named, '{"tz": "UTC"}', step)
    assert merged["calls"] == {0: {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    assert message["tool_calls"][0]["function"] == merged["calls"][0]
    merged, message = streamed(plan_tools([WEATHER, TIME], "auto"), SCRIPT, step)
    assert merged["content"] == message["content"] == "Let me check."
    assert [merged["calls"][i] for i in (0, 1)] == [c["function"] for c in message["tool_calls"]]
    single = plan_tools([WEATHER, TIME], "auto", parallel=False)  # as vLLM: only the first call
    merged, message = streamed(single, SCRIPT, step)
    assert list(merged["calls"]) == [0] and len(message["tool_calls"]) == 1


def test_required_calls_reads_the_list_as_it_grows() -> None:
    text = '[{"name": "a\\"b", "arguments": {"s": "}]"}}, {"name": "c", "arguments": {"n": 1'
    assert required_calls(text) == [('a"b', '{"s": "}]"}'), ("c", '{"n": 1')]
    assert required_calls("[") == [] and required_calls('[{"name": "get') == []


def test_required_constraint_is_a_closed_list_of_calls() -> None:
    required = plan_tools([WEATHER, TIME], "required").constraint.json
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    options = required["items"]["anyOf"]
    assert [o["properties"]["name"] for o in options] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert options[0]["properties"]["arguments"] == close_schema(WEATHER["function"]["parameters"])
    assert options[0]["properties"]["arguments"]["additionalProperties"] is False
    assert options[1]["properties"]["arguments"] == {"type": "object"}  # no properties listed: free-form
    assert plan_tools([WEATHER], "required", parallel=False).constraint.json["maxItems"] == 1
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}).constraint
    assert named.json == close_schema(WEATHER["function"]["parameters"])
    assert plan_tools([WEATHER], "auto").constraint is None and not plan_tools(None, None).active
    assert "additionalProperties" not in WEATHER["function"]["parameters"]  # the request is not changed


def test_required_moves_the_tools_definitions_to_the_root() -> None:
    item = {"$defs": {"Item": {"type": "object", "properties": {"id": {"type": "integer"}}}}, "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": item}} for n in ("a", "b")]
    schema = plan_tools(tools, "required").constraint.json
    assert schema["$defs"] == {"Item": close_schema(item["$defs"]["Item"])}
    assert all("$defs" not in o["properties"]["arguments"] for o in schema["items"]["anyOf"])
    other = {"type": "function", "function": {"name": "c", "parameters": item | {"$defs": {"Item": {"type": "null"}}}}}
    with pytest.raises(APIError) as info:
        plan_tools([*tools, other], "required").constraint
    assert info.value.param == "tools"


def test_close_schema_closes_listed_objects_and_tuples_recursively() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {"y": {"type": "string"}}, "additionalProperties": True},
        "free": {"type": "object"}, "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
        "list": {"type": "array", "items": {"type": "object", "properties": {"z": {"type": "number"}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"k": {"type": "string"}}}, {"type": "null"}]}}}
    closed = close_schema(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and "additionalProperties" not in props["free"]
    assert props["pair"]["items"] is False and props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "items" not in schema["properties"]["pair"]


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], "sometimes", "tool_choice"), ([WEATHER], {"type": "function", "function": {"name": "nope"}},
                                              "tool_choice"),
    (None, "required", "tool_choice"), ([{"type": "retrieval"}], "auto", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "auto", "tools"),
])
def test_bad_tools_or_tool_choice_are_400s_naming_the_field(tools, choice, param: str) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_needs_the_servers_flag_as_in_vllm(choice: str | None) -> None:
    with pytest.raises(APIError) as info:
        plan_tools([WEATHER], choice, auto_enabled=False)
    assert info.value.status == 400 and "--enable-auto-tool-choice" in info.value.message
    assert plan_tools([WEATHER], "required", auto_enabled=False).mode == "required"
    assert plan_tools([WEATHER], "none", auto_enabled=False).mode == "none"


def test_tool_messages_are_written_hermes_style_for_a_template_without_tools() -> None:
    messages = [ChatMessage(role="user", content="Weather?"),
                ChatMessage(role="assistant", content=None, tool_calls=[
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]),
                ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    roles = {"user": "user", "assistant": "assistant", "system": "system"}
    turns, tools = conversation(messages, plan_tools([WEATHER], "auto"), "{{ m['content'] }}", roles)
    assert tools is None and turns[0]["role"] == "system" and "<tools>" in turns[0]["content"]
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in turns[2]["content"]
    assert turns[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    turns, tools = conversation(messages, plan_tools([WEATHER], "auto"), "{% if tools %}", roles)
    assert tools == [WEATHER] and turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert turns[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
