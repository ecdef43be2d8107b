"""The pooling routes' work (`routes/embeddings.py`, `routes/score.py`): which server may answer them, the
inputs tokenized and the engine requests built on the preparing threads, the results run through the
shared engine as generations are (`Serving.submit`, `streaming.collect`: admission, cancellation on
disconnect, errors), and the answers' encodings (float lists or OpenAI's base64 of little-endian
float32), scores and usage. Scores follow vLLM: a classifier scores each pair as one prompt
(`LLM.score_prompt`), an embedding model by the cosine similarity of the two embeddings. Everything here
on the event loop is plain Python or numpy (one OpenMP team per process: the engine thread's)."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import Request

from ..errors import InvalidRequestError
from ..pooling_params import PoolingParams, PoolingParamsError
from ..request import Request as EngineRequest
from ..request import Pooled, RequestOutput
from .pooling_protocol import InputFields, PoolingFields
from .protocol import APIError
from .serving import Serving, new_id, request_error
from .streaming import collect

ROUTES = "/v1/embeddings (embedding models), /classify (classifiers), /v1/score, /v1/rerank and /pooling"
TASK_ROUTES = {"embed": "/v1/embeddings, /v1/score, /v1/rerank and /pooling",
               "classify": "/classify, /v1/score, /v1/rerank and /pooling",
               "token_embed": "/pooling", "token_classify": "/pooling"}
MODELS = {"embed": "an embedding model (--convert embed)", "classify": "a classifier (--convert classify)"}
DOES = {"embed": "embeds", "classify": "classifies", "token_embed": "embeds each token (--pooler-config task)",
        "token_classify": "classifies each token"}


def require_task(serving: Serving, path: str, *tasks: str) -> str:
    """The pooling task of the served model, one of `tasks`; else the error saying how to start a server
    that answers `path` (404 for a generating server, as for a route it does not have)."""
    task = serving.llm.pooling_task
    if task is None:
        raise APIError(404, f"{path} needs a pooling model; this server generates: start it with --runner pooling "
                       "(and --convert embed or classify) to serve embeddings and scores")
    if task not in tasks:
        raise APIError(400, f"{path} needs {' or '.join(MODELS[t] for t in tasks)}; this server's model "
                       f"{DOES[task]} (it serves {TASK_ROUTES[task]})")
    return task


def pooling_params(body: PoolingFields, activation: bool | None = None, dimensions: int | None = None) -> PoolingParams:
    try:
        return PoolingParams(dimensions=dimensions, use_activation=activation,
                             truncate_prompt_tokens=body.truncate_prompt_tokens)
    except PoolingParamsError as exc:
        raise APIError(400, str(exc), param="truncate_prompt_tokens" if "truncate" in str(exc) else None) from exc


def embedding_inputs(serving: Serving, body: InputFields) -> list[str | list[int]]:
    """The body's inputs (a text, texts, token ids, lists of them); a text too long for the context is
    refused untokenized unless it will be truncated."""
    given = body.input
    inputs: list[Any] = [given] if isinstance(given, str) or isinstance(given[0], int) else list(given)
    if body.truncate_prompt_tokens is None:
        for text in inputs:
            if isinstance(text, str):
                serving.check_length(text, "input")
    return inputs


def tokenize(serving: Serving, inputs: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each input (call it off the event loop: `Serving.prepare`)."""
    encode = serving.tokenizer.encode
    return [encode(x, add_special_tokens=add_special_tokens) if isinstance(x, str) else list(x) for x in inputs]


def score_prompts(serving: Serving, pairs: list[tuple[str, str]], check: bool) -> list[list[int]]:
    """A classifier's prompts of text pairs (off the event loop); `check`: refuse texts too long to fit."""
    if check:
        for a, b in pairs:
            serving.check_length(a + b, "text_2")
    return [serving.llm.score_prompt(a, b) for a, b in pairs]


def build_requests(serving: Serving, prefix: str, prompts: list[list[int]], params: PoolingParams,
                   param: str) -> list[EngineRequest]:
    """Validated pooling requests (off the event loop); an engine refusal is a 400 naming `param` (the input)
    or the field at fault."""
    requests = []
    for i, ids in enumerate(prompts):
        try:
            requests.append(serving.llm.make_pooling_request(f"{prefix}-{i}", ids, params))
        except InvalidRequestError as exc:
            raise request_error(exc, param, None) from exc
    return requests


async def run(serving: Serving, raw: Request, prefix: str, prompts: list[list[int]], params: PoolingParams,
              param: str) -> list[RequestOutput]:
    """The prompts pooled through the shared engine; their final outputs in order."""
    requests = await serving.prepare(build_requests, serving, prefix, prompts, params, param)
    return await collect(serving.submit(requests), raw)


def encode(values: Pooled, encoding_format: str) -> Pooled | str:
    """An embedding as JSON floats, or base64 of its float32 bytes, little-endian (what OpenAI's client reads);
    a token task's rows one after the other (vLLM's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


def cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norm = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y) / norm if norm else 0.0


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    tokens = sum(o.num_prompt_tokens for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def pair_up(first: str | list[str], second: str | list[str], names: tuple[str, str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of a list, or two lists pairwise."""
    left = [first] if isinstance(first, str) else list(first)
    right = [second] if isinstance(second, str) else list(second)
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise APIError(400, f"{names[0]} must hold 1 text or as many as {names[1]}: got {len(left)} and {len(right)}",
                       param=names[0])
    return list(zip(left, right))


async def pair_scores(serving: Serving, raw: Request, body: PoolingFields, pairs: list[tuple[str, str]],
                      activation: bool | None, param: str) -> tuple[list[float], dict[str, int]]:
    """Each pair's score and the usage: a classifier's one label, or the embeddings' cosine similarity."""
    task = require_task(serving, raw.url.path, "embed", "classify")
    params = pooling_params(body, activation)
    truncating = body.truncate_prompt_tokens is not None
    if task == "classify":
        try:
            serving.llm.check_scores()
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        prompts = await serving.prepare(score_prompts, serving, pairs, not truncating)
        outs = await run(serving, raw, new_id("score"), prompts, params, param)
        return [o.pooled[0] for o in outs if o.pooled], usage(outs)
    texts: list[str | list[int]] = sorted({t for pair in pairs for t in pair})
    if not truncating:
        for text in texts:
            serving.check_length(text, param)  # type: ignore[arg-type]
    outs = await run(serving, raw, new_id("score"), await serving.prepare(tokenize, serving, texts), params, param)
    vectors = {t: o.pooled or [] for t, o in zip(texts, outs)}
    return [cosine(vectors[a], vectors[b]) for a, b in pairs], usage(outs)


def head(serving: Serving, kind: str) -> dict[str, Any]:
    return {"id": new_id(kind), "object": "list", "created": int(time.time()), "model": serving.model_name}
