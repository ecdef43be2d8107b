"""The native fused elementwise ops compute what the PyTorch code of the Llama layer computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.kernels import cpu_fused_ops
from conveyor.layers.rotary import RotaryEmbedding, rotate_half
from conveyor.models.llama import RMSNorm

from tests.utils import TinyModel


@pytest.fixture(scope="module")
def ops():
    built = cpu_fused_ops()
    assert built is not None, "the fused CPU ops should build on this machine"
    return built


@pytest.mark.parametrize("shape", [(1, 64), (5, 576), (64, 576), (130, 100), (3, 4, 32)])
def test_rms_norm_matches_pytorch(ops, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    norm = RMSNorm(shape[-1], 1e-5)
    norm.weight.data = torch.randn(shape[-1])
    expected = norm(x)
    out = ops.rms_norm(x, norm.weight, norm.eps)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # only the sum of squares is added in another order
    strided = torch.randn(shape[0], 2 * shape[-1])[:, ::2]  # a non-contiguous input
    torch.testing.assert_close(ops.rms_norm(strided, norm.weight, norm.eps), norm.__class__.forward(norm, strided))


def test_rope_in_place_is_bitwise_the_pytorch_formula(ops, tiny_llama: TinyModel):
    torch.manual_seed(0)
    rotary = RotaryEmbedding(tiny_llama.reference.config, 16)
    cos, sin = rotary(torch.arange(3, 40), torch.float32)
    qkv = torch.randn(37, (4 + 2 + 2) * 16)
    q = qkv[:, :64].view(37, 4, 16)  # views into the fused projection, as the layer passes them
    k = qkv[:, 64:96].view(37, 2, 16)
    eq = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
    ek = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
    v = qkv[:, 96:].clone()
    ops.rope_(q, cos, sin)
    ops.rope_(k, cos, sin)
    assert torch.equal(q, eq) and torch.equal(k, ek)
    assert torch.equal(qkv[:, 96:], v)  # the values are untouched


@pytest.mark.parametrize("rows", [1, 64, 200])
def test_silu_mul_matches_pytorch(ops, rows):
    torch.manual_seed(0)
    gate_up = torch.randn(rows, 2 * 96) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


BF16_ULP = 2.0 ** -7  # spacing of bf16 values relative to their magnitude (at most)


@pytest.mark.parametrize("shape", [(1, 64), (64, 576), (130, 100), (3, 4, 32)])
def test_rms_norm_bf16_rounds_like_pytorch(ops, shape):
    """transformers' bf16 RMSNorm: fp32 statistics, the normalized x rounded to bf16, times the bf16 weight
    (rounded again). Only the sum of squares is added in another order, which may move a rounding."""
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).bfloat16()
    norm = RMSNorm(shape[-1], 1e-5).bfloat16()
    norm.weight.data = torch.randn(shape[-1]).bfloat16()
    expected, out = norm(x), ops.rms_norm(x, norm.weight, norm.eps)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    differ = out != expected
    assert differ.float().mean() < 0.01
    assert ((out.float() - expected.float()).abs() <= BF16_ULP * expected.float().abs())[differ].all()


def test_rope_bf16_is_bitwise_the_pytorch_formula(ops, tiny_llama: TinyModel):
    """Each product and the sum round to bf16, as `q * cos + rotate_half(q) * sin` does on bf16 tensors."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(tiny_llama.reference.config, 16)
    cos, sin = rotary(torch.arange(3, 40), torch.bfloat16)
    qkv = (torch.randn(37, (4 + 2 + 2) * 16) * 2).bfloat16()
    q = qkv[:, :64].view(37, 4, 16)
    eq = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
    fp32 = q.float() * cos.float().unsqueeze(1) + rotate_half(q.float()) * sin.float().unsqueeze(1)
    assert not torch.equal(eq, fp32.bfloat16())  # rounding each op differs from rounding once: the check can fail
    ops.rope_(q, cos, sin)
    assert torch.equal(q, eq)


def test_silu_mul_bf16_rounds_once(ops):
    """silu(gate) * up in fp32, rounded once: within half a bf16 step of the exact fp32 value, which PyTorch's
    two bf16 ops (silu, then the product, each rounded) are not always."""
    torch.manual_seed(0)
    gate_up = (torch.randn(200, 2 * 96) * 4).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    out = ops.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16
    bound = (BF16_ULP / 2 + 1e-6) * exact.abs() + 1e-30  # 1e-6: fp32 exp differs from PyTorch's by rounding
    assert ((out.float() - exact).abs() <= bound).all()
    pytorch = F.silu(gate_up.chunk(2, dim=-1)[0]) * gate_up.chunk(2, dim=-1)[1]
    assert not ((pytorch.float() - exact).abs() <= bound).all()
    torch.testing.assert_close(out, pytorch)


def test_models_use_fused_ops_only_where_they_apply(tiny_models, monkeypatch):
    llama = tiny_models["llama"].llm().engine.model
    assert llama.layers[0].fused is not None and llama.norm.fused is not None
    bf16 = LLM(tiny_models["llama"].path, dtype="bfloat16", config=ContinuousBatchingConfig(num_blocks=64)).engine.model
    assert bf16.layers[0].fused is not None and bf16.norm.fused is not None
    gemma = tiny_models["gemma2"].llm().engine.model
    assert gemma.layers[0].fused is None  # Gemma's (1 + w) norm and GELU stay in PyTorch
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    assert tiny_models["llama"].llm().engine.model.layers[0].fused is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(ops, dtype):
    """x += residual rounds as PyTorch's add (the same bits), and the norm of the sum is `rms_norm`'s."""
    torch.manual_seed(0)
    x, residual = (torch.randn(130, 100) * 3).to(dtype), (torch.randn(130, 100) * 3).to(dtype)
    weight = torch.randn(100).to(dtype)
    expected_sum = x + residual
    expected = ops.rms_norm(expected_sum, weight, 1e-5)
    out = ops.add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(x, expected_sum) and torch.equal(out, expected)
