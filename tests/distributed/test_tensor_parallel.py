"""Tensor parallelism: the split plan and its refusals, shards read from
the file as slices, TP=2 over gloo against transformers (fp32, the tie rule) and against TP=1 (a GGUF
file's quantized blocks, int8, int4, bf16: the precision tests' tolerance), two torchrun "nodes" on
loopback, and a rank that dies.

Ranks are spawned once for the module (later models load into the same ranks) and stopped after it.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.distributed import launch
from conveyor.errors import ConfigError
from conveyor.layers.quantization.tensors import QuantizedTensor
from conveyor.manager import EngineDeadError
from conveyor.models.loader import load_checkpoint, read_config
from conveyor.models.sharding import plan_shards, valid_sizes
from conveyor.scaleout.net import free_port

from tests.gguf_writer import GGUF_TYPES, write_quantized_gguf
from tests.utils import (BF16_AGREEMENT, BF16_TOLERANCE, TinyModel, agreement, all_free, assert_greedy_match,
                         greedy_ids, hf_greedy, next_token_logprobs, random_prompts)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = random_prompts([5, 9, 14, 20, 3, 30, 11], seed=7)


@pytest.fixture(scope="module", autouse=True)
def ranks_stop_after_the_module():
    yield
    launch.shutdown()


def tp_llm(path: Path | str, tp: int = 2, dtype: str = "float32", quantization: str | None = None,
           **config: object) -> LLM:
    return LLM(path, dtype=dtype, quantization=quantization, tensor_parallel_size=tp,
               config=ContinuousBatchingConfig(num_blocks=128, **config))


# -- the plan -------------------------------------------------------------------------------------
def test_plan_splits_whole_kv_groups(tiny_llama: TinyModel) -> None:
    config = read_config(tiny_llama.path)  # 4 query heads in 2 KV groups, MLP 128, vocab 300
    even = plan_shards(config, 2)
    assert [(p.q_heads, p.kv_heads, p.intermediate, p.vocab) for p in even] == [
        ((0, 2), (0, 1), (0, 64), (0, 150)), ((2, 4), (1, 2), (64, 128), (150, 300))]
    replicated = plan_shards(config, 4)  # each KV head on two ranks, one query head each
    assert [(p.q_heads, p.kv_heads) for p in replicated] == [((0, 1), (0, 1)), ((1, 2), (0, 1)),
                                                             ((2, 3), (1, 2)), ((3, 4), (1, 2))]
    assert replicated[3].vocab == (225, 300) and replicated[0].vocab_shard_rows == 75
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 9, 3, 16  # the built-in model's
    uneven = plan_shards(config, 2)
    assert [(p.q_heads, p.kv_heads) for p in uneven] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert valid_sizes(9, 3) == [1, 2, 3, 9] and valid_sizes(4, 2) == [1, 2, 4]
    sel = even[1].select
    assert sel("model.layers.0.self_attn.q_proj.weight", (64, 64)) == (0, 32, 64)
    assert sel("model.layers.0.self_attn.v_proj.bias", (32,)) == (0, 16, 32)
    assert sel("model.layers.0.self_attn.o_proj.weight", (64, 64)) == (1, 32, 64)
    assert sel("model.layers.0.mlp.down_proj.weight", (64, 128)) == (1, 64, 128)
    assert sel("lm_head.weight", (300, 64)) == (0, 150, 300)
    assert sel("model.layers.0.input_layernorm.weight", (64,)) is None


def test_bad_sizes_fail_before_anything_starts(tiny_llama: TinyModel) -> None:
    before = launch._CURRENT
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 cannot split .* sizes that work: \[1, 2, 4\]"):
        tp_llm(tiny_llama.path, tp=3)
    with pytest.raises(ConfigError, match="use_cuda_graph=True does not combine"):
        ContinuousBatchingConfig(tensor_parallel_size=2, use_cuda_graph=True)
    with pytest.raises(ConfigError, match="draft model does not combine"):
        ContinuousBatchingConfig(tensor_parallel_size=2, speculative_config={
            "method": "draft_model", "quantization": "int4", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="cpu_offload_space > 0 does not combine"):
        ContinuousBatchingConfig(tensor_parallel_size=2, cpu_offload_space=1.0)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        ContinuousBatchingConfig(tensor_parallel_size=0)
    assert launch._CURRENT is before  # nothing was spawned


def test_families_not_split_yet_refuse_tensor_parallelism(tiny_models: dict[str, TinyModel]) -> None:
    for kind, reason in (("olmo2", "normalizes q and k over all heads together"),
                         ("olmo3", "normalizes q and k over all heads together"),
                         ("glm", "checkpoints store gate/up fused"), ("glm4", "checkpoints store gate/up fused"),
                         ("cohere", "with use_qk_norm"), ("starcoder2", "has an MLP of c_fc and c_proj")):
        config = tiny_models[kind].reference.config
        assert len(plan_shards(config, 1)) == 1
        with pytest.raises(ConfigError, match=f"{kind} {reason}"):
            plan_shards(config, 2)


# -- shards are slices of the file -----------------------------------------------------------------
def test_safetensors_shards_are_the_slices(tiny_llama: TinyModel) -> None:
    full = load_checkpoint(tiny_llama.path, tokenizer=False).state_dict
    plan = plan_shards(read_config(tiny_llama.path), 2)[1]
    shard = load_checkpoint(tiny_llama.path, select=plan.select, tokenizer=False).state_dict
    for name, tensor in full.items():
        selection = plan.select(name, tuple(tensor.shape))
        if selection is None:
            assert torch.equal(shard[name], tensor), name
        else:
            dim, start, stop = selection
            assert torch.equal(shard[name], tensor.narrow(dim, start, stop - start)), name


@pytest.fixture(scope="module")
def quantized_gguf(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smooth tiny Llama (weights at a trained model's scale, as the precision tests measure on) as
    llama.cpp writes it, in Q4_0, Q4_1 and Q8_0 (qkv of two types)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q.gguf"
    write_quantized_gguf(path, tiny_models["llama_smooth"], GGUF_TYPES)
    return path


def test_gguf_shards_keep_whole_blocks(quantized_gguf: Path) -> None:
    """Rows and block-aligned columns stay quantized (the file's bytes); columns that cut a block are
    dequantized first, then sliced; Q/K rows are un-permuted per shard as the whole file would be."""
    kept = load_checkpoint(quantized_gguf, keep_quantized=True, tokenizer=False).state_dict
    plan = plan_shards(read_config(quantized_gguf), 2)[1]
    shard = load_checkpoint(quantized_gguf, keep_quantized=True, select=plan.select, tokenizer=False).state_dict
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        assert isinstance(shard[name], QuantizedTensor), name
        dim, start, stop = plan.select(name, kept[name].shape)
        assert torch.equal(shard[name].dequantize(), kept[name].dequantize().narrow(dim, start, stop - start)), name

    def cut(name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        return (1, 16, 48) if name.endswith("o_proj.weight") else None  # not on 32-weight blocks

    odd = load_checkpoint(quantized_gguf, keep_quantized=True, select=cut, tokenizer=False).state_dict
    o = "model.layers.0.self_attn.o_proj.weight"
    assert not isinstance(odd[o], QuantizedTensor) and torch.equal(odd[o], kept[o].dequantize()[:, 16:48])


# -- TP=2 against transformers and against TP=1 ------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "gemma3", "smollm3", "granite", "ernie4_5", "ministral3",
                                  "exaone4", "seed_oss", "hunyuan", "cohere2", "arcee"])
def test_tp2_greedy_matches_transformers(tiny_models: dict[str, TinyModel], kind: str) -> None:
    model = tiny_models[kind]
    llm = tp_llm(model.path)
    assert llm.engine.pool.kv[0].shape[2] == model.reference.config.num_key_value_heads // 2  # this rank's heads
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, logits = hf_greedy(model.reference, prompt, 16)
        assert_greedy_match(out.token_ids, ref, logits, f"{kind} TP=2")
    assert all_free(llm)
    llm.shutdown()


def test_tp2_logprobs_and_seeded_sampling_equal_tp1(tiny_llama: TinyModel) -> None:
    """Several LM-head calls a step (prompt logprobs in slices), logprobs and seeded sampling on rank 0."""
    params = [SamplingParams(max_new_tokens=6, temperature=0, prompt_logprobs=2, logprobs=2),
              SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)]
    prompts = PROMPTS[:2]
    config = ContinuousBatchingConfig(num_blocks=128, max_requests_per_batch=4)  # prompt logprobs in slices of 4
    one = LLM(tiny_llama.path, dtype="float32", config=config)
    two = tp_llm(tiny_llama.path, max_requests_per_batch=4)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (one, two))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a[0].prompt_logprobs[1:] + a[0].logprobs, b[0].prompt_logprobs[1:] + b[0].logprobs):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert all_free(two)
    two.shutdown()


def test_tp2_speculation_prefix_cache_and_padding_equal_tp1(tiny_llama: TinyModel) -> None:
    """n-gram proposals (decode rows verifying several tokens), shared prefix blocks and padded steps run
    through the same calls on every rank."""
    base = PROMPTS[3]
    prompts = [base + base[:8] * 3, base + [7, 8], base + [9]]  # repeats to copy from; a shared prefix
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    config = ContinuousBatchingConfig(num_blocks=128, speculative_config=spec)
    one = LLM(tiny_llama.path, dtype="float32", config=config)
    two = tp_llm(tiny_llama.path, speculative_config=spec, pad_steps=True)
    a, b = ([o.token_ids for batch in (prompts[:1], prompts[1:]) for o in llm.generate(batch, params, use_tqdm=False)]
            for llm in (one, two))  # the second batch reuses the first one's cached prefix blocks
    assert a == b
    stats = two.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.prefix_cache_hit_tokens > 0
    assert all_free(two)
    two.shutdown()


def test_tp2_gguf_blocks_close_to_tp1(quantized_gguf: Path, gguf_tokenizer: None) -> None:
    """The file's Q4_0/Q4_1/Q8_0 blocks split as they are: only the order of the sums changes."""
    one, two = LLM(quantized_gguf), tp_llm(quantized_gguf, dtype="auto")
    assert one.quantization == two.quantization == "gguf"
    err = (next_token_logprobs(two, PROMPTS) - next_token_logprobs(one, PROMPTS)).abs().max().item()
    rate = agreement(greedy_ids(two, PROMPTS), greedy_ids(one, PROMPTS))
    print(f"gguf TP=2 vs TP=1: log-prob error {err:.4f}, greedy agreement {rate:.2f}")
    assert err < BF16_TOLERANCE, f"gguf TP=2 vs TP=1: log-prob error {err:.3f}"
    assert rate >= BF16_AGREEMENT, f"gguf TP=2 vs TP=1: greedy agreement {rate:.2f}"
    assert all_free(two)
    two.shutdown()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tp2_quantized_from_floats_close_to_tp1(tiny_models: dict[str, TinyModel], quantization: str) -> None:
    """int8 and int4 made from the float shards (int4's groups of 32 are TP=1's; int8's per-row scale of o
    and down covers the rank's columns only)."""
    smooth = tiny_models["llama_smooth"]
    one = LLM(smooth.path, quantization=quantization, config=ContinuousBatchingConfig(num_blocks=128))
    two = tp_llm(smooth.path, dtype="auto", quantization=quantization)
    assert two.quantization == quantization
    err = (next_token_logprobs(two, PROMPTS) - next_token_logprobs(one, PROMPTS)).abs().max().item()
    rate = agreement(greedy_ids(two, PROMPTS), greedy_ids(one, PROMPTS))
    print(f"{quantization} TP=2 vs TP=1: log-prob error {err:.4f}, greedy agreement {rate:.2f}")
    assert err < BF16_TOLERANCE and rate >= BF16_AGREEMENT
    two.shutdown()


def test_tp2_bf16_within_the_precision_tolerance(tiny_models: dict[str, TinyModel]) -> None:
    smooth = tiny_models["llama_smooth"]
    fp32 = LLM(smooth.path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=128))
    two = tp_llm(smooth.path, dtype="bfloat16")
    err = (next_token_logprobs(two, PROMPTS) - next_token_logprobs(fp32, PROMPTS)).abs().max().item()
    rate = agreement(greedy_ids(two, PROMPTS), greedy_ids(fp32, PROMPTS))
    print(f"bf16 TP=2 vs fp32: log-prob error {err:.4f}, greedy agreement {rate:.2f}")
    assert err < BF16_TOLERANCE, f"bf16 TP=2 vs fp32: log-prob error {err:.3f}"
    assert rate >= BF16_AGREEMENT
    two.shutdown()


