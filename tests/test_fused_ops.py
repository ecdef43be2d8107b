"""The native fused elementwise ops compute what the PyTorch code of the Llama layer computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import cpu_fused_ops
from conveyor.models.llama import RMSNorm, RotaryEmbedding, rotate_half

from .conftest import TinyModel


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


def test_models_use_fused_ops_only_where_they_apply(tiny_models, monkeypatch):
    llama = tiny_models["llama"].llm().engine.model
    assert llama.layers[0].fused is not None and llama.norm.fused is not None
    gemma = tiny_models["gemma2"].llm().engine.model
    assert gemma.layers[0].fused is None  # Gemma's (1 + w) norm and GELU stay in PyTorch
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    assert tiny_models["llama"].llm().engine.model.layers[0].fused is None
