"""Request bodies of the pooling routes, vLLM's shapes: /v1/embeddings (OpenAI's, with vLLM's extra fields),
/v1/score and /v1/rerank (Jina's and Cohere's rerank shape, as vLLM serves it), /classify and /pooling.
Unknown fields are ignored, as on the other routes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .protocol import SERVED_NAME, RequestBody, Text, TokenIds

Texts = Annotated[list[Text], Field(min_length=1)]
ScoreInputs = Text | Texts


class PoolingFields(RequestBody):
    model: str | None = Field(None, json_schema_extra=SERVED_NAME)
    # vLLM's: keep the prompt's last N tokens (-1: as many as the context holds); null: all (too long: 400)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    user: str | None = None


class InputFields(PoolingFields):
    """The inputs of the routes that pool each one alone: a text, texts, token ids or lists of them."""

    input: Text | Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like around a text


class EmbeddingRequest(InputFields):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # Matryoshka models only
    normalize: bool | None = None  # vLLM's; null: the server's pooler config (normalized by default)
    use_activation: bool | None = None  # vLLM's newer name for normalize


class ActivationFields(PoolingFields):
    """Whether a classifier's sigmoid (or softmax) applies to its scores; vLLM's three names for one switch."""

    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    @property
    def activation_switch(self) -> bool | None:
        given = {v for v in (self.use_activation, self.activation, self.softmax) if v is not None}
        if len(given) > 1:
            raise ValueError("use_activation, activation and softmax are one switch: they disagree")
        return given.pop() if given else None


SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


class ScoreRequest(ActivationFields):
    """vLLM's /v1/score: `text_1` against `text_2` (its newer names: queries and documents or items, data_1
    and data_2); one text against each of a list, or two lists pairwise."""

    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        if len(self.given_pairs()) != 1:
            raise ValueError("give one pair of inputs: text_1 and text_2 (or queries and documents, queries and "
                             "items, data_1 and data_2)")
        return self

    def given_pairs(self) -> list[tuple[str, str]]:
        return [names for names in SCORE_PAIRS if None not in (getattr(self, names[0]), getattr(self, names[1]))]

    @property
    def pair(self) -> tuple[tuple[str, str], ScoreInputs, ScoreInputs]:
        """The field names given, and their values."""
        names = self.given_pairs()[0]
        return names, getattr(self, names[0]), getattr(self, names[1])


class RerankRequest(ActivationFields):
    """vLLM's /v1/rerank (and /rerank, /v2/rerank: Jina's and Cohere's shape): the documents ordered by relevance
    to the query, the best `top_n` (0: all)."""

    query: Text
    documents: Texts
    top_n: int = Field(0, ge=0)


class ClassifyRequest(InputFields, ActivationFields):
    """vLLM's /classify: each input's label and class probabilities."""


class PoolRequest(InputFields, ActivationFields):
    """vLLM's /pooling: each input's pooled vector as the model's head leaves it (an embedding, a classifier's
    scores; one a token for the token tasks), as floats or base64. `task`, if given, must be the model's."""

    encoding_format: Literal["float", "base64"] = "float"
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
