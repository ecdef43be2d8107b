"""`truncate_prompt_tokens` (vLLM's): a prompt over the context keeps its last tokens instead of failing;
-1 keeps the most that fit beside max_new_tokens; without it the over-long prompt is still an error."""

from __future__ import annotations

import pytest

from conveyor import SamplingParams
from conveyor.errors import InvalidRequestError
from conveyor.sampling_params import SamplingParamsError

from tests.utils import TinyModel, all_free, greedy, random_prompts

LONG = random_prompts([200], seed=9)[0]


def test_the_prompt_keeps_its_tail(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm(max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"prompt \(200 tokens\) \+ max_new_tokens \(8\) = 208 exceeds"):
        llm.generate([LONG], greedy(8), use_tqdm=False)
    for keep, expected in ((10, 10), (-1, 64 - 8), (500, None)):
        params = greedy(8, truncate_prompt_tokens=keep)
        if expected is None:  # more than the prompt: the whole prompt, which does not fit
            with pytest.raises(InvalidRequestError, match="exceeds the context length"):
                llm.generate([LONG], params, use_tqdm=False)
            continue
        out = llm.generate([LONG], params, use_tqdm=False)[0]
        tail = llm.generate([LONG[-expected:]], greedy(8), use_tqdm=False)[0]
        assert out.prompt_token_ids == LONG[-expected:] and out.token_ids == tail.token_ids
    assert all_free(llm)


def test_what_truncation_refuses(tiny_llama: TinyModel) -> None:
    for bad in (0, -2, 1.5, True):
        with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens must be -1"):
            SamplingParams(truncate_prompt_tokens=bad)
    llm = tiny_llama.llm(max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"truncate_prompt_tokens=-1 leaves no room for the prompt: "
                                                  r"max_new_tokens \(64\) fills the context length of 64 tokens"):
        llm.generate([LONG], greedy(64, truncate_prompt_tokens=-1), use_tqdm=False)
    assert all_free(llm)
