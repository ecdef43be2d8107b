"""vLLM's sampling fields that restrict or keep text: `allowed_token_ids`, `bad_words`,
`include_stop_str_in_output`; and the prefix cache's vLLM controls: the prompt's `cache_salt` (shared only
within a salt) and `LLM.reset_prefix_cache()`."""

from __future__ import annotations

import pytest

from conveyor import LLM, ContinuousBatchingConfig, InvalidRequestError, SamplingParams
from conveyor.sampling_params import SamplingParamsError

from tests.utils import TinyModel, greedy, idle, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_llama: TinyModel) -> LLM:
    return tiny_llama.llm(page_size=4, num_blocks=128)


def test_allowed_token_ids_are_the_only_tokens_generated(llm: LLM) -> None:
    prompt = random_prompts([8], seed=30)[0]
    free = llm.generate([prompt], greedy(10), use_tqdm=False)[0].token_ids
    allowed = [t for t in range(5, 40) if t not in free][:6]
    for params in (greedy(10, allowed_token_ids=allowed),
                   SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, ignore_eos=True, logprobs=2,
                                  allowed_token_ids=allowed)):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out.token_ids) == 10 and set(out.token_ids) <= set(allowed)
    # the logprobs stay the model's own: the top one is a token the filter ruled out
    assert max(out.logprobs[0], key=out.logprobs[0].get) not in allowed
    only = llm.generate([prompt], greedy(10, allowed_token_ids=[free[0]]), use_tqdm=False)[0]
    assert only.token_ids == [free[0]] * 10
    with pytest.raises(InvalidRequestError, match="allowed_token_ids token ids"):
        llm.engine.make_request("x", prompt, greedy(2, allowed_token_ids=[llm.engine.vocab_size]))
    with pytest.raises(SamplingParamsError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    assert idle(llm)


def test_bad_words_are_never_generated(llm: LLM) -> None:
    """A one-token word is banned everywhere; a two-token word only right after its first token."""
    prompt = random_prompts([8], seed=31)[0]
    free = llm.generate([prompt], greedy(12), use_tqdm=False)[0].token_ids
    one = llm.generate([prompt], greedy(12, bad_words=[f"w{free[2]}"]), use_tqdm=False)[0].token_ids
    assert one[:2] == free[:2] and free[2] not in one
    pair = f"w{free[0]} w{free[1]}"  # the word-level tokenizer: one token per word
    two = llm.generate([prompt], greedy(12, bad_words=[pair]), use_tqdm=False)[0].token_ids
    assert two[0] == free[0] and two[1] != free[1]
    assert all(two[i:i + 2] != free[:2] for i in range(len(two) - 1))
    with pytest.raises(SamplingParamsError, match="bad_words"):
        SamplingParams(bad_words=[" "])


def test_bad_words_under_async_batching_see_the_token_in_flight(tiny_llama: TinyModel, llm: LLM) -> None:
    """The pipeline samples step N+1 before step N's token is read back: a two-token word's ban must still
    see it (the sampler's history snapshot gets the pending token)."""
    fast = tiny_llama.llm(page_size=4, num_blocks=128, use_async_batching=True)
    assert fast.engine.pipeline is not None
    prompts = random_prompts([8, 11], seed=32)
    free = llm.generate(prompts, greedy(12), use_tqdm=False)
    params = [greedy(12, bad_words=[f"w{o.token_ids[3]} w{o.token_ids[4]}"]) for o in free]
    ours = fast.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in ours] == [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(o.token_ids[4] != f.token_ids[4] for o, f in zip(ours, free))
    assert idle(fast)


def test_include_stop_str_in_output_keeps_the_stop_string(llm: LLM) -> None:
    prompt = random_prompts([8], seed=33)[0]
    free = llm.generate([prompt], greedy(12), use_tqdm=False)[0]
    stop = free.text.split()[4]
    cut = free.text.index(stop)
    dropped, kept = llm.generate([prompt, prompt], [greedy(12, stop=[stop]),
                                                    greedy(12, stop=[stop], include_stop_str_in_output=True)],
                                 use_tqdm=False)
    assert dropped.text == free.text[:cut] and kept.text == free.text[:cut + len(stop)]
    assert dropped.stop_reason == kept.stop_reason == stop and kept.token_ids == dropped.token_ids


def test_cache_salt_keeps_prefixes_apart(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm(page_size=4, num_blocks=128, allow_block_sharing=True)
    prompt = random_prompts([24], seed=34)[0]

    def hits(prompt_dict: dict) -> int:
        before = llm.stats().prefix_cache_hit_tokens
        llm.generate([prompt_dict], greedy(2), use_tqdm=False)
        return llm.stats().prefix_cache_hit_tokens - before

    assert hits({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}) == 0
    assert hits({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}) == 0  # another salt: no sharing
    assert hits({"prompt_token_ids": prompt}) == 0  # nor without one
    assert hits({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}) > 0
    assert hits({"prompt_token_ids": prompt}) > 0
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], greedy(2), use_tqdm=False)
    assert idle(llm)


