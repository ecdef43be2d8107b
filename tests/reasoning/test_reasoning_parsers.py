"""Reasoning split from recorded model output, per format (most outputs are those of vLLM's own
reasoning parser tests, tests/reasoning/), whole and streamed at every cut; the prompt's end decides
whether a reply begins inside the block."""

from __future__ import annotations

import pytest

from conveyor.reasoning import REASONING_PARSERS, get_reasoning_parser, thinking_switch

QWEN_OPEN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # Qwen3 2507 thinking template
QWEN_OFF = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking false
QWEN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # Qwen3's first template: the model opens it
QWEN_ASKS = "<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n"
R1 = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n"
V31_ON, V31_OFF = "<｜User｜>Hi<｜Assistant｜><think>", "<｜User｜>Hi<｜Assistant｜></think>"
MAGISTRAL = ("[SYSTEM_PROMPT]Draft your thinking as: [THINK]thoughts[/THINK]answer[/SYSTEM_PROMPT]"
             "[INST]Hi[/INST]")  # markers early in the prompt are text; its end decides
HARMONY = "<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant"
TOOL_CALL = "<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"
HY_THINK, HY_ANSWER, HY_END = "<think>\n", "\n</think>\n<answer>\n", "\n</answer>"
GRANITE_THINK, GRANITE_ANSWER = "Here is my thought process:", "Here is my response:"
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|end|><|start|>assistant<|channel|>final"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location": "Tokyo"}<|call|>')

# (parser, prompt, thinking switch, model output, reasoning, answer)
RECORDED = [
    ("deepseek_r1", "", None, "This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("deepseek_r1", "", None, "This is a reasoning section</think>", "This is a reasoning section", None),
    ("deepseek_r1", "", None, "This is content", "This is content", None),  # R1 may leave <think> out
    ("deepseek_r1", "", None, "This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("deepseek_r1", "", None, "</think>This is the rest", None, "This is the rest"),
    ("deepseek_r1", "", None, "<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("deepseek_r1", "", None, "\n<think>This is a reasoning section</think>\nThis is the rest",
     "This is a reasoning section", "This is the rest"),
    ("deepseek_r1", "", None, "", None, None),
    ("deepseek_r1", R1, None, "Okay, 2 + 2 is basic.\n</think>\n\n2 + 2 = **4**.", "Okay, 2 + 2 is basic.",
     "2 + 2 = **4**."),
    ("deepseek_r1", "", False, "A plain answer.", None, "A plain answer."),
    ("qwen3", QWEN_OPEN, None, "This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("qwen3", QWEN_OPEN, None, "This is a reasoning section", "This is a reasoning section", None),  # at the limit
    ("qwen3", QWEN_OPEN, None, "The <think> tag opens it.</think>Done", "The <think> tag opens it.", "Done"),
    ("qwen3", QWEN_OPEN, None, "I need to read the file.\n</think>\n\n" + TOOL_CALL, "I need to read the file.",
     TOOL_CALL),
    ("qwen3", QWEN, None, "<think>\nThis is a reasoning\nsection\n</think>\n\nThis is the rest\nThat",
     "This is a reasoning\nsection", "This is the rest\nThat"),
    ("qwen3", QWEN, None, "<think>This is a reasoning section", "This is a reasoning section", None),
    ("qwen3", QWEN, None, "<think>reasoning</think>", "reasoning", None),
    ("qwen3", QWEN, None, "This is the rest", None, "This is the rest"),
    ("qwen3", QWEN, None, " Paris.\n", None, " Paris.\n"),  # an answer alone is as written
    ("qwen3", QWEN_OPEN, None, "Hmm.\n</think>\n\n Paris.\n", "Hmm.", "Paris.\n"),  # after a block: no separator
    ("qwen3", QWEN, None, "Use <think> tags.", None, "Use <think> tags."),  # not where the reply begins: text
    ("qwen3", QWEN_ASKS, None, "It opens a block.", None, "It opens a block."),
    ("qwen3", QWEN_OFF, False, "Some output without think tokens", None, "Some output without think tokens"),
    ("qwen3", QWEN_OFF, False, "I need to read the file.\n\n" + TOOL_CALL, None,
     "I need to read the file.\n\n" + TOOL_CALL),
    ("deepseek_v3", V31_ON, True, "Let me think.</think>Hello!", "Let me think.", "Hello!"),
    ("deepseek_v3", V31_OFF, False, "Hello!", None, "Hello!"),
    ("mistral", "[INST]Hi[/INST]", None, "[THINK]This is a reasoning section[/THINK]This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("mistral", "[INST]Hi[/INST]", None, "[THINK]This is a reasoning section", "This is a reasoning section", None),
    ("mistral", "[INST]Hi[/INST]", None, "This is content", None, "This is content"),
    ("mistral", "[INST]Hi[/INST][THINK]", None, "This\nThat[/THINK]This is the rest\nThat", "This\nThat",
     "This is the rest\nThat"),
    ("mistral", MAGISTRAL, None, "[THINK]Greet back.[/THINK]Hello!", "Greet back.", "Hello!"),
    ("hunyuan_a13b", "", None, f"{HY_THINK}This is a reasoning section{HY_ANSWER}This is the rest{HY_END}",
     "This is a reasoning section", "This is the rest"),
    ("hunyuan_a13b", "", None, f"{HY_THINK}{HY_ANSWER}This is the rest{HY_END}", None, "This is the rest"),
    ("hunyuan_a13b", "", None, f"{HY_THINK}This is a reasoning section!{HY_ANSWER}", "This is a reasoning section!",
     None),
    ("hunyuan_a13b", "", None, "This is content", None, "This is content"),
    ("hunyuan_a13b", "", None, f"{HY_THINK}This\nThat{HY_ANSWER}This is the rest\nThat", "This\nThat",
     "This is the rest\nThat"),
    ("granite", "", None, f"{GRANITE_THINK}This is a reasoning section{GRANITE_ANSWER}This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("granite", "", None, f"{GRANITE_THINK}This is a reasoning section{GRANITE_ANSWER}",
     "This is a reasoning section", None),
    ("granite", "", None, "This is content", None, "This is content"),
    ("granite", "", None, f"{GRANITE_THINK}This\nThat{GRANITE_ANSWER}This is the rest\nThat", "This\nThat",
     "This is the rest\nThat"),
    ("granite", "", None, "Here's my thought process: foo Here is bar Here's my response: baz", "foo Here is bar",
     "baz"),
    ("granite", "", None, "Here is my thought failure", None, "Here is my thought failure"),
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}This is reasoning{FINAL}<|message|>This is the rest",
     "This is reasoning", "This is the rest"),
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}This is reasoning<|end|>", "This is reasoning", None),
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}This is reasoning{FINAL}", "This is reasoning", None),
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}This is reasoning{FINAL}<|constrain|> JSON <|message|>This is the "
     "rest", "This is reasoning", "This is the rest"),
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}This is reasoning{FINAL}<|constrain|>ReplyAction <|message|>This is "
     "the rest", "This is reasoning", "This is the rest"),
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}First.<|end|><|start|>assistant{ANALYSIS}Second.{FINAL}<|message|>"
     "Done.", "First.\nSecond.", "Done."),
    ("openai_gptoss", HARMONY, None, f"{ANALYSIS}Need the weather.<|end|>{CALL}", "Need the weather.", CALL),
    ("openai_gptoss", HARMONY + "<|channel|>final<|message|>", None, "Hi there", None, "Hi there"),
    ("openai_gptoss", "", None, "Plain text, no harmony", None, "Plain text, no harmony"),
]


