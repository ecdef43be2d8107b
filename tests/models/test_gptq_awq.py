"""GPTQ and AWQ checkpoints of a tiny Llama, packed here as AutoGPTQ's `QuantLinear.pack` and AutoAWQ's
`WQLinear_GEMM.from_linear` pack them (their loops, written out), against the weights those integers stand for
(`(q - zero) * scale` in fp16, as their kernels compute): the exact path loads those weights and its greedy ids
equal transformers' on them; kept in kernel types they run within int8's tolerance; GPTQ's activation order is
read; what is not supported is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.layers.quantization.tensors import QuantizedTensor
from conveyor.models.loader import ModelLoadError, load_checkpoint
from tests.utils import (QUANT_MODES, TinyModel, all_free, compare_greedy, next_token_logprobs, random_prompts,
                         tiny_tokenizer)

pytestmark = pytest.mark.usefixtures("one_thread")

PROJECTION = re.compile(r"model\.layers\.\d+\..*_proj\.weight")  # (not a mixture's router, `mlp.gate`)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# name -> (method, bits, group size, symmetric, activation order, the kernel type a kept weight takes)
KINDS = {
    "gptq": ("gptq", 4, 32, True, False, "Q4_0"),
    "gptq_asym": ("gptq", 4, 32, False, False, "Q4_1"),
    "gptq_channel": ("gptq", 4, -1, True, False, "Q4_0"),
    "gptq_8bit": ("gptq", 8, 32, True, False, "Q8_0"),
    "gptq_8bit_channel": ("gptq", 8, -1, True, False, "I8"),
    "gptq_desc_act": ("gptq", 4, 32, True, True, None),
    "awq": ("awq", 4, 32, False, False, "Q4_1"),
}
PROMPTS = random_prompts([3, 9, 17, 30], seed=41)


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool, g_idx: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest integers `[out, in]`, fp16 scales and zeros `[groups, out]`, and the weights they stand for."""
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, w.shape[0], dtype=torch.float16)
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            scales[g] = (cols.abs().amax(1) / (top // 2)).half()
            zeros[g] = (top + 1) // 2
        else:
            lo, hi = cols.amin(1), cols.amax(1)
            scales[g] = ((hi - lo) / top).half()
            zeros[g] = torch.round(-lo / scales[g].float()).clamp(0, top).long()
    s, z = scales[g_idx].t(), zeros[g_idx].t()  # [out, in]
    q = torch.round(w / s.float() + z).clamp(0, top).long()
    return q, scales, zeros, ((q - z).half() * s).float()


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's `QuantLinear.pack`: along the input dimension, then the zeros minus one along the output's."""
    per = 32 // bits
    intweight = q.t().numpy().astype(np.uint32)  # [in, out]
    qweight = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j] << (bits * j)
    z = (zeros.numpy() - 1).astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= z[:, col * per + j] << (bits * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def pack_awq(q: torch.Tensor, zeros: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """AutoAWQ's `WQLinear_GEMM.from_linear`: along the output dimension, in the order 0 2 4 6 1 3 5 7."""
    def pack(values: np.ndarray) -> np.ndarray:
        packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
        for col in range(packed.shape[1]):
            for i in range(8):
                packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
        return packed.view(np.int32)
    return pack(q.t().numpy().astype(np.uint32)), pack(zeros.numpy().astype(np.uint32))


def write_checkpoint(model: TinyModel, kind: str, path: Path) -> transformers.PreTrainedModel:
    """The tiny model's checkpoint with every projection of its layers (experts' too, not routers) quantized as
    `kind` into `path`; the reference: transformers on the weights the integers stand for."""
    method, bits, group, symmetric, desc_act, _ = KINDS[kind]
    stored = load_file(str(model.path / "model.safetensors"))
    state, dense = dict(stored), dict(stored)
    generator = torch.Generator().manual_seed(5)
    for name in sorted(n for n in stored if PROJECTION.fullmatch(n)):
        module, w = name.removesuffix(".weight"), state.pop(name)
        cols = w.shape[1]
        g_idx = torch.arange(cols) // (cols if group < 0 else group)
        if desc_act:
            g_idx = g_idx[torch.randperm(cols, generator=generator)]
        q, scales, zeros, dense[name] = quantize(w, bits, group, symmetric, g_idx)
        packed = pack_awq(q, zeros) if method == "awq" else pack_gptq(q, zeros, bits)
        state |= {f"{module}.qweight": torch.from_numpy(packed[0]), f"{module}.qzeros": torch.from_numpy(packed[1]),
                  f"{module}.scales": scales}
        if method == "gptq":
            state[f"{module}.g_idx"] = g_idx.int()
    config = json.loads((model.path / "config.json").read_text())
    (path / "dense").mkdir()
    save_file(dense, str(path / "dense" / "model.safetensors"))
    (path / "dense" / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
        if method == "awq" else {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
                                 "sym": symmetric, "checkpoint_format": "gptq"})
    (path / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path / "dense", attn_implementation="eager",
                                                                  experts_implementation="eager")
    return reference.eval()


@pytest.fixture(scope="module")
def checkpoints(tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = tiny_models["llama_smooth"]
    return {kind: (path := tmp_path_factory.mktemp(kind), write_checkpoint(model, kind, path)) for kind in KINDS}


def llm(path: Path, dtype: str = "float32") -> LLM:
    return LLM(path, dtype=dtype, config=ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=16))


@pytest.mark.parametrize("kind", list(KINDS))
def test_exact_path_runs_the_weights_the_integers_stand_for(checkpoints: dict, kind: str) -> None:
    path, reference = checkpoints[kind]
    exact_path_equals_the_reference(path, reference, kind)


def exact_path_equals_the_reference(path: Path, reference: transformers.PreTrainedModel, kind: str) -> None:
    """Every quantized weight loaded (fp32 path) is the dense one the reference runs; greedy ids equal its."""
    ours = load_checkpoint(path, tokenizer=False).state_dict
    dense = load_file(str(path / "dense" / "model.safetensors"))
    assert set(ours) == set(dense)
    for name in filter(PROJECTION.fullmatch, dense):
        assert torch.equal(ours[name], dense[name]), name
    engine = llm(path)
    compare_greedy(reference, engine, PROMPTS, [8] * len(PROMPTS), kind)
    assert all_free(engine)


@pytest.mark.parametrize("kind", [k for k, v in KINDS.items() if v[5] is not None])
def test_kept_weights_run_as_stored(checkpoints: dict, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept in a kernel type, each weight is the one the integers stand for (up to fp16's rounding of the
    product, which the kernels do not round, and of Q4_1's minimum); on the kernels (fp32 around them) the
    log-probs are within int8's tolerance of the exact path's."""
    path, _ = checkpoints[kind]
    kept_weights_are_the_dense_ones(path, kind)
    monkeypatch.setattr("conveyor.layers.precision.cpu_flags", lambda: frozenset({"avx2"}))
    ours = llm(path, dtype="auto")
    monkeypatch.undo()
    assert ours.quantization == KINDS[kind][0]
    tolerance, _ = QUANT_MODES["int8"][0]
    err = (next_token_logprobs(ours, PROMPTS) - next_token_logprobs(llm(path), PROMPTS)).abs().max().item()
    assert err < tolerance, f"{kind}: kept weights' log-prob error {err:.3f}"


def kept_weights_are_the_dense_ones(path: Path, kind: str) -> None:
    kept = load_checkpoint(path, tokenizer=False, keep_quantized=True).state_dict
    dense = load_file(str(path / "dense" / "model.safetensors"))
    weights = {name: t for name, t in kept.items() if isinstance(t, QuantizedTensor)}
    assert set(weights) == set(filter(PROJECTION.fullmatch, dense))
    assert {t.type_name for t in weights.values()} == {KINDS[kind][5]}
    atol = 1e-6 if KINDS[kind][3] else 5e-4  # (Q4_1's minimum -zero * scale rounded to fp16: <= 1/128 step)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor.dequantize(torch.float32), dense[name], rtol=2e-3, atol=atol, msg=name)


def test_a_mixture_of_experts_checkpoint(moe_models: dict[str, TinyModel], tmp_path: Path) -> None:
    """Qwen3-MoE with every expert's projections in GPTQ (the router dense, as GPTQ leaves it): the exact path
    and the kept experts as above."""
    reference = write_checkpoint(moe_models["qwen3_moe"], "gptq", tmp_path)
    exact_path_equals_the_reference(tmp_path, reference, "gptq qwen3_moe")
    kept_weights_are_the_dense_ones(tmp_path, "gptq")
    assert llm(tmp_path, dtype="auto").quantization == "gptq"
    marlin = LLM(tmp_path, quantization="gptq_marlin", config=ContinuousBatchingConfig(num_blocks=64))
    assert marlin.quantization == "gptq"  # (vLLM's name for its kernel of the same checkpoints)


def test_activation_order_is_dequantized(checkpoints: dict) -> None:
    """desc_act groups the columns out of order: no kernel type holds that, so the weights run dense."""
    path, _ = checkpoints["gptq_desc_act"]
    kept = load_checkpoint(path, tokenizer=False, keep_quantized=True)
    assert not kept.quantized and kept.stored_format is None
    assert llm(path, dtype="auto").quantization == "none"


@pytest.mark.parametrize(("change", "message"), [
    ({"bits": 3}, "gptq with 3-bit weights is not supported"),
    ({"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin' is not supported"),
])
def test_unsupported_checkpoints_are_named(checkpoints: dict, tmp_path: Path, change: dict, message: str) -> None:
    import shutil

    path, _ = checkpoints["gptq"]
    shutil.copytree(path, tmp_path / "broken")
    config = json.loads((tmp_path / "broken" / "config.json").read_text())
    config["quantization_config"] |= change
    (tmp_path / "broken" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(tmp_path / "broken", tokenizer=False)
