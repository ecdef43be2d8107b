"""MXFP4 checkpoints (how gpt-oss ships its experts): blocks reordered into llama.cpp's MXFP4 rows, whose
values (gguf's dequantization, the kernels' tiles) are transformers' bit for bit; a tiny MXFP4 gpt-oss
written here (random experts quantized to e2m1 with e8m0 scales) runs on the exact path with greedy ids
identical to transformers on the dequantized weights, and by default on the kernels' MXFP4 tiles within the
quantized modes' limits; scales no fp16 holds fall back to dense, saying so; the format is refused where it
does not apply."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from conveyor import LLM, SamplingParams
from conveyor.layers.quantization.linear import QuantLinear
from conveyor.kernels import cpu_matmul_ops
from conveyor.layers.quantization.mxfp4 import FP4_VALUES, dequantize_mxfp4, mxfp4_tensor

from tests.utils import (QUANT_MODES, TinyModel, agreement, assert_greedy_match, greedy_ids, hf_greedy,
                         make_smooth_gpt_oss, next_token_logprobs, random_prompts)

pytestmark = pytest.mark.usefixtures("one_thread")
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., rows, cols]` floats as MXFP4: per 32 values the e8m0 exponent that brings their largest to
    at most 6, each value rounded to the nearest e2m1. Returns blocks `[..., rows, cols / 32, 16]` (value
    2j in the low nibble of byte j) and scales `[..., rows, cols / 32]`."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0 ** -60) / 6)).clamp(-127, 127)
    x = g / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (x.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) | ((x < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4(model: TinyModel, path: Path) -> TinyModel:
    """`model` saved as an MXFP4 checkpoint (its experts' blocks and scales, the rest as it was), with a
    reference whose experts are transformers' dequantization of those blocks."""
    shutil.copytree(model.path, path)
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    reference = model.reference
    for i, layer in enumerate(reference.model.layers):
        for name in EXPERT_TENSORS:
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))  # rows: output features
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    copy = object.__new__(TinyModel)
    copy.reference, copy.path = reference, path
    return copy


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    base = make_smooth_gpt_oss(tmp_path_factory.mktemp("gpt_oss_base"))
    return write_mxfp4(base, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "model")


def test_mxfp4_blocks_become_ggml_rows_bit_for_bit() -> None:
    """Every code and every exponent fp16 holds: the MXFP4 tensor (its own dequantization, gguf's, and the
    kernels' tiles') and `dequantize_mxfp4` equal transformers' dequantization exactly."""
    g = torch.Generator().manual_seed(0)
    rows, groups = 48, 6
    blocks = torch.randint(0, 256, (1, rows, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 23, 127 + 17, (1, rows, groups), generator=g, dtype=torch.uint8)
    scales[0, 0] = torch.arange(127 - 23, 127 + 17)[:groups]  # the range's ends
    scales[0, 1] = torch.arange(127 + 17 - groups, 127 + 17)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0].T  # [rows, 32 * groups]
    packed = mxfp4_tensor(blocks[0], scales[0])
    assert packed.type_name == "MXFP4" and packed.shape == (rows, 32 * groups)
    assert packed.nbytes == rows * groups * 17  # 4.25 bits a weight, as the file
    assert torch.equal(packed.dequantize(), expected)
    ops = cpu_matmul_ops()
    assert ops is None or torch.equal(packed.tiled(ops).dequantize(), expected)
    assert torch.equal(dequantize_mxfp4(blocks[0], scales[0]), expected)


def test_mxfp4_scales_fp16_cannot_hold_are_refused_unless_the_block_is_zero() -> None:
    blocks = torch.full((2, 1, 16), 0x21, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"1 MXFP4 blocks have scales outside fp16's powers of two "
                                         r"\(2\^-24 to 2\^15\), first: row 1, block 0, e8m0 200"):
        mxfp4_tensor(blocks, torch.tensor([[127], [200]], dtype=torch.uint8))
    blocks[1] = 0x88  # -0 and -0: nothing for the scale to scale
    assert torch.equal(mxfp4_tensor(blocks, torch.tensor([[127], [200]], dtype=torch.uint8)).dequantize()[1],
                       torch.zeros(32))


def test_mxfp4_checkpoint_exact_path_matches_transformers(mxfp4_model: TinyModel) -> None:
    """fp32: the blocks dequantized (exactly), greedy ids identical to transformers on the same values."""
    llm = mxfp4_model.llm()
    assert llm.quantization == "none"
    prompts, max_new = random_prompts([3, 17, 40], seed=8), [8, 12, 6]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in max_new]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, n, out) in enumerate(zip(prompts, max_new, outputs)):
        ref, logits = hf_greedy(mxfp4_model.reference, prompt, n)
        assert_greedy_match(out.token_ids, ref, logits, f"mxfp4 prompt {i}")


def test_mxfp4_checkpoint_runs_as_mxfp4_by_default(mxfp4_model: TinyModel) -> None:
    """Without a quantization asked for, the experts stay quantized as the file's MXFP4 blocks, within the
    quantized modes' limits against the exact path on the same values."""
    prompts = random_prompts([5, 9, 14, 20, 3, 30, 11, 7], seed=41)
    llm = mxfp4_model.llm(dtype="bfloat16")
    assert llm.quantization == "mxfp4"
    expert = llm.engine.model.layers[1].mlp.experts[3]
    assert all(isinstance(m, QuantLinear) and [s.type_name for s in m.kernel.segments] == ["MXFP4"]
               for m in (expert.gate_up_proj, expert.down_proj))
    assert not isinstance(llm.engine.model.layers[1].qkv_proj, QuantLinear) or \
        llm.engine.model.layers[1].qkv_proj.kernel.segments[0].type_name == "BF16"  # attention stays dense
    exact = mxfp4_model.llm()
    tolerance, least = QUANT_MODES["int8"][0]  # int8 activations against the same weights' fp32 run
    err = (next_token_logprobs(llm, prompts) - next_token_logprobs(exact, prompts)).abs().max().item()
    assert err < tolerance, f"mxfp4: log-prob error {err:.3f}"
    assert agreement(greedy_ids(llm, prompts), greedy_ids(exact, prompts)) >= least


def test_mxfp4_blocks_out_of_fp16_range_load_dense(mxfp4_model: TinyModel, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "copy"
    shutil.copytree(mxfp4_model.path, path)
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    key = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[key][2, 0, 0] = 200  # one block of expert 2 at 2^73
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        llm = LLM(path, dtype="bfloat16")
    assert "model.layers.0.mlp.experts.down_proj, expert 2: 1 MXFP4 blocks have scales outside" in caplog.text
    experts = llm.engine.model.layers[0].mlp.experts
    assert [s.type_name for s in experts[2].down_proj.kernel.segments] == ["BF16"]
    assert [s.type_name for s in experts[1].down_proj.kernel.segments] == ["MXFP4"]


def test_mxfp4_is_refused_where_it_does_not_apply(mxfp4_model: TinyModel, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization='mxfp4' needs an MXFP4 checkpoint"):
        LLM(tmp_path, dtype="bfloat16", quantization="mxfp4")
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a GGUF file"):
        LLM(mxfp4_model.path, dtype="bfloat16", quantization="gguf")
    with pytest.raises(ValueError, match="exact path"):
        LLM(mxfp4_model.path, dtype="float32", quantization="mxfp4")
