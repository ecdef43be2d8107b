"""POST /v1/completions: prompts (text or token ids) in, choices out, streamed or whole; with `echo`, each
choice begins with its prompt (and its logprobs with the prompt's, as vLLM: what lm-evaluation-harness
reads for log-likelihoods, `max_tokens` 0 for the prompt alone); with vLLM's `use_beam_search`, the n best
beams (beam_search.py)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...request import RequestOutput
from ..beam_search import beam_search, check_beam_search
from ..openapi import STREAMED, error_responses
from ..protocol import APIError, CompletionRequest
from ..request_fields import (cached_tokens, check_fields, check_logprobs, stream_usage, token_limit, tokens_as_ids,
                              truncated)
from ..serving import new_id, usage
from ..streaming import collect, stream_response
from .deps import AUTH, ServingDep

router = APIRouter()


@router.post("/v1/completions", dependencies=AUTH,
             responses=STREAMED | error_responses(400, 401, 404, 413, 500, 503, 504))
async def completions(body: CompletionRequest, raw: Request, serving: ServingDep) -> Response:
    adapter = serving.check_model(body.model)
    check_fields(body, "/v1/completions", serving.ignored_fields)
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of is not supported (other than = n)", param="best_of")
    check_logprobs(serving.max_logprobs, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
    if body.use_beam_search:
        check_beam_search(body, body.logprobs)
    if body.stream and body.prompt_logprobs is not None:  # as vLLM
        raise APIError(400, "prompt_logprobs is not available with stream: true", param="prompt_logprobs")
    texts = serving.completion_prompts(body)  # a prompt too long to fit is refused here, untokenized
    limit = token_limit(body)
    generates = limit != 0  # max_tokens 0 (with echo): one token is generated for the prompt's logprobs, not sent
    if not generates and not body.echo:
        raise APIError(400, "max_tokens 0 returns nothing without echo: true", param="max_tokens")
    engine_limit = limit if generates else 1
    tokenized = await serving.prepare(serving.tokenize, texts, body.add_special_tokens)
    prompts = truncated(body, tokenized, engine_limit, serving.max_model_len, "prompt")
    prompt_lp = body.prompt_logprobs
    if prompt_lp is None and body.echo:
        prompt_lp = body.logprobs  # the echoed prompt's logprobs (vLLM's)
    rid, created = new_id("cmpl"), int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": serving.reply_model(adapter)}
    n_lp = body.logprobs
    # echo: the prompt as sent where it was kept whole, else the text of the tokens the model saw
    echoes = [text if isinstance(text, str) and len(kept) == len(ids) else serving.tokenizer.decode(kept)
              for text, ids, kept in zip(texts, tokenized, prompts)] if body.echo else []
    as_ids = tokens_as_ids(body, serving.settings)

    def choice(i: int, out: RequestOutput, text: str, start: int, first: bool, offset: int) -> dict[str, Any]:
        """Choice i: `text` and the tokens from `start` on (neither with max_tokens 0), the prompt's before them
        in a choice's `first` chunk with echo, and with return_token_ids the token ids (the prompt's too in the
        first chunk). `offset`: the characters sent before, for the logprobs' text offsets."""
        p = i // body.n
        ids = out.token_ids[start:] if generates else []
        entries: list[dict[int, float] | None] = out.logprobs[start:] if generates and n_lp is not None else []
        text, shown = (text if generates else ""), ids
        if first and body.echo:
            text, shown = echoes[p] + text, prompts[p] + ids
            if n_lp is not None:
                assert out.prompt_logprobs is not None  # echo with logprobs asks for them
                entries = [*out.prompt_logprobs, *entries]
        lp = None if n_lp is None else serving.logprobs.completion(shown, entries, n_lp, offset, as_ids)
        end = out.finished
        fields = {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason if end else None,
                  "stop_reason": out.stop_reason if end else None}
        if body.return_token_ids:
            fields |= {"prompt_token_ids": prompts[p] if first else None, "token_ids": ids}
        return fields

    def whole(finals: list[RequestOutput]) -> JSONResponse:
        """The response of the final outputs, the choices in order."""
        choices = []
        for i, out in enumerate(finals):
            plp = None if body.prompt_logprobs is None else serving.logprobs.prompt(out.prompt_logprobs or [],
                                                                                     body.prompt_logprobs)
            choices.append(choice(i, out, out.text, 0, True, 0) | {"prompt_logprobs": plp})
        counted = finals if generates else [0] * len(finals)
        used = usage(prompts, counted, cached_tokens(finals, body.n, serving.settings))
        return JSONResponse(head | {"choices": choices, "usage": used})

    if body.use_beam_search:
        return whole(await beam_search(serving, rid, prompts, body, limit, adapter, raw, "prompt"))
    requests = await serving.prepare(serving.build_requests, rid, prompts, body, engine_limit, body.logprobs,
                                     "prompt", prompt_logprobs=prompt_lp, lora_request=adapter)
    sub = serving.submit(requests)
    if body.stream:
        offsets = [0] * len(requests)  # characters of text sent per choice, for logprob text offsets
        started = [False] * len(requests)

        def completion_choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
            fields = choice(i, out, out.delta_text, start, not started[i], offsets[i])
            started[i] = True
            offsets[i] += len(fields["text"])
            return fields

        return stream_response(sub, head, prompts, body, n_lp, completion_choice, counts_output=generates,
                               **stream_usage(serving.settings))

    return whole(await collect(sub, raw))
