"""`LoRALinear`: rows grouped by slot give each row its own adapter's delta (fused slices in their blocks, a
whole-projection adapter over all rows), rows without an adapter are the base layer's output bit for bit;
the native kernel (`kernels/lora_cpu.cpp`), the Triton kernel (`kernels/triton_lora.py`, under Triton's
interpreter here, compiled on a CUDA machine) and the PyTorch path agree, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.kernels import triton_attention
from conveyor.layers.lora import LoRABatch, LoRALinear, LoRAState, SlotPart
from tests.attention_utils import interpreter_only


@pytest.mark.parametrize("path", ["native", "pytorch", "triton"])
def test_grouped_delta_equals_each_rows_own_adapter(path: str) -> None:
    if path == "triton" and not triton_attention.INTERPRETED:
        pytest.skip("CUDA machine: the compiled kernel is tested instead")
    g = torch.Generator().manual_seed(0)
    base = nn.Linear(16, 24, bias=True)
    state = LoRAState()
    layer = LoRALinear(base, 16, [8, 8, 8], max_loras=3, max_rank=4, dtype=torch.float32, device=torch.device("cpu"),
                       state=state)
    # slot 0: slices 0 and 2 at rank 2; slot 1: one adapter over the whole output (a fused checkpoint's), rank 4
    parts = {0: [SlotPart(0, 0, torch.randn(2, 16, generator=g), torch.randn(8, 2, generator=g), 0.5),
                 SlotPart(2, 16, torch.randn(2, 16, generator=g), torch.randn(8, 2, generator=g), 2.0)],
             1: [SlotPart(0, 0, torch.randn(4, 16, generator=g), torch.randn(24, 4, generator=g), 1.5)]}
    for slot, p in parts.items():
        layer.set_slot(slot, p)
    if path == "native":
        assert layer.ops is not None, "the native kernels are not built"
    else:
        layer.ops = None
        layer.grouped_kernel = path == "triton"

    def expected_delta(slot: int, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(24)
        for part in parts.get(slot, []):
            out[part.row:part.row + part.b.shape[0]] += part.scale * (part.b @ (part.a @ x))
        return out

    x = torch.randn(9, 16, generator=g)
    row_slots = torch.tensor([1, -1, 0, 0, -1, 1, 2, 0, -1])  # slot 2 is empty: zeros add nothing
    state.batch = LoRABatch.from_row_slots(row_slots, 3)
    assert state.batch is not None and [grp[0] for grp in state.batch.groups] == [0, 1, 2]
    with torch.no_grad():
        got = layer(x)
        plain = base(x)
    for i, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            assert torch.equal(got[i], plain[i])
        else:
            torch.testing.assert_close(got[i], plain[i] + expected_delta(slot, x[i]), rtol=1e-5, atol=1e-5)
    assert LoRABatch.from_row_slots(torch.full((4,), -1), 3) is None
    state.batch = None
    with torch.no_grad():
        assert torch.equal(layer(x), plain)


def test_native_and_pytorch_paths_agree_in_bf16() -> None:
    g = torch.Generator().manual_seed(1)
    base = nn.Linear(64, 96, bias=False).to(torch.bfloat16)
    state = LoRAState()
    layer = LoRALinear(base, 64, [64, 32], max_loras=2, max_rank=8, dtype=torch.bfloat16,
                       device=torch.device("cpu"), state=state)
    layer.set_slot(0, [SlotPart(1, 64, torch.randn(8, 64, generator=g), torch.randn(32, 8, generator=g), 0.25)])
    layer.set_slot(1, [SlotPart(0, 0, torch.randn(4, 64, generator=g), torch.randn(96, 4, generator=g), 1.0)])
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    state.batch = LoRABatch.from_row_slots(torch.tensor([0, -1, 1, 1, 0, -1, 0]), 2)
    assert layer.ops is not None, "the native kernels are not built"
    with torch.no_grad():
        native = layer(x)
        pytorch = layer.add_delta(base(x), x, state.batch)
    torch.testing.assert_close(native.float(), pytorch.float(), rtol=0.02, atol=0.05)
    assert torch.equal(native[[1, 5]], base(x)[[1, 5]])


def bf16_layer_and_batch(device: torch.device) -> tuple[nn.Linear, LoRALinear, torch.Tensor, LoRAState]:
    """Two adapters on a fused [64, 32] projection (one on the second slice, one over all rows), rank 8 and 4."""
    g = torch.Generator().manual_seed(2)
    base = nn.Linear(64, 96, bias=False).to(torch.bfloat16).to(device)
    state = LoRAState()
    layer = LoRALinear(base, 64, [64, 32], max_loras=3, max_rank=8, dtype=torch.bfloat16, device=device, state=state)
    layer.set_slot(0, [SlotPart(1, 64, torch.randn(8, 64, generator=g), torch.randn(32, 8, generator=g), 0.25)])
    layer.set_slot(2, [SlotPart(0, 0, torch.randn(4, 64, generator=g), torch.randn(96, 4, generator=g), 1.0)])
    x = torch.randn(11, 64, generator=g).to(torch.bfloat16).to(device)
    state.batch = LoRABatch.from_row_slots(torch.tensor([2, -1, 0, 0, 2, -1, 0, 2, 2, -1, 0], device=device), 3)
    return base, layer, x, state


def check_triton_against_pytorch(device: torch.device) -> None:
    base, layer, x, state = bf16_layer_and_batch(device)
    layer.ops, layer.grouped_kernel = None, True
    with torch.no_grad():
        kernel = layer(x)
        pytorch = layer.add_delta(base(x), x, state.batch)
    # bf16 both: the PyTorch path rounds the delta before adding it, the kernel after (outputs up to ~8 here,
    # where a bf16 step is 1/32)
    torch.testing.assert_close(kernel.float(), pytorch.float(), rtol=0.02, atol=0.125)
    assert not torch.equal(kernel, base(x))
    assert torch.equal(kernel[[1, 5, 9]], base(x)[[1, 5, 9]])


@interpreter_only
def test_triton_kernel_agrees_with_pytorch_in_bf16() -> None:
    check_triton_against_pytorch(torch.device("cpu"))


@pytest.mark.cuda
def test_triton_kernel_on_cuda_agrees_with_pytorch() -> None:
    check_triton_against_pytorch(torch.device("cuda"))
