"""Mixture-of-experts models (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE): greedy outputs equal transformers'
(fp32, eager attention and experts) with chunked prefill, mixed batches and prefix caching; the other
modes within the precision tests' tolerance; the grouping by expert; bad configs and checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from conveyor import LLM
from conveyor.config import ConfigError, ContinuousBatchingConfig
from conveyor.engine.graph_runner import use_cuda_graphs
from conveyor.layers.moe import Expert, SparseMoe, group_by_expert, route_softmax
from conveyor.layers.quantization.linear import matmul_ops
from conveyor.layers.quantization.tensors import bf16_rows, f32_rows, quantize_int4, quantize_int8
from conveyor.models.sharding import plan_shards

from tests.utils import (LENGTHS, MAX_NEW, MOE_CONFIGS, PAGE, QUANT_MODES, TinyModel, all_free,
                         assert_grouped_equals_loop, assert_mode_within_tolerance, assert_prefix_scenario_matches,
                         random_prompts, run_and_compare)

pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops: a busy 2-core box fork/joins slowly


@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_moe_models_match_transformers(moe_models: dict[str, TinyModel], kind: str) -> None:
    """Prompts of 1-250 tokens under a 64-token budget: chunked prefills beside decode rows."""
    model = moe_models[kind]
    llm = model.llm(max_batch_tokens=64)
    moe = [layer.mlp for layer in llm.engine.model.layers if layer.mlp is not None]
    assert len(moe) == (1 if kind == "qwen2_moe" else 2)
    assert all(block.block is not None for block in moe) or matmul_ops() is None  # fp32 experts in F32 tiles
    loads: list[list[int]] = []
    for block in moe:
        block.observer = loads.append
    run_and_compare(model, llm, random_prompts(LENGTHS), MAX_NEW, kind)
    assert all_free(llm)
    assert llm.stats().prefill_tokens == sum(LENGTHS)
    busy = [sum(1 for n in counts if n) for counts in loads]
    assert max(busy) == moe[0].num_experts and all(sum(c) % moe[0].top_k == 0 for c in loads)


def test_moe_prefix_caching_keeps_outputs(moe_models: dict[str, TinyModel]) -> None:
    model = moe_models["qwen2_moe"]
    llm = model.llm(page_size=PAGE, max_batch_tokens=24)
    assert_prefix_scenario_matches(llm, model.reference)
    assert llm.stats().prefix_cache_hit_tokens > 0


def test_ernie_moe_chooses_experts_with_its_correction_bias(tmp_path: Path) -> None:
    """ERNIE 4.5's per-expert bias moves which experts a token takes (not their weights): drawn large enough to
    reorder them, outputs still equal transformers'."""
    model = TinyModel("ernie4_5_moe", tmp_path, MOE_CONFIGS["ernie4_5_moe"]())
    with torch.no_grad():
        for name, param in model.reference.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.copy_(torch.linspace(0.3, -0.3, param.numel()).reshape(param.shape))
    model.reference.save_pretrained(model.path)
    llm = model.llm(max_batch_tokens=64)
    run_and_compare(model, llm, random_prompts([5, 30, 64]), [8, 8, 8], "ernie4_5_moe")
    assert all_free(llm)


