"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the search of `conveyor.beam_search`,
each step's beams one submission to the shared engine (so they batch with everyone else's requests and
count in the server's queue), the choices the `n` best beams, best first, answered whole at the end as if
each were a request's final output.

What a beam search does not read is refused when set (a 400 naming the field), where vLLM ignores it:
streaming, stop conditions, constraints, token restrictions and penalties.
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request as HTTPRequest

from ..beam_search import BeamSearch
from ..errors import InvalidRequestError
from ..lora_request import LoRARequest
from ..request import Request, RequestOutput
from ..sampling_params import BeamSearchParams
from .protocol import APIError, SamplingFields
from .response_format import body_constraint
from .serving import Serving, request_error, salted
from .streaming import collect

# field -> its values that leave a beam search's result as it is
UNREAD: dict[str, tuple[object, ...]] = {
    "stream": (False,), "echo": (False,), "prompt_logprobs": (None,), "stop": (None, [], ""),
    "stop_token_ids": (None, []), "min_tokens": (0,), "logit_bias": (None, {}), "allowed_token_ids": (None,),
    "bad_words": (None, []), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "thinking_token_budget": (None, -1)}


def check_beam_search(body: SamplingFields, logprobs: int | None) -> None:
    """A 400 naming the first field set that a beam search would not honour."""
    for name, unread in UNREAD.items():
        if getattr(body, name, None) not in unread:
            raise APIError(400, f"{name} is not available with use_beam_search", param=name)
    constraint, field = body_constraint(body)
    if constraint is not None:
        raise APIError(400, f"{field} is not available with use_beam_search", param=field)
    if logprobs is not None and logprobs > 2 * body.n:
        raise APIError(400, f"with use_beam_search a token's logprobs are its step's 2 x n = {2 * body.n} candidates; "
                       f"got {logprobs}", param="logprobs")


async def beam_search(serving: Serving, rid: str, prompts: list[list[int]], body: SamplingFields,
                      max_tokens: int | None, lora_request: LoRARequest | None, raw: HTTPRequest,
                      param: str, keep_special: bool = False) -> list[RequestOutput]:
    """The `body.n` best beams of each prompt, best first, as final outputs (n consecutive per prompt).
    max_tokens None: as far as the shortest prompt's context allows. keep_special: special tokens stay in the
    text (a tool parser's markers)."""
    llm = serving.llm
    if max_tokens is None:
        max_tokens = min(llm.default_max_tokens(len(ids)) for ids in prompts)
    try:
        params = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                                  temperature=body.temperature or 0.0, length_penalty=body.length_penalty,
                                  include_stop_str_in_output=body.include_stop_str_in_output)
        for ids in prompts:
            llm.engine.input_processor.check_fits(ids, max_tokens)
    except InvalidRequestError as exc:
        raise request_error(exc, param, None) from exc
    except ValueError as exc:
        raise APIError(400, str(exc), param="max_tokens" if "max_tokens" in str(exc) else "n") from exc
    search = BeamSearch(prompts, params, llm.eos_token_ids)
    step = replace(params.step_params(), priority=body.priority)  # each step's requests rank as the request

    def step_requests(k: int, batch: list[tuple[int, list[int]]]) -> list[Request]:
        try:
            return [llm.make_request(f"{rid}-step{k}-{i}", salted(tokens, body.cache_salt), step, lora_request)
                    for i, (_, tokens) in enumerate(batch)]
        except InvalidRequestError as exc:
            raise request_error(exc, param, None) from exc

    k = 0
    while batch := search.pending():
        requests = await serving.prepare(step_requests, k, batch)
        search.advance(await collect(serving.submit(requests), raw))
        k += 1
    outputs = []
    for p, result in enumerate(search.results()):
        for j, seq in enumerate(result.sequences):
            tokens = seq.tokens[len(prompts[p]):]
            text = serving.tokenizer.decode(tokens, skip_special_tokens=body.skip_special_tokens and not keep_special)
            outputs.append(RequestOutput(f"{rid}-{p * body.n + j}", None, prompts[p], text, tokens, finished=True,
                                         finish_reason=seq.finish_reason, logprobs=seq.logprobs))
    return outputs
