"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`)
and its error object, as the `anthropic` SDK sends and reads them.

As on the OpenAI routes, unknown fields are ignored and the models carry what the server enforces
(ranges, roles and the blocks each role may hold), so that the OpenAPI schema documents what is
accepted. Image and
document blocks are in the schema so that the handler can refuse them with a 400 that says why (the
served models read text only); thinking blocks of earlier turns are the reasoning of their turn, for
a chat template that renders it. Errors on these routes are Anthropic's
`{"type": "error", "error": {"type", "message"}}` with Anthropic's status codes (`anthropic_error`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .protocol import MAX_NEW, SERVED_NAME, Priority, RequestTimeout

MESSAGES_PATH = "/v1/messages"
# The server's status -> Anthropic's (status, error type); other 4xx are invalid_request_error, 5xx api_error.
ERROR_TYPES = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"),
               404: (404, "not_found_error"), 413: (413, "request_too_large"), 500: (500, "api_error"),
               503: (529, "overloaded_error"),  # queue full, shutting down, engine dead: retry later
               504: (504, "timeout_error")}  # past its request_timeout


def anthropic_path(path: str) -> bool:
    """Whether `path` is one of the Messages routes, whose errors are Anthropic's."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error the server answers with `status`, as Anthropic's API answers it."""
    status, kind = ERROR_TYPES.get(status, (status, "invalid_request_error" if status < 500 else "api_error"))
    return status, {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


def _whole(value: Any) -> Any:
    """JSON Schema's integers include 5.0, which strict pydantic refuses: an integral float becomes an int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class AnthropicBody(BaseModel):
    """Strict: no `"5"` or `true` for an integer, as the schema says."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(AnthropicBody):
    type: Literal["text"]
    text: str


class MediaBlock(AnthropicBody):
    """An image or a document: refused by the handler (no vision models)."""

    type: Literal["image", "document"]
    source: dict[str, Any]


class ThinkingBlock(AnthropicBody):
    """An earlier turn's thinking (its signature is not checked; a redacted one has no text)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""


class ToolUseBlock(AnthropicBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(AnthropicBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


UserBlock = Annotated[TextBlock | MediaBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]


class UserMessage(AnthropicBody):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(AnthropicBody):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


AnthropicMessage = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class InputSchema(BaseModel):
    """A tool's JSON schema: an object's, as Anthropic requires; its other keywords kept as given."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["object"]


class Tool(AnthropicBody):
    """A client tool (Anthropic's server tools, `type: "web_search_..."` and the like, are not served)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: InputSchema


class ToolChoiceTool(AnthropicBody):
    """The named tool, forced."""

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceMode(AnthropicBody):
    """`auto` (the model's choice), `any` (some tool, forced) or `none`."""

    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool = False


ToolChoice = Annotated[ToolChoiceTool | ToolChoiceMode, Field(discriminator="type")]


class Thinking(AnthropicBody):
    """`enabled` / `disabled` set the chat template's thinking switch, `adaptive` leaves the template's
    default (`anthropic_messages.thinking_kwargs`); `budget_tokens` caps the thinking where the engine can
    (`anthropic_messages.sampling_fields`); `display: "omitted"` sends thinking blocks without their text."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None

    @field_validator("budget_tokens", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        return _whole(value)


Text = Annotated[str, Field(min_length=1)]


class CountTokensRequest(AnthropicBody):
    """What renders the prompt: `/v1/messages/count_tokens` takes exactly this."""

    model: str = Field(json_schema_extra=SERVED_NAME)  # "" = the served model
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, json_schema_extra=MAX_NEW)
    stop_sequences: list[Text] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)  # None: the model's generation config, as chat's
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # 0: off
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, not used
    request_timeout: RequestTimeout = None  # Conveyor's (`protocol.RequestTimeout`)
    priority: Priority = 0  # vLLM's, as on the OpenAI routes

    @field_validator("max_tokens", "top_k", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        return _whole(value)
