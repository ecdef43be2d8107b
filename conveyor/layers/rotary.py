"""Rotary position embeddings (RoPE) for the flattened ragged batch, with every scaling transformers'
configs name (`rope_parameters`, or `rope_scaling` in older configs).

Static scalings (linear, llama3, yarn, proportional) change the inverse frequencies once; they come
from transformers' own initialisers. Two depend on the sequence length, and transformers recomputes
them in every forward pass from the batch's `max(position_ids) + 1` (`dynamic_rope_update`):

- `longrope` (Phi-3's "su"): the short factors while the length is at most
  `original_max_position_embeddings`, the long ones past it; the same attention factor (a scale on
  cos and sin) for both.
- `dynamic` (NTK-aware): `rope_theta` grows with the length once it passes `max_position_embeddings`
  (`theta * (factor * len / max - (factor - 1)) ** (dim / (dim - 2))`), unchanged below.

A continuous batch mixes requests of every length, so here the length is per request, and a token is
rotated as transformers' `generate` rotates it for that request alone: a prompt token with the
frequencies of the whole prompt (the prompt is one forward pass there), the token at position `p`
after the prompt with those of length `p + 1` (its decode step). That is `max(rope_length, p + 1)`
with the request's `rope_length` its prompt length, a function of the token alone, so chunked prefill,
batching, speculation and preemption (which recomputes) all give each token the rotation it had in
transformers. Phi-3 adds one step: when its sequence passes LongRoPE's original length, transformers
drops the cache and recomputes every token with the long factors, and so does the engine, raising the
request's `rope_length` to its whole length (`CausalLM.rope_switch`, `Engine.schedule`). (vLLM picks
one set at start-up instead: the long factors for every request, short ones included, whenever
`max_model_len` exceeds the original length.) The runner passes each token's length in the high bits of its position (`with_lengths`);
a plain position means length `p + 1`. A prompt token's K/V then depends on `rope_length` besides the
tokens before it: `prefix_key` says which lengths rotate alike, and prefix caching keys blocks by it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

LENGTH_SHIFT = 32  # positions below 2**32; a token's RoPE length above them
_POSITION_MASK = (1 << LENGTH_SHIFT) - 1


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """RoPE settings from either transformers 5 (`rope_parameters`, per layer type for Gemma 3) or 4
    (`rope_theta`, `rope_scaling`)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        return dict(params[layer_type]) if layer_type in params else params
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def with_lengths(positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Positions that carry each token's RoPE length (for the length-dependent types)."""
    return positions | (lengths << LENGTH_SHIFT)


def split_lengths(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, RoPE lengths) of positions from `with_lengths`; a plain position has length `p + 1`."""
    plain = positions & _POSITION_MASK
    return plain, torch.maximum(positions >> LENGTH_SHIFT, plain + 1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin `[num_tokens, rotary_dim]` for the batch's positions. `layer_type` picks the settings of
    one layer type where they differ by type (Gemma 3); `partial_rotary` honours the config's
    `partial_rotary_factor` with the default type, as the families that have one do (Phi-3): only the
    first `rotary_dim` dimensions of each head rotate."""

    def __init__(self, config: PretrainedConfig, head_dim: int, layer_type: str | None = None,
                 partial_rotary: bool = False) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        self.rope_type = rope_type = params.get("rope_type", "default")
        kwargs = {"layer_type": layer_type} if layer_type in (getattr(config, "rope_parameters", None) or {}) else {}
        if rope_type == "default":
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0)) if partial_rotary else head_dim
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
        else:
            raise ValueError(f"RoPE type {rope_type!r} is not supported (supported: default, "
                             f"{', '.join(ROPE_INIT_FUNCTIONS)})")
        factors = getattr(config, "rope_freq_factors", None)  # a Llama 3 GGUF's `rope_freqs` (its llama3 scaling)
        if factors is not None:
            if rope_type != "default" or len(factors) != inv_freq.numel():
                raise ValueError(f"rope_freq_factors ({len(factors)}) go with the default RoPE of "
                                 f"{inv_freq.numel()} frequencies, not {rope_type!r}")
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)
        self.rotary_dim = 2 * inv_freq.numel()
        # The length past which the frequencies change (None: they never do).
        self.threshold: int | None = None
        if rope_type == "longrope":
            self.threshold = int(params["original_max_position_embeddings"])
            long, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=self.threshold + 1, **kwargs)
            self.register_buffer("long_inv_freq", long.float(), persistent=False)
        elif rope_type == "dynamic":
            self.threshold = int(config.max_position_embeddings)
            self.factor, self.theta = float(params["factor"]), float(params["rope_theta"])
            dim = self.rotary_dim
            self.register_buffer("exponents", torch.arange(0, dim, 2, dtype=torch.int64).float() / dim,
                                 persistent=False)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  (nn.Module's signature)
        """Device moves only: the frequencies stay fp32 in a bf16 model, as transformers keeps them (rounded
        to bf16, a far position's angle drifts by radians)."""
        kept = {name: buffer for name, buffer in self._buffers.items() if buffer is not None}
        super()._apply(fn, recurse)
        for name, buffer in kept.items():
            self._buffers[name] = buffer.to(self._buffers[name].device)
        return self

    @property
    def by_length(self) -> bool:
        """Whether the frequencies depend on the sequence length (then positions should carry it)."""
        return self.threshold is not None

    def prefix_key(self, rope_length: int) -> int:
        """Requests whose `rope_length`s have equal keys rotate equal tokens alike (see the module
        docstring): one key up to the threshold, and past it one for LongRoPE, one per length for dynamic NTK."""
        if self.threshold is None or rope_length <= self.threshold:
            return 0
        return 1 if self.rope_type == "longrope" else rope_length

    def inv_freq_for(self, lengths: torch.Tensor) -> torch.Tensor:
        """`[num_tokens, rotary_dim / 2]` inverse frequencies for tokens of these RoPE lengths."""
        longer = (lengths > self.threshold).unsqueeze(1)
        if self.rope_type == "longrope":
            return torch.where(longer, self.long_inv_freq, self.inv_freq)
        # transformers' arithmetic, op for op in fp32; its power of a 0-d tensor rounds like one taken in fp64.
        ratio = self.factor * lengths.clamp(min=self.threshold) / self.threshold - (self.factor - 1)
        base = self.theta * (ratio.double() ** (self.rotary_dim / (self.rotary_dim - 2))).float()
        return torch.where(longer, 1.0 / (base.unsqueeze(1) ** self.exponents), self.inv_freq)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.threshold is None:
            freqs = positions[:, None].float() * self.inv_freq
        else:
            positions, lengths = split_lengths(positions)
            freqs = positions[:, None].float() * self.inv_freq_for(lengths)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x [tokens, heads, head_dim]` rotated; with cos/sin narrower than a head (partial rotary) only its
    first dimensions rotate and the rest pass through, as transformers' `apply_rotary_pos_emb` does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
