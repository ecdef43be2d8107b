"""vLLM's `use_beam_search` over HTTP: the n choices of /v1/completions and /v1/chat/completions are the n
best beams of `LLM.beam_search`, best first, with their logprobs; the fields a beam search would not honour
are a 400 naming them; every KV block returns."""

from __future__ import annotations

import httpx
import pytest

from conveyor import LLM, BeamSearchParams
from conveyor.server import BackgroundServer

from tests.serving_helpers import long_tiny_llm, save_long_tiny
from tests.utils import idle, random_prompts


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return long_tiny_llm(save_long_tiny(tmp_path_factory.mktemp("beams"), context=256), num_blocks=256, page_size=4)


@pytest.fixture(scope="module")
def http(llm: LLM):
    with BackgroundServer(llm) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def generated(llm: LLM, prompt: list[int], n: int, steps: int) -> list[list[int]]:
    """The offline search's beams, their generated tokens only."""
    [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=n, max_tokens=steps, ignore_eos=True))
    return [seq.tokens[len(prompt):] for seq in out.sequences]


def test_choices_are_the_best_beams(http: httpx.Client, llm: LLM) -> None:
    prompt, tokenizer = random_prompts([9], seed=7)[0], llm.get_tokenizer()
    beams = generated(llm, prompt, 3, 5)
    body = {"prompt": prompt, "max_tokens": 5, "n": 3, "use_beam_search": True, "ignore_eos": True, "logprobs": 2,
            "return_token_ids": True}
    reply = http.post("/v1/completions", json=body).json()
    assert [c["token_ids"] for c in reply["choices"]] == beams
    assert [c["text"] for c in reply["choices"]] == [tokenizer.decode(b) for b in beams]
    first = reply["choices"][0]["logprobs"]
    assert len(first["tokens"]) == 5 and all(len(top) == 2 for top in first["top_logprobs"])
    assert reply["usage"] == {"prompt_tokens": 9, "completion_tokens": 15, "total_tokens": 24}
    salted = http.post("/v1/completions", json=body | {"cache_salt": "tenant"}).json()  # its own cache, same beams
    assert [c["token_ids"] for c in salted["choices"]] == beams

    conversation = [{"role": "user", "content": "w12 w13 w14"}]
    chat = http.post("/v1/chat/completions", json={"messages": conversation, "max_tokens": 4, "n": 2,
                                                   "use_beam_search": True, "ignore_eos": True}).json()
    expected = generated(llm, llm.render_chat(conversation), 2, 4)
    assert [c["message"]["content"] for c in chat["choices"]] == [tokenizer.decode(b) for b in expected]
    assert all(c["finish_reason"] == "length" for c in chat["choices"])
    assert idle(llm)


def test_fields_a_beam_search_does_not_read_are_refused(http: httpx.Client, llm: LLM) -> None:
    base = {"prompt": "w5 w6 w7", "max_tokens": 3, "n": 2, "use_beam_search": True}
    for extra, param in (({"stream": True}, "stream"), ({"stop": ["w9"]}, "stop"), ({"min_tokens": 1}, "min_tokens"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"logprobs": 5}, "logprobs"), ({"echo": True}, "echo"),
                         ({"length_penalty": 1e300}, "length_penalty"), ({"thinking_token_budget": 8},
                                                                         "thinking_token_budget"),
                         ({"priority": 5}, "priority")):  # each step's requests carry it: no priority scheduling
        refused = http.post("/v1/completions", json=base | extra)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    too_long = http.post("/v1/completions", json=base | {"prompt": random_prompts([llm.max_model_len - 1])[0]})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}], "n": 2,
                                                   "use_beam_search": True, "presence_penalty": 0.5})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "presence_penalty"
    assert idle(llm)
