"""gpt-oss (`GptOssForCausalLM`): attention sinks, alternating sliding and full layers, YaRN RoPE, biases,
and the sparse block (router bias, top-k then softmax, stacked interleaved experts, clamped SwiGLU).

A tiny random model (4 layers, sliding window 8 so every longer prompt crosses it, 8 experts top-2,
sinks and expert biases set to values that matter, a SwiGLU limit low enough to clamp) is compared
with transformers fp32 eager: greedy ids identical through chunked prefill, mixed batches and prefix
caching, on the native and the PyTorch attention backends; the other weight formats within the MoE
precision limits; the pieces (grouped experts, the Triton kernel's sinks) against references; bad
configs and checkpoints as clear errors."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import gguf
import pytest
import safetensors.torch
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError, ContinuousBatchingConfig
from conveyor.engine.graph_runner import use_cuda_graphs
from conveyor.layers.attention import CpuPagedAttention, TorchPagedAttention, TritonPagedAttention
from conveyor.layers.moe import ClampedSwiglu, SparseMoe
from conveyor.layers.quantization.linear import matmul_ops
from conveyor.layers.quantization.tensors import bf16_rows, f32_rows, quantize_int4, quantize_int8
from conveyor.models import GptOssForCausalLM
from conveyor.models.sharding import plan_shards

from tests.attention_utils import interpreter_only, ragged_metadata
from tests.gguf_writer import write_gpt_oss_gguf
from tests.utils import (GPT_OSS_LIMIT, LENGTHS, MAX_NEW, PAGE, QUANT_MODES, WINDOW, TinyModel, all_free,
                         assert_grouped_equals_loop, assert_mode_within_tolerance, assert_prefix_sharing_keeps_outputs,
                         gpt_oss_config, make_gpt_oss, make_smooth_gpt_oss, next_token_logprobs, random_prompts,
                         run_and_compare, tiny_tokenizer)

MXFP4 = gguf.GGMLQuantizationType.MXFP4

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def test_the_tiny_model_exercises_what_it_tests(gpt_oss: TinyModel) -> None:
    """Sliding and full layers, sinks that matter, gates past the clamp: else the tests below prove less."""
    config = gpt_oss.reference.config
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 and max(LENGTHS) > 4 * WINDOW
    llm = gpt_oss.llm()
    model = llm.engine.model
    assert model.layer_types == config.layer_types and model.sliding_window == WINDOW
    assert all(layer.sinks.abs().max() > 1 for layer in model.layers)
    x = torch.randn(64, config.hidden_size)
    gate_up = model.layers[0].mlp.experts[0].gate_up_proj(model.layers[0].post_attention_layernorm(x))
    assert (gate_up[:, :config.intermediate_size] > GPT_OSS_LIMIT).any()
    assert (gate_up[:, config.intermediate_size:].abs() > GPT_OSS_LIMIT).any()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gpt_oss_matches_transformers(gpt_oss: TinyModel, backend: str) -> None:
    """Prompts of 1-250 tokens under a 64-token budget: chunked prefills beside decode rows, contexts
    past the window, on the native CPU kernels (fp32 experts grouped in F32 tiles) and on PyTorch."""
    llm = gpt_oss.llm(max_batch_tokens=64, attention_backend=backend)
    engine_backend = llm.engine.runner.attention
    expected = CpuPagedAttention if backend == "auto" and matmul_ops() is not None else TorchPagedAttention
    assert type(engine_backend) is expected
    blocks = [layer.mlp for layer in llm.engine.model.layers]
    assert all(block.block is not None for block in blocks) or matmul_ops() is None
    run_and_compare(gpt_oss, llm, random_prompts(LENGTHS, seed=3), MAX_NEW, f"gpt-oss ({backend})")
    assert all_free(llm)
    assert llm.stats().prefill_tokens == sum(LENGTHS)


def test_gpt_oss_prefix_caching_keeps_outputs(gpt_oss: TinyModel) -> None:
    """Its sliding layers resume from the windows' snapshots: the hits full attention alone would get."""
    assert_prefix_sharing_keeps_outputs(gpt_oss, (10 + 12 + 11 + 14) * PAGE)  # as tests/cache/test_sliding.py's


def test_gpt_oss_is_batch_invariant(gpt_oss: TinyModel) -> None:
    """bf16 with `batch_invariant=True`: sinks, sliding layers and the grouped experts give a request the
    same tokens and bitwise the same logprobs alone and batched with others in chunks of 32 tokens."""
    prompts = random_prompts([40, 7, 90, 13, 25, 60], seed=2)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    llm = gpt_oss.llm(dtype="bfloat16", batch_invariant=True, max_batch_tokens=32)
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, together in zip(prompts, batched):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert (alone.token_ids, alone.logprobs) == (together.token_ids, together.logprobs)
    assert all_free(llm)


