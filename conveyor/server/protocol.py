"""Request bodies of the OpenAI-compatible API (the fields Conveyor honours) and the error object.

Unknown fields are ignored, as vLLM does, and logged once per name (`request_fields`); fields that
would change the result and that Conveyor cannot honour are rejected with a 400 rather than silently
dropped: by the models themselves where a constraint says it (`suffix`), else by the handlers
(`best_of` != n; malformed `response_format`, `structured_outputs`, `tools`, `tool_choice`,
`logit_bias`; llama.cpp's samplers). The models carry the constraints the server
enforces (ranges, roles, non-empty prompts), so that the OpenAPI schema documents what is accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

MAX_LOGPROBS = 20  # the default --max-logprobs, as vLLM's
MAX_N = 128  # OpenAI's limit on choices per request (the server's max queue may be lower: a 400 then)
# Bounds only the running server knows (served names, vocabulary, context): marked here, filled into its
# OpenAPI schema by `openapi.instance_schema`.
SERVED_NAME = {"x-conveyor-bound": "served_name"}
TOKEN_ID = {"x-conveyor-bound": "token_id"}
MAX_NEW = {"x-conveyor-bound": "max_new_tokens"}
LOGPROBS = {"x-conveyor-bound": "max_logprobs"}  # --max-logprobs (checked by `request_fields.check_logprobs`)


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 5.0, which strict pydantic rejects (as it rightly rejects `true` and
    `"5"`): integral floats, also inside lists, become ints (a float field takes them back as floats)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_integral(v) for v in value] if isinstance(value, list) else value


# Every generating endpoint's deadline: seconds from arrival after which the request, still waiting or running,
# ends with a 504 (null: the server's --request-timeout, if any); and its priority (vLLM's: lower runs first,
# with --scheduling-policy priority; anything but 0 is a 400 without it).
RequestTimeout = Annotated[float | None, Field(gt=0, allow_inf_nan=False)]
Priority = Annotated[int, Field(ge=-2**63, lt=2**63, json_schema_extra={"x-conveyor-bound": "priority"})]
TokenId = Annotated[int, Field(ge=0, json_schema_extra=TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class RequestBody(BaseModel):
    """Strict: no `"5"` or `true` for an integer, as the schema says (JSON integers are accepted for floats)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _integral_floats(cls, value: Any) -> Any:
        return _integral(value)


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class SamplerFields(RequestBody):
    """The sampling fields every generating body takes beyond temperature and top_p (OpenAI's and vLLM's
    extra ones): chat and completions (`SamplingFields`) and the Responses API."""

    top_k: int | None = Field(None, ge=-1)  # None, 0 or -1: off
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - MAX_N)  # choice i uses seed + i
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extra field: json, regex, choice, grammar
    skip_special_tokens: bool = True  # vLLM's extra field
    include_stop_str_in_output: bool = False  # vLLM's: the stop string kept in the text
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM's: prefix cache shared only within a salt
    thinking_token_budget: int | None = Field(None, ge=-1)  # vLLM's: reasoning tokens before its end is forced
    request_timeout: RequestTimeout = None
    priority: Priority = 0


class SamplingFields(SamplerFields):
    """Fields shared by completions and chat completions; the others a client sends are kept in
    `model_extra` (refused or logged by `request_fields`)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, json_schema_extra=SERVED_NAME)  # null or "" = the served model
    temperature: float | None = Field(None, ge=0)  # None: OpenAI's default, 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = Field(0, ge=0)  # at most max_tokens
    user: str | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's {"type": "text" | "json_object" | "json_schema"}
    # vLLM's extra fields: the only tokens allowed; words never generated; the prompt's and the choices' token
    # ids returned; logprobs' tokens as "token_id:N"
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    # vLLM's: keep the prompt's last N tokens (-1: what fits beside max_tokens); null: all (too long: 400)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    use_beam_search: bool | None = False  # vLLM's: the n choices are the n best beams (server/beam_search.py)
    # vLLM's: a beam's score is its log-probability / length ** length_penalty
    length_penalty: float = Field(1.0, ge=-10, le=10)
    # llama.cpp's server fields (request_fields): max_tokens, a GBNF grammar, a JSON schema; prompt caching
    n_predict: int | None = Field(None, ge=-1)  # -1: the rest of the context
    grammar: Text | None = None
    json_schema: dict[str, Any] | None = None
    cache_prompt: bool | None = None  # prefix caching is always on


class CompletionRequest(SamplingFields):
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds],
                                                                                      Field(min_length=1)]
    # OpenAI's and vLLM's default; null = the rest of the context; 0 (with echo): the prompt's logprobs only
    max_tokens: int | None = Field(16, ge=0, json_schema_extra=MAX_NEW)
    logprobs: int | None = Field(None, ge=0, json_schema_extra=LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, json_schema_extra=LOGPROBS)  # vLLM's extra field
    echo: StrictBool = False  # the prompt before each choice's text (and its tokens before the logprobs)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and the like) added to a text prompt
    suffix: None = None  # not supported
    best_of: int | None = Field(None, ge=1)  # only = n


class TextPart(RequestBody):
    type: Literal["text"]
    text: str | None = None


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer = system
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this message answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that render it


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, json_schema_extra=MAX_NEW)  # None: the rest of the context (vLLM)
    max_completion_tokens: int | None = Field(None, ge=1, json_schema_extra=MAX_NEW)  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, json_schema_extra=LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, json_schema_extra=LOGPROBS)  # vLLM's extra field
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # OpenAI's default: true
    # vLLM's chat fields: the template's variables and ends, the last message echoed, the reasoning sent
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last message (add_generation_prompt false)
    echo: bool = False  # the last message's content before the reply's, when the roles match
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS added over the template's own
    # OpenAI's: the template's thinking switch (and gpt-oss's effort); vLLM's: documents for a RAG template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    documents: list[dict[str, Any]] | None = None
    include_reasoning: bool = True
    # llama.cpp's: "none" leaves the reasoning in the content
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] | None = None


class TokenizeRequest(RequestBody):
    """Exactly one of `prompt` and `messages` (the other absent or null)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]})

    model: str | None = Field(None, json_schema_extra=SERVED_NAME)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = Field(None, json_schema_extra=SERVED_NAME)
    tokens: list[TokenId]
