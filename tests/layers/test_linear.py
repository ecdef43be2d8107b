"""The oneDNN-prepacked LM head (`conveyor.layers.linear`) computes what `F.linear` computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.layers.linear import PackedLinear, PackedMatmul, packed_lm_head, packing_enabled, prepack_linears

pytestmark = pytest.mark.skipif(not packing_enabled(), reason="oneDNN linear ops unavailable")

# SmolLM2-135M's projections (qkv, o, gate_up, down), and a vocab-sized head cut to keep this fast.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (64, 20000)]
ROWS = [0, 1, 2, 3, 8, 16, 17, 64, 130]


def assert_matches_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> None:
    """Rounding-level agreement: within 1e-5 of the output's scale (seen: ~4e-6)."""
    ref = F.linear(x, weight, bias)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.abs().max().item() if ref.numel() else 1.0
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * max(scale, 1.0))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_packed_matmul_matches_f_linear(in_features: int, out_features: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    kernel = PackedMatmul(linear.weight, linear.bias, window=(0, None))  # packed on every row count
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            assert_matches_linear(kernel(x), x, linear.weight, linear.bias)


def test_default_window_dispatch() -> None:
    """One row stays on F.linear bit for bit; small-batch rows use the packed weight."""
    torch.manual_seed(0)
    w = torch.randn(960, 576)
    kernel = PackedMatmul(w)
    assert (kernel.min_rows, kernel.max_rows) == (2, 96)
    assert PackedMatmul(torch.randn(20000, 64)).max_rows is None  # vocab-sized head: no upper bound
    with torch.inference_mode():
        for rows in (0, 1, 97, 300):  # outside the window: exactly F.linear
            x = torch.randn(rows, 576)
            assert torch.equal(kernel(x), F.linear(x, w))
        for rows in (2, 8, 96):
            x = torch.randn(rows, 576)
            assert_matches_linear(kernel(x), x, w, None)
    x = torch.randn(8, 576, requires_grad=True)
    out = kernel(x)  # grad mode: F.linear, so backward works
    out.sum().backward()
    assert x.grad is not None


def test_prepack_linears_replaces_and_matches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 960), nn.ReLU(), nn.Sequential(nn.Linear(960, 576, bias=False)))
    x = torch.randn(3, 5, 576)  # 15 rows, leading dims kept
    with torch.inference_mode():
        ref = model(x)
    keys = set(model.state_dict())
    assert prepack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert set(model.state_dict()) == keys
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    assert prepack_linears(model) == 0  # already packed


def test_prepack_linears_noop_when_disabled_or_not_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "0")
    model = nn.Sequential(nn.Linear(8, 8))
    assert prepack_linears(model) == 0 and type(model[0]) is nn.Linear
    monkeypatch.delenv("CONVEYOR_PACKED_LINEAR")
    bf16 = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert prepack_linears(bf16) == 0 and type(bf16[0]) is nn.Linear


def test_packed_lm_head_is_plain_when_disabled_or_not_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(16, 8)
    x = torch.randn(4, 8)
    monkeypatch.setenv("CONVEYOR_PACKED_LINEAR", "0")
    head = packed_lm_head(w)
    assert not isinstance(head, PackedMatmul) and torch.equal(head(x), F.linear(x, w))
    monkeypatch.delenv("CONVEYOR_PACKED_LINEAR")
    assert isinstance(packed_lm_head(w), PackedMatmul)
    assert not isinstance(packed_lm_head(w.to(torch.bfloat16)), PackedMatmul)


def test_packed_lm_head_tied() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(20000, 64)
    head = packed_lm_head(embed.weight)
    assert isinstance(head, PackedMatmul)
    ids = torch.tensor([1, 5, 19999])
    with torch.inference_mode():
        hidden = torch.randn(32, 64)
        assert_matches_linear(head(hidden), hidden, embed.weight, None)
        assert torch.equal(embed(ids), embed.weight[ids])  # the embedding keeps the plain weight
        one = hidden[:1]
        assert torch.equal(head(one), F.linear(one, embed.weight))