def split(name: str, prompt: str, thinking: bool | None, pieces: list[str]) -> tuple[str, str]:
    """The deltas of feeding the growing text piece by piece, concatenated."""
    parser, text, reasoning, answer = get_reasoning_parser(name)(prompt, thinking), "", "", ""
    for k, piece in enumerate(pieces):
        text += piece
        r, a = parser.feed(text, finished=k == len(pieces) - 1)
        reasoning, answer = reasoning + r, answer + a
    return reasoning, answer


@pytest.mark.parametrize("name, prompt, thinking, text, reasoning, answer", RECORDED,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(RECORDED)])
def test_recorded_outputs_split_whole_and_at_every_cut(name: str, prompt: str, thinking: bool | None, text: str,
                                                       reasoning: str | None, answer: str | None) -> None:
    assert get_reasoning_parser(name)(prompt, thinking).parse(text) == (reasoning, answer)
    whole = (reasoning or "", answer or "")
    for cut in range(len(text) + 1):
        assert split(name, prompt, thinking, [text[:cut], text[cut:]]) == whole, cut
    for step in (1, 3, 7):
        assert split(name, prompt, thinking, [text[i:i + step] for i in range(0, len(text), step)] or [""]) == whole


def test_reasoning_streams_as_it_comes_and_a_partial_marker_waits() -> None:
    parser = get_reasoning_parser("qwen3")(QWEN_OPEN)
    assert parser.feed("Let me", False) == ("Let me", "")
    assert parser.feed("Let me count </thi", False) == (" count", "")  # the space waits for what follows
    assert parser.feed("Let me count </think>\n\n", False) == ("", "")
    assert parser.feed("Let me count </think>\n\nThree.", True) == ("", "Three.")
    start = get_reasoning_parser("qwen3")(QWEN)
    assert start.feed("<thi", False) == ("", "")  # may open the block: nothing sent yet
    assert start.feed("<thin", True) == ("", "<thin")


def test_the_prompts_end_decides_where_the_reply_begins() -> None:
    qwen, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert qwen.prompt_state(QWEN_OPEN) == "open" and qwen.prompt_state(QWEN_OFF) == "closed"
    assert qwen.prompt_state(QWEN_ASKS) is None and qwen.prompt_state("") is None
    assert qwen(QWEN_OPEN, thinking=False).parse("x") == ("x", None)  # the template opened it: it is open
    assert r1("", thinking=False).parse("x") == (None, "x")  # a constrained reply, or thinking off
    assert r1(R1 + "\n\n</think>\n\n").parse("x") == (None, "x")


def test_names_are_vllms_and_an_unknown_one_lists_them() -> None:
    assert {"deepseek_r1", "qwen3", "openai_gptoss", "granite", "hunyuan_a13b", "mistral"} <= set(REASONING_PARSERS)
    assert get_reasoning_parser("gpt_oss") is get_reasoning_parser("openai_gptoss")
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'; choose from deepseek_r1, qwen3"):
        get_reasoning_parser("o1")


@pytest.mark.parametrize("kwargs, switch", [(None, None), ({}, None), ({"enable_thinking": False}, False),
                                            ({"thinking": True}, True), ({"enable_thinking": "no"}, None),
                                            ({"enable_thinking": True, "thinking": False}, True)])
def test_the_thinking_switch_is_read_off_the_template_kwargs(kwargs: dict | None, switch: bool | None) -> None:
    assert thinking_switch(kwargs) is switch