@pytest.fixture(scope="module")
def smooth_moe(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Qwen2-MoE at a trained model's weight scale (as the precision tests' `llama_smooth`), tied head."""
    return TinyModel("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe_smooth"),
                     MOE_CONFIGS["qwen2_moe"](initializer_range=0.05, tie_word_embeddings=True))


@pytest.mark.parametrize("quantization", ["none", *QUANT_MODES])
def test_moe_modes_within_precision_tolerance(smooth_moe: TinyModel, quantization: str) -> None:
    """bf16 dense, int8 and int4 experts (the kernels' `QuantLinear`, router kept dense) against fp32,
    by the precision tests' limits (for the quantized modes: the weights' rounding included)."""
    block = assert_mode_within_tolerance(smooth_moe, quantization).engine.model.layers[0].mlp
    assert block.router.weight.dtype == torch.bfloat16


def test_grouping_is_one_stable_sort() -> None:
    ids = torch.tensor([[2, 0], [1, 2], [2, 3], [0, 1]])
    groups = group_by_expert(ids, 5)
    assert groups.counts == [2, 2, 3, 1, 0]
    assert groups.tokens.tolist() == [0, 3, 1, 3, 0, 1, 2, 2]  # by expert, tokens in batch order within one
    assert ids.reshape(-1)[groups.order].tolist() == [0, 0, 1, 1, 2, 2, 2, 3]


@torch.no_grad()
def test_sparse_block_equals_the_direct_sum() -> None:
    """Each token's output is the routing-weighted sum of its k experts' MLPs (renormalized or not)."""
    torch.manual_seed(0)
    for renormalize in (True, False):
        block = SparseMoe(16, 8, num_experts=5, top_k=3, renormalize=renormalize, shared_intermediate_size=4)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(7, 16)
        weights, ids = route_softmax(block.router(x), 3, renormalize)
        assert torch.allclose(weights.sum(-1), torch.ones(7)) == renormalize
        expected = torch.stack([sum(w * block.experts[e](x[t:t + 1])[0] for w, e in zip(weights[t], ids[t].tolist()))
                                for t in range(7)])
        expected += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        torch.testing.assert_close(block(x), expected)
        assert isinstance(block.experts[0], Expert)


@torch.no_grad()
@pytest.mark.parametrize(("dtype", "weights"), [(torch.float32, quantize_int8), (torch.float32, quantize_int4),
                                                (torch.float32, f32_rows), (torch.bfloat16, bf16_rows)])
def test_grouped_native_experts_equal_the_loop(dtype: torch.dtype, weights) -> None:
    """The one-call native experts (tiled weights) against the loop over experts on the same weights:
    the same kernels; with fp32 activations the same sums in the same order, bf16 rounds the loop's
    intermediates."""
    if matmul_ops() is None:
        pytest.skip("the native kernels did not build")
    torch.manual_seed(0)
    assert_grouped_equals_loop(SparseMoe(64, 32, num_experts=6, top_k=2, renormalize=False,
                                         shared_intermediate_size=32), dtype, weights)


@torch.no_grad()
@pytest.mark.parametrize("form", [dict(renormalize=True), dict(topk_softmax=True),
                                  dict(renormalize=True, selection_bias=True, norm_min=1e-12, shared_gate=False),
                                  dict(renormalize=True, selection_bias=True, sigmoid_scale=1.5),
                                  dict(renormalize=False, sigmoid_scale=2.0)])
def test_native_routing_equals_pytorchs(form: dict) -> None:
    """The native block's routing rules (Mixtral's renormalized softmax, the top-k logits' softmax, ERNIE's
    choosing bias over the softmax, LFM2's sigmoid scores with and without one) choose the experts PyTorch's
    functions choose (the observer's counts) and weigh them alike: fp32 outputs within rounding."""
    if matmul_ops() is None:
        pytest.skip("the native kernels did not build")
    torch.manual_seed(1)
    form = {"renormalize": False} | form
    block = SparseMoe(64, 32, num_experts=6, top_k=3, shared_intermediate_size=32, **form)
    assert block.route_name == ("sigmoid" if "sigmoid_scale" in form else "biased" if "selection_bias" in form
                                else "topk_softmax" if "topk_softmax" in form else "softmax")
    # (which leaves the block on PyTorch's ops; 1e-5: PyTorch's vectorized softmax takes its own e^x, an ulp off
    # libm's for about half the values on AVX2, and the routing weights scale the experts' outputs)
    assert_grouped_equals_loop(block, torch.float32, f32_rows, fp32_tol=1e-5)
    assert block.group_experts()
    x = torch.randn(40, 64)
    counts: list[list[int]] = []
    block.observer = counts.append
    block(x)
    native, block.block = block.block, None
    block(x)
    block.block = native
    assert counts[0] == counts[1]
    assert block(x[:0]).shape == (0, 64) and counts[2] == [0] * 6  # (an empty chunk)


@torch.no_grad()
def test_given_routes_sum_the_experts_alone_in_fp32() -> None:
    """Big bf16 chunks on AMX CPUs are routed by PyTorch and handed to the native block with their routes: it
    returns the experts' fp32 sum (the loop's, in fp32), not rounded, for the caller to add the shared expert."""
    if matmul_ops() is None:
        pytest.skip("the native kernels did not build")
    torch.manual_seed(2)
    block = SparseMoe(64, 32, num_experts=6, top_k=2, renormalize=True, shared_intermediate_size=32)
    assert_grouped_equals_loop(block, torch.float32, f32_rows)  # (tiles the experts; leaves the block off)
    assert block.group_experts()
    x = torch.randn(40, 64)
    weights, ids = block.route(x)
    out = block.block.forward(x, torch.empty(40, 64), 2, (weights, ids))
    groups = group_by_expert(ids, block.num_experts)
    loop = torch.zeros(40, 64)
    block.run_experts(x, groups, weights.reshape(-1).index_select(0, groups.order).unsqueeze(1), loop)
    torch.testing.assert_close(out, loop, rtol=1e-6, atol=1e-6)
    out = block.block.forward(x.bfloat16(), torch.empty(40, 64), 2, (weights, ids))
    assert not torch.equal(out, out.bfloat16().float())


def _copy(model: TinyModel, root: Path) -> Path:
    path = root / "copy"
    shutil.copytree(model.path, path)
    return path


def test_more_experts_per_token_than_experts_is_an_error(moe_models: dict[str, TinyModel], tmp_path: Path) -> None:
    path = _copy(moe_models["mixtral"], tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": 5}))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be between 1 and the number of experts \(4\)"):
        LLM(path, dtype="float32")


def test_a_missing_expert_tensor_is_named(moe_models: dict[str, TinyModel], tmp_path: Path) -> None:
    path = _copy(moe_models["mixtral"], tmp_path)
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    missing = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    del tensors[missing]
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"no tensor {missing} \(expert 3 of layer 1"):
        LLM(path, dtype="float32")


def test_tensor_parallel_moe_is_a_clear_error(moe_models: dict[str, TinyModel]) -> None:
    config = moe_models["qwen3_moe"].reference.config
    assert len(plan_shards(config, 1)) == 1
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        plan_shards(config, 2)


def test_no_cuda_graphs_for_moe() -> None:
    """The expert slices are sized on the host, so a CUDA graph cannot hold the forward."""
    gpu = torch.device("cuda")
    assert use_cuda_graphs(ContinuousBatchingConfig(), gpu, capturable=False) is False
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        use_cuda_graphs(ContinuousBatchingConfig(use_cuda_graph=True), gpu, capturable=False)
