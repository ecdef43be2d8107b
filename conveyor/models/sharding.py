"""Tensor-parallel sharding of a checkpoint: which heads, MLP columns and vocabulary rows each rank
holds (`ShardPlan`), which slice of each Hugging Face-named tensor that means (`ShardPlan.select`,
applied by the loader before a tensor is materialized, so no rank ever holds the whole model), and
the sharded model itself (`load_shard`: the family's own model built at the shard's sizes, with
the row-parallel and vocabulary-parallel wrappers of `layers.parallel`).

Attention heads are split in whole KV groups: a rank holds some KV heads and every query head that
reads them, so attention needs no communication and each rank's KV cache holds only its KV heads.
When the KV heads do not divide by the number of ranks, the first ranks take one group more (the
built-in SmolLM2-135M, 9 query and 3 KV heads, at TP=2: 6 and 3 query heads; its attention is then
2:1 unbalanced, the MLP and the LM head are even). With more ranks than KV heads, each KV head is
replicated on `tp / kv_heads` ranks (as vLLM does) when that divides its query heads; any other
size is a `ConfigError` before anything starts, naming the sizes that work. The MLP is split in
units of 256 columns where the intermediate size allows (32, else 1), so that row-parallel `down`
shards of every block format (blocks of 32 or 256 weights) fall on block boundaries; the
vocabulary in `ceil(vocab / tp)` rows per rank.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from ..errors import ConfigError
from ..layers.parallel import Collectives, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from ..layers.precision import Precision, keeps_stored, resolve_quantization
from . import build_model
from .base import CausalLM
from .loader import Checkpoint, load_checkpoint
from .moe import expert_count

logger = logging.getLogger("conveyor")

Range = tuple[int, int]
Selection = tuple[int, int, int]  # (dim, start, stop): the slice of a tensor a rank holds
MLP_UNITS = (256, 32, 1)  # the MLP is split in the largest of these that divides the intermediate size

_Q = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
_KV = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")
_O = re.compile(r"\.self_attn\.o_proj\.weight$")
_GATE_UP = re.compile(r"\.mlp\.(gate|up)_proj\.(weight|bias)$")
_DOWN = re.compile(r"\.mlp\.down_proj\.weight$")
_ROW_PARALLEL_BIAS = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.bias$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# gate/up (Phi-3: q/k/v too) stored fused: a shard would need several row ranges of one tensor
FUSED_CHECKPOINTS = ("phi3", "glm", "glm4")
NORMS_OVER_HEADS = ("olmo2", "olmo3")  # q/k norms over all heads together: a rank would need the others' squares
# Layers whose state is not K/V (and these families' own tensor names), which the plan does not split
STATE_LAYERS = {"lfm2": "convolution layers", "granitemoehybrid": "Mamba-2 layers and shared MLP"}
PLAIN_MLP = ("starcoder2",)  # an MLP of c_fc and c_proj, not gate/up/down, which the plan does not split


def split(n: int, parts: int) -> list[Range]:
    """`[0, n)` in `parts` contiguous ranges, as even as possible, the larger ones first."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world_size` holds: query heads, KV heads, intermediate (MLP) columns and
    vocabulary rows, each `[start, stop)`; `vocab_shard_rows` is the largest vocabulary shard (the
    logits gather pads to it)."""

    rank: int
    world_size: int
    head_dim: int
    q_heads: Range
    kv_heads: Range
    intermediate: Range
    vocab: Range
    vocab_shard_rows: int

    def select(self, name: str, shape: tuple[int, ...]) -> Selection | None:
        """The slice of Hugging Face tensor `name` this rank holds; None = all of it (norms, and the
        row-parallel biases, which `load_shard` zeroes outside rank 0)."""
        d = self.head_dim
        if name in _VOCAB:
            return (0, *self.vocab)
        if _Q.search(name):
            return (0, self.q_heads[0] * d, self.q_heads[1] * d)
        if _KV.search(name):
            return (0, self.kv_heads[0] * d, self.kv_heads[1] * d)
        if _O.search(name):
            return (1, self.q_heads[0] * d, self.q_heads[1] * d)
        if _GATE_UP.search(name):
            return (0, *self.intermediate)
        if _DOWN.search(name):
            return (1, *self.intermediate)
        return None

    def local_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """The config of this rank's shard: its heads, MLP columns and vocabulary rows (head_dim kept)."""
        local = copy.deepcopy(config)
        local.head_dim = self.head_dim
        local.num_attention_heads = self.q_heads[1] - self.q_heads[0]
        local.num_key_value_heads = self.kv_heads[1] - self.kv_heads[0]
        local.intermediate_size = self.intermediate[1] - self.intermediate[0]
        local.vocab_size = self.vocab[1] - self.vocab[0]
        return local


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def valid_sizes(heads: int, kv_heads: int) -> list[int]:
    """Tensor-parallel sizes the attention can be split into (whole KV groups, or replicated KV heads)."""
    group = heads // kv_heads
    return [t for t in range(1, heads + 1) if t <= kv_heads or (t % kv_heads == 0 and group % (t // kv_heads) == 0)]


def plan_shards(config: PretrainedConfig, world_size: int) -> list[ShardPlan]:
    """Every rank's plan for this model; ConfigError (before anything starts) naming the sizes that work."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if world_size > 1 and expert_count(config):
        raise ConfigError(f"tensor_parallel_size={world_size}: mixture-of-experts models ({config.model_type}, "
                          f"{expert_count(config)} experts) are not split over ranks yet; run them with "
                          "tensor_parallel_size=1, or as replicas with --data-parallel-size")
    if world_size not in valid_sizes(heads, kv):
        raise ConfigError(
            f"tensor_parallel_size={world_size} cannot split this model's attention ({heads} query heads in {kv} KV "
            f"groups): a rank holds whole KV groups, or one KV head replicated over ranks that split its "
            f"{heads // kv} query heads; sizes that work: {valid_sizes(heads, kv)}")
    if world_size > 1 and config.model_type in FUSED_CHECKPOINTS:
        raise ConfigError(f"tensor_parallel_size={world_size}: {config.model_type} checkpoints store gate/up "
                          f"{'and q/k/v ' if config.model_type == 'phi3' else ''}fused, which tensor parallelism "
                          "does not split yet; use tensor_parallel_size=1")
    if world_size > 1 and getattr(config, "use_qk_norm", False):
        raise ConfigError(f"tensor_parallel_size={world_size}: {config.model_type} with use_qk_norm (Command R+) holds "
                          "q/k norm weights per head, which tensor parallelism does not split yet; use "
                          "tensor_parallel_size=1")
    if world_size > 1 and config.model_type in PLAIN_MLP:
        raise ConfigError(f"tensor_parallel_size={world_size}: {config.model_type} has an MLP of c_fc and c_proj, "
                          "which tensor parallelism does not split yet; use tensor_parallel_size=1")
    if world_size > 1 and config.model_type in NORMS_OVER_HEADS:
        raise ConfigError(f"tensor_parallel_size={world_size}: {config.model_type} normalizes q and k over all heads "
                          "together, which tensor parallelism does not split yet; use tensor_parallel_size=1, or "
                          "replicas with --data-parallel-size")
    if world_size > 1 and config.model_type in STATE_LAYERS:
        raise ConfigError(f"tensor_parallel_size={world_size}: {config.model_type}'s {STATE_LAYERS[config.model_type]} "
                          "are not split over ranks yet; use tensor_parallel_size=1, or replicas with "
                          "--data-parallel-size")
    inter = config.intermediate_size
    unit = next(u for u in MLP_UNITS if inter % u == 0)
    if inter // unit < world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} is more than the {inter // unit} blocks of {unit} "
                          f"columns the MLP (intermediate size {inter}) splits into")
    vocab = config.vocab_size
    shard_rows = -(-vocab // world_size)
    if shard_rows * (world_size - 1) >= vocab:
        raise ConfigError(f"tensor_parallel_size={world_size} leaves a rank without vocabulary rows ({vocab})")
    group = heads // kv
    if world_size <= kv:
        kv_ranges = split(kv, world_size)
        q_ranges = [(a * group, b * group) for a, b in kv_ranges]
    else:  # each KV head on world_size / kv ranks, its query heads split between them
        replicas = world_size // kv
        q_ranges = split(heads, world_size)
        kv_ranges = [(r // replicas, r // replicas + 1) for r in range(world_size)]
    mlp = [(a * unit, b * unit) for a, b in split(inter // unit, world_size)]
    return [ShardPlan(r, world_size, head_dim_of(config), q_ranges[r], kv_ranges[r], mlp[r],
                      (r * shard_rows, min(vocab, (r + 1) * shard_rows)), shard_rows) for r in range(world_size)]


def describe_plan(plans: list[ShardPlan]) -> str:
    """For the start-up log: each rank's query/KV heads and MLP columns."""
    return "; ".join(f"rank {p.rank}: {p.q_heads[1] - p.q_heads[0]} query / {p.kv_heads[1] - p.kv_heads[0]} KV "
                     f"heads, {p.intermediate[1] - p.intermediate[0]} MLP columns, vocab {p.vocab[0]}-{p.vocab[1]}"
                     for p in plans)


def load_shard(path: str | Path | None, precision: Precision, device: torch.device, plan: ShardPlan,
               comm: Collectives, tokenizer: bool = True) -> tuple[CausalLM, Checkpoint, str]:
    """This rank's shard of the checkpoint, built and wrapped for tensor parallelism; also the
    checkpoint (its config, tokenizer and path; its tensors dropped) and the weight format resolved.
    Only the slices `plan.select` names are read from the file."""
    checkpoint = load_checkpoint(path, dtype=precision.dtype, keep_quantized=keeps_stored(precision.quantization,
                                                                                          device),
                                 select=plan.select, tokenizer=tokenizer)
    quantization = resolve_quantization(precision, checkpoint.stored_format)
    state = checkpoint.state_dict
    if plan.rank != 0:  # a row-parallel bias is added once, by rank 0, before the all-reduce
        for name in [n for n in state if _ROW_PARALLEL_BIAS.search(n)]:
            state[name] = torch.zeros_like(state[name])
    net = build_model(plan.local_config(checkpoint.config), state, precision.dtype, device, quantization)
    checkpoint.state_dict = {}
    parallelize(net, checkpoint.config, plan, comm)
    return net, checkpoint, quantization


def parallelize(net: CausalLM, config: PretrainedConfig, plan: ShardPlan, comm: Collectives) -> None:
    """Wrap a shard-sized model for tensor parallelism: o and down row-parallel, the embedding and the LM
    head vocabulary-parallel; the full model config back (the engine reads its vocabulary and limits).
    The native decode stack runs every layer in one call, with no place for the all-reduces: off."""
    for layer in net.layers:
        layer.o_proj = RowParallelLinear(layer.o_proj, comm)
        layer.down_proj = RowParallelLinear(layer.down_proj, comm)
    net.embed_tokens = VocabParallelEmbedding(net.embed_tokens, plan.vocab[0], comm)
    head = net.lm_head_fn
    del net.lm_head_fn  # an untied head is the `lm_head` module itself, registered under this name too
    net.lm_head_fn = VocabParallelHead(head, comm, plan.vocab_shard_rows, config.vocab_size)
    net.decode_stack = None
    net.config = config
