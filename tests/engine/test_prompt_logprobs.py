"""Prompt logprobs (`SamplingParams(prompt_logprobs=n)`): transformers' log-softmax of its fp32 logits
over the prompt, in one chunk or many, mixed with other requests, past a cached prefix and a soft
reset; the blocks all come back. Logprobs' values as vLLM's `Logprob` objects."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from conveyor import LLM, InvalidRequestError, SamplingParams
from conveyor.engine.engine import Engine
from conveyor.request import Logprob

from tests.utils import TinyModel, assert_greedy_match, greedy, hf_greedy, random_prompts


@torch.inference_mode()
def reference_log_softmax(model: TinyModel, prompt: list[int]) -> torch.Tensor:
    """Row i: transformers' log-probabilities of the token after prompt[:i + 1] (fp32 logits)."""
    return torch.log_softmax(model.reference(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_prompt_logprobs(entries: list[dict[int, float] | None] | None, prompt: list[int], ref: torch.Tensor,
                          n: int) -> None:
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry, row, token = entries[i], ref[i - 1], prompt[i]
        assert entry is not None
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4), f"prompt token {i}"
        top = row.topk(n).indices.tolist() if n else []
        assert set(list(entry)[:n]) == set(top), f"top-{n} of prompt token {i}"  # the top-n first
        assert set(entry) == set(top) | {token}
        for t in top:
            assert entry[t] == pytest.approx(row[t].item(), abs=1e-4)


def assert_all_free(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks


# -- against transformers ------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "config"), [
    ("llama", {"max_batch_tokens": 256}),  # every prompt in one chunk, one pass
    ("llama", {"max_batch_tokens": 7, "max_requests_per_batch": 4}),  # chunked; LM head slices of 4 rows
    ("gemma2", {"max_batch_tokens": 7}),  # final logit soft-capping, sliding and full layers
])
def test_prompt_logprobs_are_the_reference_log_softmax(tiny_models: dict[str, TinyModel], kind: str,
                                                       config: dict) -> None:
    model = tiny_models[kind]
    llm = model.llm(page_size=4, **config)
    prompts = random_prompts([19, 12, 23, 1], seed=40)
    params = [greedy(5, prompt_logprobs=3), greedy(5), greedy(5, prompt_logprobs=0), greedy(3, prompt_logprobs=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs)):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(out.prompt_logprobs, prompt, reference_log_softmax(model, prompt), p.prompt_logprobs)
        ref, logits = hf_greedy(model.reference, prompt, p.max_new_tokens)
        assert_greedy_match(out.token_ids, ref, logits, f"{kind} prompt {i}")
    assert outs[3].prompt_logprobs == [None]  # a one-token prompt: nothing to score
    assert_all_free(llm.engine)


def test_a_cached_prefix_is_still_scored(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm(page_size=4)
    base, tail = random_prompts([16, 6], seed=41)
    llm.generate([base], greedy(2), use_tqdm=False)  # caches base's blocks
    before = llm.stats()
    out = llm.generate([base + tail], greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
    check_prompt_logprobs(out.prompt_logprobs, base + tail, reference_log_softmax(tiny_llama, base + tail), 1)
    after = llm.stats()
    assert after.prefix_cache_hit_tokens == before.prefix_cache_hit_tokens
    assert after.prefill_tokens - before.prefill_tokens == len(base) + len(tail)
    llm.generate([base + tail], greedy(2), use_tqdm=False)  # the cache was there to use
    assert llm.stats().prefix_cache_hit_tokens > after.prefix_cache_hit_tokens
    assert_all_free(llm.engine)


def test_soft_reset_records_each_prompt_position_once(tiny_llama: TinyModel) -> None:
    llm = tiny_llama.llm(page_size=4, max_batch_tokens=7)
    engine = llm.engine
    prompts = random_prompts([20, 9], seed=42)
    requests = [engine.make_request(f"r{i}", p, greedy(4, prompt_logprobs=2)) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    engine.step()
    engine.step()
    assert 1 < len(requests[0].prompt_logprobs) < len(prompts[0])  # mid-prefill
    engine._soft_reset(requests[0])  # its prompt is recomputed from the start
    while not requests[1].output_token_ids:
        engine.step()
    engine._soft_reset(requests[1])  # after its prefill: prompt and generated tokens are recomputed
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().soft_resets == 2
    for request, prompt in zip(requests, prompts):
        out = request.to_output()
        check_prompt_logprobs(out.prompt_logprobs, prompt, reference_log_softmax(tiny_llama, prompt), 2)
        ref, logits = hf_greedy(tiny_llama.reference, prompt, 4)
        assert_greedy_match(out.token_ids, ref, logits, request.request_id)
    assert_all_free(engine)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, 1.5, "3"])
def test_bad_prompt_logprobs_raise(value: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer >= 0"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_more_prompt_logprobs_than_the_vocabulary_raise(tiny_llama: TinyModel) -> None:
    llm: LLM = tiny_llama.llm()
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be at most the vocabulary size 300"):
        llm.generate([[5, 6, 7]], greedy(1, prompt_logprobs=301), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="logprobs must be at most the vocabulary size 300"):
        llm.generate([[5, 6, 7]], greedy(1, logprobs=301), use_tqdm=False)
    out = llm.generate([[5, 6, 7]], greedy(1, prompt_logprobs=300), use_tqdm=False)[0]
    assert len(out.prompt_logprobs[1]) == 300
    assert_all_free(llm.engine)


def test_logprobs_are_vllms_logprob_objects(tiny_llama: TinyModel) -> None:
    """Each value of a logprobs entry (sampled tokens' and the prompt's) is vLLM's `Logprob` and still the float:
    `.logprob`, `.rank` (the token's place among transformers' log-probabilities of the whole vocabulary, ties
    counted as vLLM counts them) and `.decoded_token` (its text); it pickles and serializes as a number."""
    llm, tokenizer = tiny_llama.llm(), tiny_llama.llm().get_tokenizer()
    prompt = random_prompts([9], seed=21)[0]
    params = SamplingParams(max_new_tokens=6, temperature=1.5, seed=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    sequence = prompt + out.token_ids
    ref = reference_log_softmax(tiny_llama, sequence)
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert len(entries) == len(sequence) - 1
    outside = 0
    for i, entry in enumerate(entries):
        row, token = ref[i], sequence[i + 1]
        for t, value in entry.items():
            assert isinstance(value, Logprob) and value.logprob == value
            assert value.decoded_token == tokenizer.decode([t])
            assert value.logprob == pytest.approx(row[t].item(), abs=1e-4)
            above, tied = int((row > row[t] + 1e-4).sum()), int((row >= row[t] - 1e-4).sum())
            assert above < value.rank <= tied, (i, t, value.rank)  # within a tie, any place
        outside += entry[token].rank > 2
    assert outside > 0  # some sampled or prompt tokens ranked past the top-2: ranks were counted, not listed
    assert out.outputs[0].cumulative_logprob == pytest.approx(  # vLLM's: the sampled tokens' sum
        sum(ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)), abs=1e-3)
    [plain] = llm.generate([prompt], greedy(2), use_tqdm=False)
    assert out.outputs[0].finished() and plain.outputs[0].cumulative_logprob is None
    value = out.outputs[0].logprobs[0][out.token_ids[0]]
    assert pickle.loads(pickle.dumps(value)).rank == value.rank and json.loads(json.dumps(value)) == float(value)
