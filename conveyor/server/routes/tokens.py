"""vLLM's /tokenize, /detokenize and /tokenizer_info: the served model's tokenizer and chat template, over
HTTP (lm-evaluation-harness's remote tokenizer reads all three)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..openapi import error_responses
from ..protocol import APIError, DetokenizeRequest, TokenizeRequest
from .deps import AUTH, ServingDep

router = APIRouter()


@router.post("/tokenize", dependencies=AUTH, responses=error_responses(400, 401, 404, 413))
async def tokenize(body: TokenizeRequest, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    if body.messages is not None:
        tokens = await serving.prepare(serving.render_chat, body.messages)
    else:
        serving.check_length(body.prompt, "prompt")
        tokens = await serving.prepare(serving.tokenizer.encode, body.prompt,
                                       add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens, "token_strs": None}


@router.post("/detokenize", dependencies=AUTH, responses=error_responses(400, 401, 404, 413))
async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> dict[str, Any]:
    serving.check_model(body.model)
    vocab = serving.llm.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info", dependencies=AUTH, responses=error_responses(401, 404))
async def tokenizer_info(serving: ServingDep) -> dict[str, Any]:
    """The tokenizer's settings (its special tokens, class, the chat template served), as vLLM's endpoint;
    off unless the server was started with --enable-tokenizer-info-endpoint, as vLLM's."""
    if not serving.settings.enable_tokenizer_info_endpoint:
        raise APIError(404, "/tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint")
    tokenizer = serving.tokenizer
    info = {name: plain(value) for name, value in getattr(tokenizer, "init_kwargs", {}).items()
            if name not in LOCAL_FILES}
    return info | {"tokenizer_class": type(tokenizer).__name__, "chat_template": serving.chat_template or None}


LOCAL_FILES = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")  # paths on the server


def plain(value: Any) -> Any:
    """A tokenizer setting as JSON: added tokens by their text, anything else unknown to JSON as a string."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
