"""Mixture-of-experts layers over the flattened ragged batch: the router, the experts' MLPs run grouped
by expert, and the weighted combine.

Grouping: the batch's `[tokens, k]` expert ids are flattened and sorted once (a stable `argsort`), so
each expert's rows are one contiguous slice and its two matmuls run once on that slice; one host read
of the per-expert counts per layer and step, nothing loops over tokens. The experts are plain
`nn.Linear` pairs, so loading treats them as any linear (bf16 tiles, int8/int4/GGUF `QuantLinear`
with the file's blocks as stored; fp32 ones stay unpacked). On CPU with the native kernels
`group_experts` hands the whole block to one native object (`kernels/moe_block.h`: the router in F32
tiles, the routing, the experts, the shared expert, the sum; fp32 experts moved into F32 tiles first),
one call per layer, which the native decode stack runs too; elsewhere PyTorch's routing and a loop over
the experts that have rows.

The arithmetic is transformers' eager one (`MixtralExperts.forward` and its copies): softmax in fp32,
top-k, renormalized where the config says so, each expert's output times its routing weight, summed
per token into zeros in expert order (the stable sort keeps that order; `index_add_` on CPU and the
native sum add rows in index order), so fp32 outputs match it token for token. The router logits and
the sum are fp32 whatever the compute dtype.

gpt-oss (`GptOssMLP`) differs in three places, each a constructor argument: the router has a bias,
the softmax comes after the top-k, over the k chosen logits (`route_topk_softmax`; Granite MoE's too), and
the experts have biases and a clamped SwiGLU (`ClampedSwiglu`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fused_ops import FusedOps
from .quantization.linear import QuantLinear, bf16_kernel_max_rows, matmul_ops, tiled_segments
from .quantization.tensors import f32_rows


class Router(nn.Module):
    """`x -> x @ weight.T (+ bias)` in fp32: router (or shared-expert gate) logits. Not an `nn.Linear`, so
    quantization and packing leave it dense (a quantized router would move tokens between experts);
    fp32 whatever the compute dtype (CPU bf16 matmuls and softmax of a few columns are slow paths)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


