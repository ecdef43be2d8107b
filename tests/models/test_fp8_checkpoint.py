"""FP8 checkpoints (`quant_method` "fp8"): e4m3 weights with block scales (`weight_scale_inv`, blocks that need
not divide the matrices) or row scales (`weight_scale`) dequantized at load; greedy ids equal transformers' on
its own dequantization of the same checkpoint (fp32 on a CPU); a weight without its scale is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conveyor import LLM, ContinuousBatchingConfig, SamplingParams
from conveyor.models.loader import ModelLoadError, load_checkpoint

from tests.utils import TinyModel, all_free, assert_greedy_match, hf_greedy, random_prompts


def fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` as e4m3 with one scale per `block` (the last blocks cut short), as the FP8 releases store it."""
    rows, cols = w.shape
    scales = torch.zeros(-(-rows // block[0]), -(-cols // block[1]))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scales[i, j] = part.abs().max() / 448
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scales[i, j]).to(q.dtype)
    return q, scales


def write_fp8(model: TinyModel, path: Path, block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """The model's directory with its projections in FP8: block scales, or (block None) one per row."""
    path.mkdir()
    for f in model.path.iterdir():
        if f.name != "model.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(model.path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w = tensors.pop(name)
        if block is None:
            scale = w.abs().amax(dim=1, keepdim=True) / 448
            tensors[name], tensors[name + "_scale"] = (w / scale).to(torch.float8_e4m3fn), scale
        else:
            tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(w, block)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"} | (
        {} if block is None else {"weight_block_size": list(block)})
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def test_block_scaled_fp8_runs_as_transformers_dequantizes_it(tiny_llama: TinyModel, tmp_path: Path) -> None:
    write_fp8(tiny_llama, tmp_path / "fp8", (32, 32))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    llm = LLM(tmp_path / "fp8", dtype="float32", config=ContinuousBatchingConfig(num_blocks=64))
    ours = llm.engine.model.layers[0].qkv_proj.weight[:tiny_llama.reference.config.hidden_size]
    assert torch.equal(ours, reference.model.layers[0].self_attn.q_proj.weight.detach())
    prompts = random_prompts([5, 17, 30], seed=31)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        ref, logits = hf_greedy(reference, prompt, 8)
        assert_greedy_match(out.token_ids, ref, logits, "fp8 checkpoint")
    assert all_free(llm)


def test_blocks_that_do_not_divide_the_matrix(tiny_llama: TinyModel, tmp_path: Path) -> None:
    """48 x 48 blocks over 64- and 128-wide matrices (which transformers refuses): the last blocks cut short, as
    vLLM reads DeepSeek's."""
    stored = write_fp8(tiny_llama, tmp_path / "fp8", (48, 48))
    name = "model.layers.0.mlp.up_proj.weight"
    scales = stored[name + "_scale_inv"].repeat_interleave(48, 0)[:128].repeat_interleave(48, 1)[:, :64]
    loaded = load_checkpoint(tmp_path / "fp8", tokenizer=False).state_dict[name]
    assert loaded.shape == (128, 64) and torch.equal(loaded, stored[name].float() * scales)


def test_row_scales_and_a_missing_scale(tiny_llama: TinyModel, tmp_path: Path) -> None:
    stored = write_fp8(tiny_llama, tmp_path / "rows", None)
    name = "model.layers.1.mlp.down_proj.weight"
    loaded = load_checkpoint(tmp_path / "rows", tokenizer=False).state_dict[name]
    assert torch.equal(loaded, stored[name].float() * stored[name + "_scale"])
    del stored[name + "_scale"]
    save_file(stored, tmp_path / "rows" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"the FP8 weight {name} has no scale"):
        load_checkpoint(tmp_path / "rows", tokenizer=False)