def test_reset_prefix_cache_forgets_every_cached_block(tiny_llama: TinyModel) -> None:
    """vLLM's `LLM.reset_prefix_cache()`: the next prompts are computed in full; with the manager's loop
    running it resets between two steps (`manager.call`), and refuses (False) while a request is unfinished."""
    llm = tiny_llama.llm(page_size=4, num_blocks=128, allow_block_sharing=True)
    prompt = random_prompts([24], seed=35)[0]
    llm.generate([prompt], greedy(2), use_tqdm=False)
    assert llm.engine.allocator.num_cached_blocks > 0
    assert llm.reset_prefix_cache() is True
    assert llm.engine.allocator.num_cached_blocks == 0 and idle(llm)
    before = llm.stats().prefix_cache_hit_tokens
    llm.generate([prompt], greedy(2), use_tqdm=False)
    assert llm.stats().prefix_cache_hit_tokens == before  # computed again, nothing found
    assert llm.engine.allocator.num_cached_blocks > 0
    with llm.manager:
        assert llm.reset_prefix_cache() is True and llm.engine.allocator.num_cached_blocks == 0
        llm.generate([prompt], greedy(2), use_tqdm=False)
    held = llm.make_request("held", prompt, greedy(2))
    llm.engine.add_request(held)  # unfinished (no loop steps it)
    assert llm.reset_prefix_cache() is False and llm.engine.allocator.num_cached_blocks > 0
    llm.engine.cancel_request("held")
    assert llm.reset_prefix_cache() is True
    assert llm.engine.allocator.num_cached_blocks == 0 and idle(llm)
    with pytest.raises(ZeroDivisionError):  # a call's exception reaches its caller; the loop goes on
        llm.manager.start().call(lambda engine: 1 / 0)
    assert llm.manager.call(lambda engine: engine.has_unfinished_requests()) is False
    llm.manager.stop()


def test_detokenize_false_gives_token_ids_only(llm: LLM) -> None:
    """vLLM's `detokenize=False`: the same tokens, no text; stop strings, which are found in the text, refused."""
    prompts = random_prompts([7, 12], seed=36)
    with_text = llm.generate(prompts, greedy(8), use_tqdm=False)
    ids_only = llm.generate(prompts, greedy(8, detokenize=False, logprobs=1), use_tqdm=False)
    assert [o.token_ids for o in ids_only] == [o.token_ids for o in with_text]
    assert all(o.text == "" and o.finish_reason == "length" for o in ids_only) and all(o.text for o in with_text)
    with pytest.raises(SamplingParamsError, match="stop strings are found in the text: they need detokenize=True"):
        SamplingParams(stop=["w5"], detokenize=False)
    assert idle(llm)
