"""Pooling models in the engine (`LLM(runner="pooling")`): embeddings equal transformers' last-token final-norm
hidden state, normalized, in fp32 (chunked prefill, prefix caching), close in the default dtype; the mean
and first-token poolings; the same embedding alone and in a batch of 64; Matryoshka dimensions;
truncation and the context limit; a generating model and a pooling one refusing each other's calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM, ContinuousBatchingConfig, InvalidRequestError, PoolingParams
from conveyor.config import ConfigError
from conveyor.pooling_llm import POOLING_MAX_BATCH_TOKENS

from tests.utils import TinyModel, all_free, random_prompts

LENGTHS = [1, 5, 17, 40, 100, 7]


@torch.inference_mode()
def hf_hidden(model: TinyModel, prompt: list[int]) -> torch.Tensor:
    """transformers' final-norm hidden states `[tokens, hidden]` of one prompt (fp32)."""
    return model.reference.model(torch.tensor([prompt])).last_hidden_state[0].float()


def pooling_llm(model: TinyModel, dtype: str = "float32", **kwargs: object) -> LLM:
    config = kwargs.pop("config", None) or ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=32)
    return LLM(model.path, dtype=dtype, runner="pooling", config=config, **kwargs)


def cosines(outs: list, refs: list[torch.Tensor]) -> list[float]:
    return [float(F.cosine_similarity(torch.tensor(o.outputs.embedding), r, dim=0)) for o, r in zip(outs, refs)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fp32_embeddings_equal_transformers_last_token(tiny_models: dict[str, TinyModel], kind: str,
                                                       one_thread: None) -> None:
    """Prompts in chunks of at most 32 tokens; the second run hits the prefix cache (its first blocks reused)."""
    model = tiny_models[kind]
    llm = pooling_llm(model)
    prompts = random_prompts(LENGTHS, seed=3)
    refs = [F.normalize(hf_hidden(model, p)[-1], dim=0) for p in prompts]
    for run in range(2):
        outs = llm.embed(prompts, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == prompts
        assert all(len(o.outputs.embedding) == 64 for o in outs)
        assert min(cosines(outs, refs)) >= 0.9999, run
        for o in outs:  # normalized
            assert abs(sum(x * x for x in o.outputs.embedding) - 1) < 1e-5
        assert all_free(llm)
    assert llm.stats().prefix_cache_hit_tokens > 0


def test_default_dtype_embeddings_are_close(tiny_models: dict[str, TinyModel], one_thread: None) -> None:
    model = tiny_models["qwen3"]
    llm = pooling_llm(model, dtype="auto")
    prompts = random_prompts(LENGTHS, seed=4)
    outs = llm.embed(prompts, use_tqdm=False)
    refs = [F.normalize(hf_hidden(model, p)[-1], dim=0) for p in prompts]
    assert min(cosines(outs, refs)) >= 0.99
    assert all_free(llm)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_first_token_pooling(tiny_models: dict[str, TinyModel], pooling_type: str, one_thread: None) -> None:
    """`--pooler-config`: over chunks of 32 tokens, not normalized; such requests never reuse cached blocks."""
    model = tiny_models["qwen2"]
    llm = pooling_llm(model, pooler_config=f'{{"pooling_type": "{pooling_type}", "normalize": false}}')
    prompts = random_prompts(LENGTHS, seed=5)
    for _ in range(2):
        outs = llm.embed(prompts, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            hidden = hf_hidden(model, prompt)
            ref = hidden.mean(0) if pooling_type == "MEAN" else hidden[0]
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=2e-5, rtol=1e-4)
    assert llm.stats().prefix_cache_hit_tokens == 0
    assert all_free(llm)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_an_embedding_alone_equals_it_in_a_batch_of_64(tiny_models: dict[str, TinyModel], dtype: str,
                                                       one_thread: None) -> None:
    model = tiny_models["llama"]
    llm = pooling_llm(model, dtype, config=ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=512))
    prompts = random_prompts([3 + (i * 7) % 45 for i in range(64)], seed=6)
    alone = [llm.embed(prompts[i], use_tqdm=False)[0].outputs.embedding for i in (0, 37)]
    batch = llm.embed(prompts, use_tqdm=False)
    for i, single in zip((0, 37), alone):
        torch.testing.assert_close(torch.tensor(batch[i].outputs.embedding), torch.tensor(single), atol=2e-3 if
                                   dtype == "auto" else 1e-5, rtol=0)
    assert all_free(llm)


def test_matryoshka_dimensions(tiny_models: dict[str, TinyModel], one_thread: None) -> None:
    """`dimensions` cuts the pooled vector, then normalizes it; only for a model whose config says it was trained
    for it (`hf_overrides` here); otherwise, or off its listed sizes, a refusal naming the parameter."""
    model, prompt = tiny_models["llama"], random_prompts([9], seed=7)[0]
    plain = pooling_llm(model)
    with pytest.raises(InvalidRequestError, match="does not support matryoshka representation") as refused:
        plain.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False)
    assert refused.value.param == "dimensions"
    trained = pooling_llm(model, hf_overrides={"matryoshka_dimensions": [16, 32]})
    cut = trained.embed(prompt, PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(cut), F.normalize(hf_hidden(model, prompt)[-1][:16], dim=0), atol=1e-5,
                               rtol=0)
    with pytest.raises(InvalidRequestError, match=r"dimensions 20 is not one the model was trained for: \[16, 32\]"):
        trained.embed(prompt, PoolingParams(dimensions=20), use_tqdm=False)
    raw = trained.embed(prompt, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(raw), hf_hidden(model, prompt)[-1], atol=1e-5, rtol=1e-5)
    assert all_free(trained)


