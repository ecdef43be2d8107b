"""How a chat request's template options are read, and how one reply's text becomes the API's message:
the reasoning split off first (the server's `--reasoning-parser`), tool calls read from the answer
only (`tools.ToolReply`).

Every route that renders a chat takes the same steps (chat completions' `ChatReply` below is one
use of them; the Responses API's `responses.items.OutputBuilder` and the Messages API's
`anthropic_messages.MessageReply` are the others):

    options = template_options(kwargs, serving.settings.default_chat_template_kwargs)
    prompt = await serving.prepare(serving.render_chat_prompt, messages, tool_plan, **options)
    reasoning = plan_reasoning(serving.reasoning_parser, prompt.text, options["chat_template_kwargs"],
                               constrained and not serving.constraints_after_reasoning)
    # build_requests(keep_special=... or serving.keep_reasoning_special)
    split = reasoning.reply()  # per choice; None when the server splits nothing
    thought, answer = split.feed(out.text, out.finished)  # deltas; the answer so far goes to ToolReply.feed

The APIs without `chat_template_kwargs` turn thinking on or off with their own fields (the Responses
API's `reasoning.effort`, the Messages API's `thinking`): `switch_kwargs` sets the switches the
template reads, and none where it reads none, so that the template's default stands.

A constrained reply (`response_format`, a grammar, a forced tool call) reasons first, as vLLM's, where
the engine knows the parser's markers (`Serving.constraints_after_reasoning`): the constraint applies
to the answer after the block (`reasoning_state`), and the reply is read as an unconstrained one.
Elsewhere (gpt-oss's channels without `--reasoning-config`; vLLM's `enable_in_reasoning`) it is read
from its first token, which the constraint writes: its reasoning is split only where the constraint
itself opens the block.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta

from ..reasoning import SWITCHES, ReasoningParser, thinking_switch
from .protocol import ChatCompletionRequest
from .tools import ToolPlan, ToolReply


def template_options(chat_template_kwargs: dict[str, Any] | None, defaults: dict[str, Any] | None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False) -> dict[str, Any]:
    """The renderer's options (`LLM.render_chat_text`): the template's variables (the server's
    defaults under the request's), and the generation prompt or the last message continued."""
    return {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
            "chat_template_kwargs": (defaults or {}) | (chat_template_kwargs or {})}


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads (jinja2's own analysis), so that only the switches it takes
    are set; every word of it where jinja2 alone cannot parse it (a tag of transformers' own)."""
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return frozenset(re.findall(r"\w+", template))
    return frozenset(meta.find_undeclared_variables(parsed))


def switch_kwargs(template: str, thinking: bool | None) -> dict[str, Any]:
    """Thinking on or off as the template variables of the switches the template reads (`enable_thinking`,
    `thinking`): none when `thinking` is None or the template reads no switch."""
    if thinking is None:
        return {}
    return {key: thinking for key in SWITCHES if key in template_variables(template)}


def effort_kwargs(template: str, effort: str | None) -> dict[str, Any]:
    """A reasoning effort (chat's `reasoning_effort`, the Responses API's `reasoning.effort`) as template
    variables, as vLLM reads it: "none" turns the template's thinking switch off, any other effort on
    (`switch_kwargs`: none set where the template reads none); a template that reads `reasoning_effort`
    (gpt-oss's) gets the effort itself."""
    kwargs = switch_kwargs(template, None if effort is None else effort != "none")
    if effort is not None and "reasoning_effort" in template_variables(template):
        kwargs["reasoning_effort"] = effort
    return kwargs


def role_and_echo(body: ChatCompletionRequest, response_role: str = "assistant") -> tuple[str, str]:
    """The reply's role (`response_role`, vLLM's --response-role; the last message's, continued, when no
    generation prompt is added) and the text `echo` puts before its content (the last message's, when it
    has the reply's role)."""
    last = body.messages[-1]
    role = response_role if body.add_generation_prompt else last.role
    if not body.echo or last.role != role:
        return role, ""
    content = last.content
    return role, content if isinstance(content, str) else "\n".join(p.text or "" for p in content or [])


@dataclass
class ReasoningPlan:
    """How one request's replies are split: the parser (None: not split), the prompt they continue and
    the thinking switch; `include`: the reasoning is sent (vLLM's `include_reasoning`)."""

    parser: type[ReasoningParser] | None = None
    prompt: str = ""
    thinking: bool | None = None
    include: bool = True

    def reply(self) -> ReasoningParser | None:
        """A parser for one reply (None when the replies are not split)."""
        return None if self.parser is None else self.parser(self.prompt, self.thinking)


def plan_reasoning(parser: type[ReasoningParser] | None, prompt: str, chat_template_kwargs: dict[str, Any] | None,
                   constrained: bool, include: bool = True) -> ReasoningPlan:
    """The plan for a request rendered to `prompt`, with its template kwargs; `constrained`: its output
    is constrained from the first token (a reply that begins outside any block; not where the engine
    follows the reasoning, whose constraint starts after it)."""
    if parser is None:
        return ReasoningPlan()
    if constrained:
        return ReasoningPlan(parser, "", False, include)
    return ReasoningPlan(parser, prompt, thinking_switch(chat_template_kwargs), include)


class ChatReply:
    """One choice of a chat completion, fed its growing text: OpenAI's deltas, then the whole message.
    `echo`: text the content begins with (the last message, vLLM's `echo`); `role`: the reply's."""

    def __init__(self, reasoning: ReasoningPlan, tools: ToolPlan, role: str = "assistant", echo: str = "") -> None:
        self.split = reasoning.reply()
        self.include = reasoning.include
        self.tools: ToolReply | None = tools.reply() if tools.active else None
        self.role, self.echo = role, echo
        self.thoughts = ""
        self.answer = ""  # the answer's text so far, what the tool parser reads
        self.sent = 0  # without tools: characters of the answer sent

    def opening(self) -> dict[str, Any]:
        """The first delta of a stream: the role, and the echoed text."""
        return {"role": self.role, "content": self.echo}

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        """The delta since the last feed of this growing text."""
        delta: dict[str, Any] = {}
        if self.split is None:
            self.answer = text
        else:
            reasoning, answer = self.split.feed(text, finished)
            self.thoughts += reasoning
            self.answer += answer
            if reasoning and self.include:
                delta = {"reasoning_content": reasoning, "reasoning": reasoning}
        if self.tools is not None:
            return delta | self.tools.feed(self.answer, finished)
        if len(self.answer) > self.sent:
            delta["content"], self.sent = self.answer[self.sent:], len(self.answer)
        return delta

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as a chat message (after no feed)."""
        if self.split is None:
            self.answer = text
        else:
            self.thoughts, self.answer = self.split.feed(text, True)
        message = self.tools.message(self.answer) if self.tools is not None else {"content": self.answer}
        content = message.get("content")
        if self.split is not None:
            content = content or None
            thoughts = (self.thoughts or None) if self.include else None
            message |= {"reasoning_content": thoughts, "reasoning": thoughts}
        if self.echo:
            content = self.echo + (content or "")
        return {"role": self.role} | message | {"content": content}

    def finish_reason(self, reason: str | None) -> str | None:
        return reason if self.tools is None else self.tools.finish_reason(reason)
