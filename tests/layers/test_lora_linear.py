"""`LoRALinear`: rows grouped by slot give each row its own adapter's delta (fused slices in their blocks, a
whole-projection adapter over all rows), rows without an adapter are the base layer's output bit for bit."""

from __future__ import annotations

import torch
from torch import nn

from conveyor.layers.lora import LoRABatch, LoRALinear, LoRAState, SlotPart


def test_grouped_delta_equals_each_rows_own_adapter() -> None:
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
