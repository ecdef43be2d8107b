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

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..protocol import MAX_NEW, SERVED_NAME, Priority, RequestTimeout

def _integral(value: Any) -> Any:
    """Integral floats (5.0, which JSON Schema counts as an integer) as ints, also inside lists."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_integral(v) for v in value] if isinstance(value, list) else value


class Strict(BaseModel):
    """Strict as the other request bodies: no `"5"` or `true` for an integer; 5.0 is one."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _integral_floats(cls, value: Any) -> Any:
        return _integral(value)


class ContentPart(Strict):
    type: Literal["input_text", "output_text", "input_image", "input_file", "input_audio"]  # text ones served
    text: str = ""


class MessageItem(Strict):
    type: Literal["message"] | None = None  # OpenAI's "easy" input message leaves it out
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(Strict):
    """A call the model made (an earlier output item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Strict):
    """The result of a call, for the model's next turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier reasoning item; its summary and encrypted content are ignored (this server writes neither)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls are always strict (`server/tools.py`)


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(Strict):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | JSONObjectFormat | JSONSchemaFormat | None = None


class Reasoning(Strict):
    """As vLLM reads it: "none" turns the chat template's thinking switch off, any other effort on
    (`replies.effort_kwargs`); echoed in the response."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(Strict):
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
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    store: bool = True
    stream: bool = False
    background: bool = False  # needs store; not with stream
    user: str | None = None
    request_timeout: RequestTimeout = None
    priority: Priority = 0  # vLLM's
    conversation: None = None  # OpenAI's conversations: not supported
    prompt: None = None  # OpenAI's stored prompt templates: not supported
