"""Pythonic tool calls: the reply is a Python list of calls with keyword arguments,
`[get_weather(city='Paris', days=3), get_time()]` (Llama 3.2 / 4, ToolACE), Llama 4 wrapping it in
`<|python_start|>` ... `<|python_end|>`; OLMo 3 writes one call a line inside `<function_calls>` ...
`</function_calls>`, its literals JSON's (`true`, `null`) as often as Python's. Arguments are literals,
read with `ast.literal_eval` (never evaluated) and sent as JSON."""

from __future__ import annotations

import ast
import json
import logging
from typing import Any

from .base import Region, ToolParser, incomplete

logger = logging.getLogger("conveyor.server")


def python_list_end(text: str, start: int) -> int | None:
    """Index just past the bracketed Python expression at `start` (quotes and nesting tracked), or None."""
    depth, quote, escaped = 0, "", False
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def dotted(node: ast.expr) -> str | None:
    """`f` or `module.f` as a name; None for any other callee."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def call_of(node: ast.expr) -> tuple[str, str] | None:
    """One list element as (name, arguments JSON): keyword arguments with literal values only."""
    if not isinstance(node, ast.Call) or node.args or (name := dotted(node.func)) is None:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # bytes, sets, inf: no JSON for them
        return None


class PythonicParser(ToolParser):
    name = "pythonic"
    families = "Llama 3.2 (pythonic prompt), Llama 4 (`llama4_pythonic`), ToolACE"
    example = "[f(x=1), g(name='a')]"
    starts = ("<|python_start|>", "<|python_end|>")
    special = starts

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.block = False  # inside Llama 4's <|python_start|> ... <|python_end|>

    def find_start(self, text: str, pos: int) -> tuple[int, str]:
        """A list counts only where the reply (or Llama 4's python block) begins: `[` in prose is content."""
        at, marker = super().find_start(text, pos)
        lead = len(text) - len(text[pos:].lstrip()) if self.block or not self.started else -1
        if 0 <= lead < len(text) and text[lead] == "[" and (at < 0 or lead < at):
            return lead, "["
        return at, marker

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        if marker != "[":
            self.block = marker == self.starts[0]
            return Region(at + len(marker), [])
        end = python_list_end(text, at)
        if end is None:
            return incomplete(text, finished)
        try:
            tree = ast.parse(text[at:end], mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return Region(end, None)
        if not isinstance(tree, ast.List):
            return Region(end, None)
        calls = [call_of(node) for node in tree.elts]
        good = [c for c in calls if c is not None]
        if len(good) < len(calls) and good:  # as vLLM: a call that does not convert is dropped, not its siblings
            logger.warning("pythonic tool call: dropped %d element(s) that are not calls with literal keyword "
                           "arguments", len(calls) - len(good))
        return Region(end, good or None)


class JsonLiterals(ast.NodeTransformer):
    """JSON's `true`, `false` and `null` as the Python constants they mean."""

    VALUES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:  # noqa: N802 (ast's name)
        return ast.Constant(self.VALUES[node.id]) if node.id in self.VALUES else node


class Olmo3Parser(ToolParser):
    name = "olmo3"
    families = "OLMo 3"
    example = "<function_calls>\nf(x=1)\ng(name='a', ok=true)\n</function_calls>"
    starts = ("<function_calls>",)
    closing = "</function_calls>"
    special = (*starts, closing)  # (kept in the decoded reply where a tokenizer holds them as special tokens)

    def region(self, text: str, at: int, marker: str, finished: bool) -> Region | None:
        """One call a line up to the closing tag; a line that is no call makes the whole block content."""
        close = text.find(self.closing, at + len(marker))
        if close < 0:
            return incomplete(text, finished)
        calls = []
        for line in filter(str.strip, text[at + len(marker):close].splitlines()):
            try:
                tree = ast.parse(line.strip(), mode="eval").body
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                return Region(close + len(self.closing), None)
            call = call_of(JsonLiterals().visit(tree))
            if call is None:
                return Region(close + len(self.closing), None)
            calls.append(call)
        return Region(close + len(self.closing), calls or None)