@pytest.fixture(scope="module")
def smooth_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_smooth_gpt_oss(tmp_path_factory.mktemp("gpt_oss_smooth"))


@pytest.mark.parametrize("quantization", ["none", *QUANT_MODES])
def test_gpt_oss_modes_within_precision_tolerance(smooth_gpt_oss: TinyModel, quantization: str) -> None:
    """bf16 dense, int8 and int4 experts (with their biases; router and sinks dense) against fp32, by the
    precision tests' limits."""
    block = assert_mode_within_tolerance(smooth_gpt_oss, quantization).engine.model.layers[0].mlp
    assert block.router.bias is not None and block.experts[0].down_proj.bias is not None


@torch.no_grad()
def test_sparse_block_is_transformers_gpt_oss_mlp() -> None:
    """The block (PyTorch loop) against transformers' `GptOssMLP` on the same weights, de-interleaved as
    the loader does: router bias, top-k then softmax, expert biases, the clamped SwiGLU."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = gpt_oss_config(hidden_size=32, intermediate_size=16)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    ref = GptOssMLP(config).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.5)
    block = SparseMoe(32, 16, 8, 2, renormalize=False, activation=ClampedSwiglu(config.swiglu_alpha, GPT_OSS_LIMIT))
    block.router.weight.copy_(ref.router.weight)
    block.router.bias.copy_(ref.router.bias)
    experts = ref.experts
    for e, expert in enumerate(block.experts):
        rows = experts.gate_up_proj[e].T
        expert.gate_up_proj.weight.copy_(torch.cat((rows[0::2], rows[1::2])))
        expert.gate_up_proj.bias.copy_(torch.cat((experts.gate_up_proj_bias[e, 0::2],
                                                  experts.gate_up_proj_bias[e, 1::2])))
        expert.down_proj.weight.copy_(experts.down_proj[e].T)
        expert.down_proj.bias.copy_(experts.down_proj_bias[e])
    x = torch.randn(1, 40, 32)
    torch.testing.assert_close(block(x[0]), ref(x)[0][0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize(("dtype", "weights"), [(torch.float32, quantize_int8), (torch.float32, quantize_int4),
                                                (torch.float32, f32_rows), (torch.bfloat16, bf16_rows)])
def test_grouped_native_experts_with_biases_and_clamped_swiglu_equal_the_loop(dtype: torch.dtype, weights) -> None:
    """gpt-oss's experts in the one-call native kernel (biases, clamped SwiGLU) against the loop over
    experts on the same tiled weights."""
    if matmul_ops() is None:
        pytest.skip("the native kernels did not build")
    torch.manual_seed(0)
    block = SparseMoe(64, 32, num_experts=6, top_k=2, renormalize=False, activation=ClampedSwiglu(1.702, 1.5))
    assert block.experts[0].gate_up_proj.bias is not None and block.router.bias is not None
    assert_grouped_equals_loop(block, dtype, weights, fp32_tol=1e-5)  # (the kernel's e^x is not libm's)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_takes_attention_sinks(dtype: torch.dtype) -> None:
    """The Triton kernel (under the interpreter) with sinks against the PyTorch backend's eager sinks, on
    a ragged batch of decode rows and prefill chunks across a sliding window."""
    specs = [(1, 2), (1, 30), (6, 0), (12, 20)]
    heads, kv_heads, dim, page, window, num_chunks = 4, 2, 16, 4, 8, 64
    g = torch.Generator().manual_seed(1)
    total = sum(n for n, _ in specs)
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(total, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_chunks * page, kv_heads, dim, generator=g).to(dtype)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    outputs = []
    for backend, s in ((TorchPagedAttention(), sinks), (TritonPagedAttention(), sinks), (TritonPagedAttention(), None)):
        meta = ragged_metadata(specs, page, window, num_chunks, 0, torch.device("cpu"))
        backend.prepare(meta)
        outputs.append(backend.forward(q, k, v, cache.clone(), meta, dim ** -0.5, None, s).float())
    ref, out, plain = outputs
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    assert (plain - out).abs().max() > 0.1


def _edited(model: TinyModel, root: Path, config: dict | None = None,
            tensors: dict[str, torch.Tensor] | None = None) -> Path:
    path = root / "copy"
    shutil.copytree(model.path, path)
    if config:
        (path / "config.json").write_text(json.dumps(json.loads((path / "config.json").read_text()) | config))
    if tensors:
        weights = safetensors.torch.load_file(path / "model.safetensors") | tensors
        safetensors.torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_sink_count_that_does_not_match_the_heads_is_an_error(gpt_oss: TinyModel, tmp_path: Path) -> None:
    path = _edited(gpt_oss, tmp_path, tensors={"model.layers.2.self_attn.sinks": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"model.layers.2.self_attn.sinks \(the attention sinks, one logit per query "
                                         r"head \(4\) of layer 2\) has shape \(3,\), the config needs \(4,\)"):
        LLM(path, dtype="float32")


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(supported: silu"),
    ({"swiglu_limit": 0.0}, r"swiglu_limit positive, got 1.702 and 0.0"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be between 1 and the number of experts \(8\)"),
])
def test_bad_gpt_oss_configs_are_clear_errors(gpt_oss: TinyModel, tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(_edited(gpt_oss, tmp_path, config=change), dtype="float32")


def test_missing_expert_biases_are_named(gpt_oss: TinyModel, tmp_path: Path) -> None:
    path = _edited(gpt_oss, tmp_path)
    weights = safetensors.torch.load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.down_proj_bias"]
    safetensors.torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor model.layers.1.mlp.experts.down_proj_bias \(the experts' down "
                                         r"biases of layer 1\)"):
        LLM(path, dtype="float32")


def test_tensor_parallel_and_cuda_graphs_refuse_gpt_oss(gpt_oss: TinyModel) -> None:
    """As for the other mixture-of-experts families: not split over ranks, no CUDA graphs (the expert
    slices are sized on the host)."""
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        plan_shards(gpt_oss.reference.config, 2)
    assert GptOssForCausalLM.cuda_graphs is False  # what the engine passes as `capturable`
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        use_cuda_graphs(ContinuousBatchingConfig(use_cuda_graph=True), torch.device("cuda"), capturable=False)


def mxfp4_rounded(model: TinyModel, path: Path) -> Path:
    """A directory of `model` with its experts' matrices rounded to MXFP4 (what such a GGUF file holds)."""
    rounded = copy.deepcopy(model.reference)
    with torch.no_grad():
        for layer in rounded.model.layers:
            for weights in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                rows = weights.transpose(1, 2).contiguous().numpy()  # as the file's rows: blocks along the inputs
                back = gguf.quants.dequantize(gguf.quants.quantize(rows, MXFP4), MXFP4).reshape(rows.shape)
                weights.copy_(torch.from_numpy(back).transpose(1, 2))
    rounded.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_gguf_files_load_like_the_directory(tmp_path: Path, gguf_tokenizer: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss as llama.cpp's converter writes it (`gpt-oss`: gate and up apart, biases, sinks, YaRN): F32
    experts give the directory's greedy ids; MXFP4 experts give those of the directory holding their rounded
    values, exactly in fp32 (dequantized) and kept as MXFP4 blocks (within int8's tolerance).
    (llama.cpp fixes gpt-oss's SwiGLU limit at the released 7.0, which no metadata changes: so does the model,
    at the smooth model's weight scale, which the int8 tolerance is measured on.)"""
    gpt_oss = make_gpt_oss(tmp_path / "hf", embed_scale=20.0, initializer_range=0.05, swiglu_limit=7.0)
    config = ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=64)
    prompts = random_prompts([5, 17, 40], seed=23)
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)

    def ids(path: Path, **kwargs: object) -> list[list[int]]:
        llm = LLM(path, config=config, **{"dtype": "float32"} | kwargs)
        outs = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert all_free(llm)
        return outs

    write_gpt_oss_gguf(tmp_path / "f32.gguf", gpt_oss.reference, MXFP4.F32)
    assert ids(tmp_path / "f32.gguf") == ids(gpt_oss.path)
    write_gpt_oss_gguf(tmp_path / "mxfp4.gguf", gpt_oss.reference, MXFP4)
    exact = mxfp4_rounded(gpt_oss, tmp_path / "rounded")
    assert ids(tmp_path / "mxfp4.gguf") == ids(exact)
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))  # fp32 around the blocks
    kept = LLM(tmp_path / "mxfp4.gguf", dtype="auto", config=config)
    monkeypatch.undo()
    expert = kept.engine.model.layers[0].mlp.experts[0].gate_up_proj
    assert kept.quantization == "gguf" and [seg.type_name for seg in expert.kernel.segments] == ["MXFP4"]
    tolerance, _ = QUANT_MODES["int8"][0]
    reference = LLM(exact, dtype="float32", config=config)
    err = (next_token_logprobs(kept, prompts) - next_token_logprobs(reference, prompts)).abs().max().item()
    assert err < tolerance, f"MXFP4 experts: log-prob error {err:.3f}"
