"""Families whose RoPE rotates consecutive pairs of a head's dimensions (GLM, ERNIE 4.5: transformers'
`rotate_half` over `x[0::2]` and `x[1::2]`, llama.cpp's "normal" RoPE) instead of its two halves, as every
kernel here does (Llama's `rotate_half`, the native RoPE and the decode stack).

Pair i's dimensions 2i and 2i+1 rotate by frequency i; in the halves layout dimensions i and i + d/2 do.
So the same model results from reordering each head's rotated q and k rows at load, evens first, then odds
(llama.cpp's converter makes the opposite move for Llama): attention reads q.k, which one permutation of
both leaves as it is, term for term, and v is not reordered. Each output element is then the same
products in the same order as transformers computes it, so the fp32 path stays exact. The rows are
reordered within each head of the tensor as it arrives (a tensor-parallel rank's slice holds whole heads);
a LoRA adapter's B rows for q and k move with them (`models.lora`).
"""

from __future__ import annotations

import torch

from ..layers.quantization.linear import Weight, fuse_rows
from ..layers.quantization.tensors import QuantizedTensor


def halves_order(rows: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The row order that turns `rows` rows of q or k (whole heads of `head_dim`, the first `rotary_dim` of
    each rotated in pairs) into the halves layout: `new[j] = old[order[j]]`."""
    if rows % head_dim or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"{rows} rows do not split into heads of {head_dim} with {rotary_dim} rotated dimensions")
    head = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim)])
    return (torch.arange(0, rows, head_dim)[:, None] + head).flatten()


def reorder_rows(weight: Weight, order: torch.Tensor) -> Weight:
    """A weight's or bias's rows in `order`, quantized rows moved as they are."""
    if isinstance(weight, QuantizedTensor):
        return weight.index_rows(order)
    return weight.index_select(0, order)


class PairRope:
    """Mixin for a `CausalLM` of a pair-RoPE family: `layer_weights` gives the fused q/k/v with q's and k's
    rows in the halves layout (the shared loader fused them as stored)."""

    head_dim: int

    def rotary_dims(self) -> int:
        rotary = getattr(self, "rotary", None)
        return self.head_dim if rotary is None else rotary.rotary_dim

    def qk_row_order(self, rows: int) -> torch.Tensor:
        """The order of `rows` rows of q or k (`halves_order` for this model's heads)."""
        return halves_order(rows, self.head_dim, self.rotary_dims())

    def layer_weights(self, state_dict: dict[str, Weight], layer: int) -> dict[str, Weight | list[Weight]]:
        out = super().layer_weights(state_dict, layer)  # type: ignore[misc]
        src = f"model.layers.{layer}.self_attn."
        for kind in ("weight", "bias"):
            names = [f"{src}{n}_proj.{kind}" for n in "qkv"]
            if names[0] not in state_dict:
                continue
            q, k, v = (state_dict[n] for n in names)
            q = reorder_rows(q, self.qk_row_order(q.shape[0]))
            k = reorder_rows(k, self.qk_row_order(k.shape[0]))
            out[f"layers.{layer}.qkv_proj.{kind}"] = fuse_rows([q, k, v])
        return out