def route_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 routing weights and expert ids `[tokens, top_k]`: softmax over all experts, top-k, then
    (Mixtral, Qwen3-MoE) the k weights divided by their sum."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_biased(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm_min: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ERNIE 4.5's routing (`Ernie4_5_MoeTopKRouter`): the softmax over all experts, the top-k of it plus a
    per-expert correction bias chosen, their unbiased weights divided by their sum (at least `norm_min`)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ids = torch.topk(probs + bias, top_k, dim=-1).indices
    weights = probs.gather(-1, ids)
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=norm_min), ids


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """LFM2-MoE's routing (`Lfm2MoeTopKRouter`): sigmoid scores, the top-k of them (plus a per-expert bias where
    there is one) chosen, their unbiased scores divided by their sum plus 1e-6 where renormalized, times
    `scale` (`routed_scaling_factor`)."""
    scores = logits.sigmoid()
    ids = torch.topk(scores if bias is None else scores + bias, top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return weights * scale, ids


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing (`GptOssTopKRouter`): the top-k logits, then a softmax over those k alone."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=torch.float32), ids


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation (`GptOssExperts._apply_gate`), on gate and up as separate halves:
    the gate clamped above at `limit`, up to [-limit, limit], then `(up + 1) * gate * sigmoid(gate * alpha)`."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass
class ExpertGroups:
    """The batch's (token, slot) pairs sorted by expert: `order` their flat positions, `tokens` the
    token of each, `counts` how many rows each expert has (on the host: it sizes the slices)."""

    order: torch.Tensor
    tokens: torch.Tensor
    counts: list[int]


def group_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """One stable sort of the flattened expert ids; within an expert, tokens stay in batch order."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order, order // ids.shape[1], counts)


class Expert(nn.Module):
    """One SwiGLU MLP: `down(silu(gate) * up)` with gate and up fused in one matmul (gate rows first);
    gpt-oss's: biases on both, `activation` its clamped SwiGLU."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: ClampedSwiglu | None = None) -> None:
        super().__init__()
        # Uninitialized: the checkpoint fills them (hundreds of experts would otherwise be randomly
        # initialized for nothing).
        self.gate_up_proj = nn.utils.skip_init(nn.Linear, hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.utils.skip_init(nn.Linear, intermediate_size, hidden_size, bias=bias)
        self.activation = activation
        self.fused: FusedOps | None = None  # native ops (kernels.cpu_fused_ops), set for fp32/bf16 on CPU
        self.prepack = False  # fp32: plain F.linear, not oneDNN-packed copies (see `linear.prepack_linears`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation is not None:
            return self.down_proj(self.activation(*gate_up.chunk(2, dim=-1)))
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoe(nn.Module):
    """Routed experts (top-k of `num_experts`), plus Qwen2-MoE's shared expert scaled by a sigmoid gate.
    `activation` set: gpt-oss's block (router and experts with biases, top-k then softmax, its activation);
    `topk_softmax`: the softmax after the top-k alone (Granite MoE's; None: where `activation` is set).
    `selection_bias`: a per-expert bias added to the softmax for choosing the experts only (`route_biased`, ERNIE
    4.5's, with its `norm_min`); `shared_gate` False: the shared expert added as it is (ERNIE 4.5's).
    `sigmoid_scale` set: sigmoid scores instead of the softmax, scaled by it (`route_sigmoid`, LFM2-MoE's; its
    `selection_bias` added to the scores for choosing).

    `observer`, when set, is called with each forward's per-expert row counts (the bench's expert
    load); it costs nothing when unset, since the counts are read anyway."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 shared_intermediate_size: int = 0, activation: ClampedSwiglu | None = None,
                 topk_softmax: bool | None = None, selection_bias: bool = False, norm_min: float = 0.0,
                 shared_gate: bool = True, sigmoid_scale: float | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k, self.renormalize, self.num_experts = top_k, renormalize, num_experts
        self.activation = activation
        gpt_oss = activation is not None
        self.topk_softmax = gpt_oss if topk_softmax is None else topk_softmax
        self.router = Router(hidden_size, num_experts, bias=gpt_oss)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size, bias=gpt_oss, activation=activation)
                                     for _ in range(num_experts))
        self.shared_expert = Expert(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = Router(hidden_size, 1) if shared_intermediate_size and shared_gate else None
        self.correction_bias = (nn.Parameter(torch.zeros(num_experts), requires_grad=False) if selection_bias
                                else None)
        self.norm_min = norm_min
        self.sigmoid_scale = sigmoid_scale
        self.observer: Callable[[list[int]], None] | None = None
        self.block: object | None = None  # the native `MoeBlock` (`group_experts`)
        self.router_tiles: QuantLinear | None = None  # the router (and shared gate) rows in F32 tiles, for it
        # On an AMX CPU, bf16 experts with more rows than this run faster through oneDNN's AMX matmul
        # (`QuantMatmul`, the loop): prefill chunks. None: the native block takes any rows.
        self.amx_rows = bf16_kernel_max_rows()

    @property
    def route_name(self) -> str:
        """This block's routing rule, as the native block names it (`kernels.layer_ops.MoeBlock.ROUTES`)."""
        if self.sigmoid_scale is not None:
            return "sigmoid"
        if self.correction_bias is not None:
            return "biased"
        return "topk_softmax" if self.topk_softmax else "softmax"

    def group_experts(self) -> bool:
        """Run the block natively (`kernels/moe_block.h`: one call per layer and step, and inside the decode
        stack) where the kernels are built: dense fp32 experts are moved into the kernels' F32 tiles first
        (one copy; bf16 and quantized ones are tiled already), the router's rows (and the shared expert's
        gate row) copied into F32 tiles, biases handed over in fp32. Else (CUDA, no kernels) PyTorch's ops.
        Whether it does."""
        ops = matmul_ops()
        self.block = None
        if ops is None:
            return False
        mlps = [*self.experts, *([self.shared_expert] if self.shared_expert is not None else [])]
        for expert in mlps:
            for name in ("gate_up_proj", "down_proj"):
                linear = getattr(expert, name)
                if (type(linear) is nn.Linear and linear.weight.dtype == torch.float32
                        and linear.weight.device.type == "cpu"):
                    tiled = QuantLinear([f32_rows(linear.weight)], bias=linear.bias is not None, dtype=torch.float32)
                    if linear.bias is not None:
                        tiled.bias.data.copy_(linear.bias.data)
                    setattr(expert, name, tiled)
        if not all(tiled_segments(m) is not None for e in mlps for m in (e.gate_up_proj, e.down_proj)):
            return False
        first, act = self.experts[0], self.activation
        block = ops.MoeBlock(first.gate_up_proj.in_features, first.down_proj.in_features,
                             act.alpha if act else 1.0, act.limit if act else 0.0)
        for e in self.experts:
            linears = (e.gate_up_proj, e.down_proj)
            biases = [None if m.bias is None else m.bias.detach().float().contiguous() for m in linears]
            block.add_expert(*[tiled_segments(m) for m in linears], *biases)
        gate = self.shared_expert_gate
        rows = self.router.weight if gate is None else torch.cat([self.router.weight, gate.weight])
        self.router_tiles = QuantLinear([f32_rows(rows)], bias=False, dtype=torch.float32)
        block.set_router(tiled_segments(self.router_tiles), self.router.bias, self.route_name, self.top_k,
                         self.renormalize, self.norm_min, self.sigmoid_scale or 1.0, self.correction_bias,
                         shared_gate=gate is not None)
        if self.shared_expert is not None:
            shared = self.shared_expert
            block.set_shared(tiled_segments(shared.gate_up_proj), tiled_segments(shared.down_proj),
                             shared.down_proj.in_features)
        self.block = block
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 routing weights and expert ids `[tokens, top_k]` by PyTorch's ops."""
        logits = self.router(x)
        if self.sigmoid_scale is not None:
            bias = None if self.correction_bias is None else self.correction_bias.float()
            return route_sigmoid(logits, bias, self.top_k, self.renormalize, self.sigmoid_scale)
        if self.correction_bias is not None:
            return route_biased(logits, self.correction_bias.float(), self.top_k, self.norm_min)
        if self.topk_softmax:
            return route_topk_softmax(logits, self.top_k)
        return route_softmax(logits, self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block, bf16_rows = self.block, self.amx_rows if x.dtype == torch.bfloat16 else None
        if block is not None and (bf16_rows is None or x.shape[0] <= bf16_rows):  # the whole block natively
            out = block.forward(x.contiguous(), torch.empty(x.shape, dtype=torch.float32), torch.get_num_threads())
            if self.observer is not None:
                self.observer(block.counts())
            return out.to(x.dtype)
        weights, ids = self.route(x)
        groups = group_by_expert(ids, self.num_experts)
        if self.observer is not None:
            self.observer(groups.counts)
        if block is not None and max(groups.counts) <= bf16_rows:  # big chunks whose experts' rows are still few
            combined = block.forward(x.contiguous(), torch.empty(x.shape, dtype=torch.float32),
                                     torch.get_num_threads(), (weights.contiguous(), ids.contiguous()))
        else:
            combined = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            row_weights = weights.reshape(-1).index_select(0, groups.order)
            self.run_experts(x, groups, row_weights.unsqueeze(1), combined)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            combined += shared if gate is None else torch.sigmoid(gate(x)) * shared
        return combined.to(x.dtype)

    def run_experts(self, x: torch.Tensor, groups: ExpertGroups, row_weights: torch.Tensor,
                    combined: torch.Tensor) -> None:
        """The loop over the experts that have rows, each on its slice of the sorted rows; then the
        weighted rows added to `combined` in the sorted order."""
        rows = x.index_select(0, groups.tokens)
        out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, n in zip(self.experts, groups.counts):
            if n:
                end = start + n
                torch.mul(expert(rows[start:end]), row_weights[start:end], out=out[start:end])
                start = end
        combined.index_add_(0, groups.tokens, out)