# -- torchrun across "nodes" -----------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None, reason="torchrun is not installed")
def test_torchrun_two_nodes_on_loopback(tiny_llama: TinyModel) -> None:
    """Two torchrun agents (`--nnodes 2`, one process each) on a loopback rendezvous run `conveyor generate`;
    rank 0 prints what TP=1 gives, rank 1 serves it and exits 0."""
    port, prompt = free_port(), "w5 w17 w42 w8"
    cli = ["-m", "conveyor.cli", "generate", "--raw", prompt, "--model", str(tiny_llama.path), "--dtype", "float32",
           "--max-new-tokens", "12", "--ignore-eos", "--num-blocks", "64", "--tensor-parallel-size", "2"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *cli], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        results = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    one = LLM(tiny_llama.path, dtype="float32", config=ContinuousBatchingConfig(num_blocks=64))
    expected = one.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].text
    assert f"### {prompt}\n{expected}\n" in results[0][0]
    assert results[1][0] == ""  # rank 1 prints nothing: it only served rank 0


# -- failures ---------------------------------------------------------------------------------------
def test_a_dead_rank_ends_the_group_with_a_clear_error(tiny_llama: TinyModel) -> None:
    """kill -9 of rank 1 mid-generation: every request ends with an error naming it, within seconds; the
    engine is dead (EngineDeadError), its blocks returned; the next model gets a fresh group."""
    llm = tp_llm(tiny_llama.path)
    worker = launch._CURRENT.processes[1]
    long = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    with llm.manager:
        stream = llm.manager.request_id_iter(llm.manager.add_request(PROMPTS[0], long, streaming=True))
        others = [llm.manager.add_request(p, long) for p in PROMPTS[1:3]]
        assert not next(stream).finished  # decoding has started
        killed = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        finals = [llm.manager.get_result(rid, timeout=30) for rid in others]
        finals.append(list(stream)[-1])
        took = time.monotonic() - killed
    assert took < 20, f"the failure took {took:.1f} s to end the requests"
    for out in finals:
        assert out.finish_reason == "error" and f"rank 1 (pid {worker.pid}) was killed by SIGKILL" in out.error
        assert out.num_output_tokens < 400
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.manager.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2))
    assert all_free(llm)
    again = tp_llm(tiny_llama.path)  # a new group replaces the failed one
    assert launch._CURRENT.processes[1].pid != worker.pid
    out = again.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0), use_tqdm=False)[0]
    assert out.finish_reason in ("length", "stop") and out.error is None


def test_tp2_int8_kv_cache_equals_tp1(tiny_llama: TinyModel) -> None:
    """kv_cache_dtype="int8" split over two ranks: each rank's pool mirrors rank 0's int8 rows (their width
    and storage travel with the pool's shape), the greedy tokens equal one process's."""
    config = ContinuousBatchingConfig(num_blocks=128, kv_cache_dtype="int8")
    one = LLM(tiny_llama.path, dtype="float32", config=config)
    two = tp_llm(tiny_llama.path, kv_cache_dtype="int8")
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)] == \
        [o.token_ids for o in two.generate(PROMPTS, params, use_tqdm=False)]
    assert all_free(two)
    two.shutdown()