def test_truncation_and_the_context_limit(tiny_models: dict[str, TinyModel], one_thread: None) -> None:
    """A prompt may fill the whole context (nothing is generated); over it, a refusal, or its tail with
    truncate_prompt_tokens (-1: as much as the context holds)."""
    model = tiny_models["llama"]
    llm = pooling_llm(model, max_model_len=64)
    long = random_prompts([80], seed=8)[0]
    assert len(llm.embed(long[:64], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(InvalidRequestError, match=r"prompt \(80 tokens\) exceeds the context length of 64 tokens"):
        llm.embed(long, use_tqdm=False)
    for keep, tail in ((20, long[-20:]), (-1, long[-64:])):
        out = llm.embed(long, truncate_prompt_tokens=keep, use_tqdm=False)[0]
        assert out.prompt_token_ids == tail
        ref = F.normalize(hf_hidden(model, tail)[-1], dim=0)
        assert cosines([out], [ref])[0] >= 0.9999
    assert all_free(llm)


def test_generating_and_pooling_models_refuse_each_others_calls(tiny_models: dict[str, TinyModel],
                                                               one_thread: None) -> None:
    model = tiny_models["llama"]
    generating = model.llm()
    with pytest.raises(ValueError, match=r"LLM.embed needs a pooling model: LLM\(model, runner='pooling'\)"):
        generating.embed("w5 w6", use_tqdm=False)
    pooling = pooling_llm(model)
    with pytest.raises(InvalidRequestError, match="this is a pooling model .* it does not generate"):
        pooling.generate("w5 w6", use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.classify needs a classify model; this pooling model's task is 'embed'"):
        pooling.classify("w5 w6", use_tqdm=False)
    [encoded] = pooling.encode("w5 w6", use_tqdm=False, pooling_task="embed")  # vLLM's generic call
    [embedded] = pooling.embed("w5 w6", use_tqdm=False)
    assert isinstance(encoded.outputs.data, torch.Tensor) and encoded.outputs.data.tolist() == embedded.outputs.embedding
    for task, words in (("classify", "task is 'embed'$"), ("token_embed", "load it with pooler_config=.*token_embed")):
        with pytest.raises(ValueError, match=words):
            pooling.encode("w5 w6", use_tqdm=False, pooling_task=task)
    with pytest.raises(ValueError, match="LLM.encode needs a pooling model"):
        generating.encode("w5 w6", use_tqdm=False)
    with pytest.raises(ConfigError, match="runs prefills only: speculative_config"):
        pooling_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="run on one rank: tensor_parallel_size must be 1"):
        pooling_llm(model, tensor_parallel_size=2)
    assert all_free(pooling) and all_free(generating)


def test_token_embed_gives_every_tokens_embedding(tiny_models: dict[str, TinyModel], one_thread: None) -> None:
    """vLLM's token_embed (`pooler_config={"task": "token_embed"}`): each token's final-norm hidden state,
    L2-normalized, = transformers' in fp32; prompts of different lengths in one batch, in chunks of at most 32
    tokens; nothing reused from the prefix cache (every row is needed); the sequence calls refused."""
    model = tiny_models["llama"]
    llm = pooling_llm(model, pooler_config={"task": "token_embed"})
    assert llm.pooling_task == "token_embed"
    prompts = random_prompts(LENGTHS, seed=6)
    for _ in range(2):
        outs = llm.encode(prompts, use_tqdm=False, pooling_task="token_embed")
        for prompt, out in zip(prompts, outs):
            assert out.prompt_token_ids == prompt and out.outputs.data.shape == (len(prompt), 64)
            torch.testing.assert_close(out.outputs.data, F.normalize(hf_hidden(model, prompt), dim=-1),
                                       atol=2e-5, rtol=1e-4)
        assert all_free(llm)
    assert llm.stats().prefix_cache_hit_tokens == 0
    raw = llm.encode(prompts[2], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(raw, hf_hidden(model, prompts[2]), atol=2e-5, rtol=1e-4)
    for call, words in ((llm.embed, "LLM.embed needs an embed model; this pooling model's task is 'token_embed' "
                                    r"\(the token tasks answer LLM.encode\)"),
                        (lambda p, **kw: llm.encode(p, pooling_task="embed", **kw), "pooling_task 'embed'")):
        with pytest.raises(ValueError, match=words):
            call("w5 w6", use_tqdm=False)
    for pooler_config, words in (({"task": "token_classify"}, "this model's task is 'embed', so it runs 'embed' or "
                                                              "'token_embed'"),
                                 ({"task": "token_embed", "pooling_type": "MEAN"}, "does not pool with 'MEAN'")):
        with pytest.raises((ConfigError, ValueError), match=words):
            pooling_llm(model, pooler_config=pooler_config)
    assert all_free(llm)


def test_a_pooling_model_takes_larger_steps_unless_told(tiny_models: dict[str, TinyModel], one_thread: None) -> None:
    """No config: `POOLING_MAX_BATCH_TOKENS` (its steps are all prompt tokens); a config or vLLM's name wins."""
    model = tiny_models["llama"]
    default = LLM(model.path, dtype="float32", runner="pooling")
    budget = default.engine.config.max_batch_tokens
    assert budget == POOLING_MAX_BATCH_TOKENS > ContinuousBatchingConfig().max_batch_tokens
    told = LLM(model.path, dtype="float32", runner="pooling", max_num_batched_tokens=64)
    assert told.engine.config.max_batch_tokens == 64
    given = LLM(model.path, dtype="float32", runner="pooling", config=ContinuousBatchingConfig(num_blocks=64))
    assert given.engine.config.max_batch_tokens == ContinuousBatchingConfig().max_batch_tokens
    prompts = random_prompts([40, 90, 17], seed=2)
    for a, b in zip(default.embed(prompts, use_tqdm=False), told.embed(prompts, use_tqdm=False)):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), atol=1e-5,
                                   rtol=0)
    assert all_free(default) and all_free(told) and all_free(given)
