"""The request body of `POST /v1/responses` (OpenAI's Responses API): the fields Conveyor honours.

As the other bodies (`server/protocol.py`): strict types (no `"5"` for an integer), unknown fields
ignored, fields that would change the result and cannot be honoured refused (`conversation`, `prompt`
templates); the models carry the limits the server enforces, so that the OpenAPI schema documents
them. Input items are the text kinds a chat template can render: messages (`input_text` /
`output_text` parts; images, files and audio are named here so that the handler can refuse them with
a clear 400), `function_call` and `function_call_output` items, and `reasoning` items (a client sends
back a whole earlier output: their `reasoning_text` goes to a template that renders an assistant's
reasoning, `responses.items.item_turns`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ..protocol import LOGPROBS, MAX_NEW, SERVED_NAME, RequestBody, SamplerFields


class ContentPart(RequestBody):
    type: Literal["input_text", "output_text", "input_image", "input_file", "input_audio"]  # text ones served
    text: str = ""


class MessageItem(RequestBody):
    type: Literal["message"] | None = None  # OpenAI's "easy" input message leaves it out
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(RequestBody):
    """A call the model made (an earlier output item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestBody):
    """The result of a call, for the model's next turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningText(RequestBody):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(RequestBody):
    """An earlier reasoning item; its summary and encrypted content are ignored (this server writes neither)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls are always strict (`server/tools.py`)


class NamedFunction(RequestBody):
    type: Literal["function"]
    name: str


class TextFormat(RequestBody):
    type: Literal["text"]


class JSONObjectFormat(RequestBody):
    type: Literal["json_object"]


class JSONSchemaFormat(RequestBody):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestBody):
    format: TextFormat | JSONObjectFormat | JSONSchemaFormat | None = None


class Reasoning(RequestBody):
    """As vLLM reads it: "none" turns the chat template's thinking switch off, any other effort on
    (`replies.effort_kwargs`); echoed in the response."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


# OpenAI's `include` values: only the messages' logprobs change what this server answers (it runs no
# built-in tools and keeps reasoning in plain text, so there is nothing else to include)
Include = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "code_interpreter_call.outputs",
                  "computer_call_output.output.image_url", "file_search_call.results",
                  "message.input_image.image_url", "web_search_call.action.sources", "web_search_call.results"]


class ResponsesRequest(SamplerFields):
    """OpenAI's fields, then vLLM's extra sampling fields (`SamplerFields`, as chat's) and its
    `chat_template_kwargs` and `include_reasoning`."""

    model: str | None = Field(None, json_schema_extra=SERVED_NAME)  # null or "" = the served model
    input: Annotated[str, Field(min_length=1)] | list[InputItem]
    instructions: str | None = None  # a system turn first; not carried over by previous_response_id
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, json_schema_extra=MAX_NEW)  # None: the rest of the context
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None  # OpenAI's default: true
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: list[Include] | None = None
    top_logprobs: int | None = Field(None, ge=0, json_schema_extra=LOGPROBS)  # with include's output_text.logprobs
    truncation: Literal["auto", "disabled"] | None = None  # "auto": the oldest turns dropped until the input fits
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    store: bool = True
    stream: bool = False
    background: bool = False  # needs store; not with stream
    user: str | None = None
    # taken and echoed, changing nothing here: calls of built-in tools (there are none), OpenAI's billing tier,
    # cache routing key (the prefix cache needs none) and abuse-monitoring id
    max_tool_calls: int | None = Field(None, ge=1)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's variables
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning items out of the output
    conversation: None = None  # OpenAI's conversations: not supported
    prompt: None = None  # OpenAI's stored prompt templates: not supported

    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])
