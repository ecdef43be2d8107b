"""Tool-call formats whose arguments are JSON: Hermes blocks, Llama 3's bare objects, Mistral's
`[TOOL_CALLS]`, Granite's marked lists and DeepSeek's call tokens (vLLM's parser names)."""

from __future__ import annotations

import random
import re
import string

from .base import (
    Region,
    ToolParser,
    arguments_text,
    call_from_object,
    calls_from_json,
    incomplete,
    json_end,
    load_json,
    skip_spaces,
)


class HermesParser(ToolParser):
    name = "hermes"
    families = "Hermes 2 Pro / 3, Qwen 2.5, Qwen 3, QwQ, SmolLM3, and the default"
    example = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    starts = ("<tool_call>",)
    close = "</tool_call>"

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        close = text.find(self.close, at)
        if close < 0 and not finished:
            return None
        body = text[at + len(marker):close if close >= 0 else len(text)]
        return Region(close + len(self.close) if close >= 0 else len(text), calls_from_json(body.strip()))


class Llama3JsonParser(ToolParser):
    """A call object anywhere in the reply (`"parameters"` or `"arguments"`), calls separated by `;`;
    `<|python_tag|>` before them is dropped."""

    name = "llama3_json"
    families = "Llama 3.1, 3.2, 3.3 (JSON tool calls), Llama 4 (`llama4_json`)"
    example = '{"name": "f", "parameters": {"x": 1}}'
    starts = ("<|python_tag|>", "{")
    special = ("<|python_tag|>",)
    OPENING = re.compile(r'\{\s*(?:"|$)')  # what a call object can begin with

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        if marker != "{":
            return Region(at + len(marker), [])
        if not self.OPENING.match(text, at):  # prose with a brace in it: content at once
            return Region(at + 1, None)
        end = json_end(text, at)
        if end is None:
            return incomplete(text, finished)
        ok, value = load_json(text[at:end])
        call = call_from_object(value, require_arguments=True) if ok else None
        if call is None:
            return Region(end, None)
        after = skip_spaces(text, end)
        if after == len(text) and not finished:
            return None  # a `;` and another call may follow
        return Region(after + 1 if after < len(text) and text[after] == ";" else end, [call])


class MistralParser(ToolParser):
    """`[TOOL_CALLS]name{...}` (or `name[ARGS]{...}`) per call since the v11 tokenizer;
    `[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]` before. Call ids are 9 letters or digits, as
    Mistral's chat templates require of the ids sent back."""

    name = "mistral"
    families = "Mistral 7B v0.3, Mixtral, Mistral Nemo / Small / Large, Ministral, Devstral, Magistral"
    example = '[TOOL_CALLS]f{"x": 1}  (before v11: [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}])'
    starts = ("[TOOL_CALLS]",)
    special = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    HEAD = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\s*")

    @staticmethod
    def new_id() -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        pos = skip_spaces(text, at + len(marker))
        if pos == len(text):
            return incomplete(text, finished)
        if text[pos] in "[{":  # before v11: JSON
            end = json_end(text, pos)
            return incomplete(text, finished) if end is None else Region(end, calls_from_json(text[pos:end]))
        brace = text.find("{", pos)
        if brace < 0:
            return incomplete(text, finished)
        head = self.HEAD.fullmatch(text, pos, brace)
        if head is None:
            return Region(brace, None)
        end = json_end(text, brace)
        if end is None:
            return incomplete(text, finished)
        ok, value = load_json(text[brace:end])
        return Region(end, [(head.group(1), arguments_text(value))] if ok and isinstance(value, dict) else None)


class GraniteParser(ToolParser):
    """A JSON list of call objects after `<|tool_call|>` (Granite 3.0) or `<tool_call>` (3.1 and later);
    one object closed by `</tool_call>` (Granite 4) too."""

    name = "granite"
    families = "IBM Granite 3.0 - 3.3, Granite 4"
    example = '<|tool_call|>[{"name": "f", "arguments": {"x": 1}}]'
    starts = ("<|tool_call|>", "<tool_call>")
    special = ("<|tool_call|>",)
    close = "</tool_call>"

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        pos = skip_spaces(text, at + len(marker))
        end = json_end(text, pos)
        if end is None:
            return incomplete(text, finished)
        calls = calls_from_json(text[pos:end])
        after = skip_spaces(text, end)
        if text.startswith(self.close, after):
            end = after + len(self.close)
        elif self.close.startswith(text[after:]) and not finished:
            return None  # the closing tag may follow
        return Region(end, calls)


class DeepSeekV3Parser(ToolParser):
    """`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a ```json block + `<｜tool▁call▁end｜>`
    per call, inside `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>` (dropped)."""

    name = "deepseek_v3"
    families = "DeepSeek V3, R1 (0528)"
    example = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"x\": 1}\n```"
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    BEGIN, END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    MARKUP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    starts = (BEGIN, *MARKUP)
    special = (BEGIN, END, "<｜tool▁sep｜>", *MARKUP)
    BODY = re.compile(r"\s*\w*<｜tool▁sep｜>(.+?)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        if marker != self.BEGIN:
            return Region(at + len(marker), [])
        close = text.find(self.END, at)
        if close < 0:
            return incomplete(text, finished)
        body = self.BODY.fullmatch(text, at + len(marker), close)
        ok, value = load_json(body.group(2).strip()) if body else (False, None)
        return Region(close + len(self.END), [(body.group(1).strip(), arguments_text(value))] if body and ok else None)


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek V3.1's calls: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

    name = "deepseek_v31"
    families = "DeepSeek V3.1"
    example = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"x\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    BODY = re.compile(r"\s*(.+?)<｜tool▁sep｜>(.*)", re.DOTALL)
