"""Mamba-2's selective state space mixer over the flattened ragged batch, its state kept in the KV pool
(Granite 4.0's hybrid layers; docs/design/sliding-window.md "Convolution and state space layers").

`in_proj(x)` makes the gate z, the convolution's input xBC and the time step dt. xBC goes through a causal
depthwise convolution with SiLU (`short_conv`, its ring of the last inputs in the pool), then splits into the
heads' inputs x `[heads, head_dim]` and the groups' B and C `[groups, state]`. Each head keeps a state S
`[head_dim, state]`, per token: `S = exp(dt * A) * S + dt * B * x`, `y = S . C + D * x`. The output is
`out_proj(rms_norm_per_group(y * silu(z)))`.

A request's state per layer is a fixed number of pool slots, held whole from its first token: the
convolution's ring (`kernel` rows of `r` slots each) and then S in fp32, its bytes over the slots' K and V
halves, whatever the pool's dtype. So preemption, the swap pool and "every block returns" need nothing new,
and a chunk of any length continues from the state the last one left. Decode rows take the recurrence
above, batched (on CPU one native pass over the states, in place); a prefill chunk takes the chunked form of
the scan (state space duality, as transformers' reference and the Mamba kernels compute it) from its request's
state: the exact path is transformers' arithmetic up to the order of its sums.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_ssm_ops
from ..kernels.ssm_ops import SsmOps
from .attention import AttentionMetadata, PrefillSpan
from .short_conv import ConvIndex, conv_index, run_slots, short_conv, state_slots_per_row


# The scan's chunk length: the masked products within a chunk cost its length per token, the carry from chunk to
# chunk a Python step per chunk; this one measured fastest on a CPU (docs/benchmarks.md, "Granite 4.0"). The
# checkpoints' `mamba_chunk_size` is their CUDA kernels' choice; any length gives the same scan.
SCAN_CHUNK = 64


def state_slots(values: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Pool slots that hold `values` fp32 numbers: a slot is a K and a V row of `num_kv_heads * head_dim`
    elements of `element_size` bytes each."""
    return -(-values * 4 // (2 * num_kv_heads * head_dim * element_size))


@dataclass
class MambaIndex:
    """Per pass and layer group, the slots every Mamba layer of the group reads and writes (`mamba_index`)."""

    conv: ConvIndex
    decode_slots: torch.Tensor  # [decodes, s] the decode rows' state slots
    decode_started: torch.Tensor  # [decodes, 1, 1, 1] False where a decode row has no state yet (its first token)
    spans: list[PrefillSpan]  # the prefill spans, by their rows among those the index covers
    span_slots: list[torch.Tensor]  # [s] per prefill span
    span_fresh: list[bool]  # per prefill span: it starts the request (its state is zero)


def _state_slots(tables: torch.Tensor, base: int, s: int, page: int) -> torch.Tensor:
    """`[n, s]` pool slots of the state that follows the ring (`base` slots) in blocks `tables [n, blocks]`."""
    return run_slots(tables, (base + torch.arange(s, device=tables.device)).expand(tables.shape[0], s), page)


def mamba_index(meta: AttentionMetadata, num_tokens: int, kernel: int, r: int, s: int) -> MambaIndex:
    """The pass's reads and writes for a Mamba group: the convolution's ring (`conv_index`) and each
    request's state slots after it."""
    page, base = meta.page_size, kernel * r
    conv = conv_index(meta, num_tokens, kernel, r)
    dev = meta.slot_mapping.device
    if meta.num_decodes:
        decode_slots = _state_slots(meta.decode_block_tables, base, s, page)
        started = (meta.decode_positions > 0).view(-1, 1, 1, 1)
    else:
        decode_slots = torch.empty(0, s, dtype=torch.long, device=dev)
        started = torch.empty(0, 1, 1, 1, dtype=torch.bool, device=dev)
    spans = [_state_slots(span.block_table.unsqueeze(0), base, s, page)[0] for span in meta.prefills]
    return MambaIndex(conv, decode_slots, started, list(meta.prefills), spans,
                      [span.start == 0 for span in meta.prefills])


def read_state(kv_cache: torch.Tensor, slots: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 states `[n, numel]` whose bytes are at `slots [n, s]` (each slot's K half, then its V half)."""
    n, s = slots.shape
    pool = kv_cache.view(2, kv_cache.shape[1], -1)
    parts = pool.index_select(1, slots.flatten()).view(2, n, s, pool.shape[-1])
    return parts.permute(1, 2, 0, 3).reshape(n, -1).view(torch.float32)[:, :numel]


def write_state(kv_cache: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Store fp32 `states [n, numel]` at `slots [n, s]` (the inverse of `read_state`)."""
    n, s = slots.shape
    pool = kv_cache.view(2, kv_cache.shape[1], -1)
    width = pool.shape[-1]
    room = s * 2 * width * pool.element_size() // 4
    raw = F.pad(states.float(), (0, room - states.shape[1])).view(pool.dtype).view(n, s, 2, width)
    pool.index_copy_(1, slots.flatten(), raw.permute(2, 0, 1, 3).reshape(2, n * s, width))


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               d: torch.Tensor, state: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens through the scan in chunks of `chunk` (the state space duality form of
    transformers' `mamba2_chunk_scan` and of the Mamba kernels): x `[T, heads, P]` fp32, dt `[T, heads]`
    (softplus'd), b/c `[T, groups, N]`, from `state [heads, P, N]` (None: zeros). The outputs `[T, heads, P]`
    (with the D skip) and the final state.

    Within a chunk the outputs are a masked product `(C B^T * decay) (x dt)`, C B^T once per group (not per
    head, as the reference computes it); across chunks each chunk's contribution to the state is carried
    forward one chunk at a time. The decays are exponentials of differences of the cumulative `A dt`
    (the Mamba kernels' form)."""
    t, heads, p = x.shape
    groups, n = b.shape[1:]
    rep, pad = heads // groups, (chunk - t % chunk) % chunk
    k = (t + pad) // chunk
    skip = d[:, None] * x

    def chunked(v: torch.Tensor) -> torch.Tensor:  # [T, X, ...] -> [X, chunks, chunk, ...]
        v = F.pad(v, (0, 0) * (v.dim() - 1) + (0, pad)).view(k, chunk, *v.shape[1:])
        return v.movedim(2, 0)

    xdt = chunked(x * dt[..., None])  # [H, k, L, P]
    cs = torch.cumsum(chunked(a * dt), dim=-1)  # [H, k, L]
    bg, cg = chunked(b), chunked(c)  # [G, k, L, N]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, -torch.inf))  # [H, k, L, L]
    scores = (cg @ bg.transpose(-1, -2))[:, None]  # [G, 1, k, L, L]
    y = ((scores * decay.view(groups, rep, k, chunk, chunk)) @ xdt.view(groups, rep, k, chunk, p))
    # each chunk's own contribution to the state at its end: [H, k, P, N]
    weighted = (xdt * torch.exp(cs[..., -1:] - cs)[..., None]).transpose(-1, -2)
    own = (weighted.view(groups, rep, k, p, chunk) @ bg[:, None]).view(heads, k, p, n)
    running = torch.zeros(heads, p, n, dtype=x.dtype, device=x.device) if state is None else state.to(x.dtype)
    carried = torch.exp(cs[..., -1])  # [H, k] each chunk's whole decay
    starts = []
    for i in range(k):
        starts.append(running)
        running = running * carried[:, i, None, None] + own[:, i]
    start_states = torch.stack(starts, dim=1)  # [H, k, P, N] the state entering each chunk
    y_off = (cg[:, None] @ start_states.view(groups, rep, k, p, n).transpose(-1, -2)).view(heads, k, chunk, p)
    y = y.view(heads, k, chunk, p) + y_off * torch.exp(cs)[..., None]
    return y.reshape(heads, -1, p)[:, :t].movedim(0, 1) + skip, running


class Mamba2Mixer(nn.Module):
    """The mixer in place of attention (`forward(x, kv_cache, meta, rows)`). `A` (as `-exp(A_log)`), `D` and
    `dt_bias` are fp32 whatever the model's dtype (`set_ssm_parameters`, after the load)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, state: int, groups: int, kernel: int,
                 conv_bias: bool, proj_bias: bool, eps: float, time_step_limit: tuple[float, float] | None) -> None:
        super().__init__()
        self.heads, self.head_dim, self.state, self.groups, self.eps = heads, head_dim, state, groups, eps
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state
        self.dt_limit = tuple(time_step_limit) if time_step_limit is not None else (0.0, float("inf"))
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_dim + heads, bias=proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, kernel))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim)) if conv_bias else None
        self.norm_weight = nn.Parameter(torch.empty(self.inner))
        self.out_proj = nn.Linear(self.inner, hidden, bias=proj_bias)
        for name in ("A", "D", "dt_bias"):
            self.register_buffer(name, torch.zeros(heads), persistent=False)
        self._weights: tuple[torch.Tensor, ...] | None = None  # the native kernel's copy (`_native_weights`)

    def set_ssm_parameters(self, a: torch.Tensor, d: torch.Tensor, dt_bias: torch.Tensor) -> None:
        """The per-head `A` (negative: `-exp(A_log)`), `D` and `dt_bias`, kept in fp32."""
        for name, value in (("A", a), ("D", d), ("dt_bias", dt_bias)):
            setattr(self, name, value.detach().reshape(self.heads).to(device=self.norm_weight.device,
                                                                   dtype=torch.float32))
        self._weights = None

    def state_slots(self, num_kv_heads: int, head_dim: int, element_size: int) -> tuple[int, int]:
        """Slots of one conv ring row and of the SSM state, in a pool of this geometry."""
        return (state_slots_per_row(self.conv_dim, num_kv_heads, head_dim),
                state_slots(self.heads * self.head_dim * self.state, num_kv_heads, head_dim, element_size))

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        proj = self.in_proj(x)
        nd = meta.num_decodes
        native = self._native(kv_cache) if nd else None
        parts = []
        if native is not None:  # decode rows: one native pass (the decode stack's arithmetic)
            parts.append(native.decode(proj[:nd], kv_cache, meta.decode_block_tables, meta.decode_positions,
                                       meta.page_size, self.native_shape, self.native_weights(), self.eps))
        if native is None or proj.shape[0] > nd:
            parts.append(self._rows(proj[nd:] if native is not None else proj, kv_cache, meta, native is not None))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.out_proj(out if rows is None else out.index_select(0, rows))

    @property
    def native_shape(self) -> tuple[int, int, int, int, int]:
        """(heads, head_dim, state, groups, kernel), as the native kernels take the mixer's shape."""
        return self.heads, self.head_dim, self.state, self.groups, self.conv_weight.shape[-1]

    def _native(self, kv_cache: torch.Tensor) -> SsmOps | None:
        """The native decode rows' kernels where they take this pool."""
        ops = cpu_ssm_ops() if kv_cache.device.type == "cpu" else None
        return ops if ops is not None and ops.fits(kv_cache, self.state) else None

    def native_weights(self) -> tuple[torch.Tensor, ...]:
        """The layer's weights as the native kernel takes them (fp32: taps `[kernel, conv_dim]`, the conv bias or
        an empty tensor, A, D, dt_bias, the norm's weight); made once."""
        if self._weights is None:
            bias = self.conv_bias.float() if self.conv_bias is not None else torch.empty(0)
            self._weights = (self.conv_weight.float().flatten(1).t().contiguous(), bias.contiguous(), self.A, self.D,
                             self.dt_bias, self.norm_weight.float().contiguous())
        return self._weights

    def _rows(self, proj: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
              without_decodes: bool) -> torch.Tensor:
        """The gated norm's outputs of `proj`'s rows, op by op: the batch's rows, or (`without_decodes`, the
        decode rows taken natively) its prefill chunks' alone."""
        t = proj.shape[0]
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.heads], dim=-1)
        index = meta.state
        if index is None:  # (the group's first layer of the pass; the others share it)
            rows = meta
            if without_decodes:
                nd = meta.num_decodes
                rows = replace(meta, num_decodes=0, prefills=[replace(span, q_start=span.q_start - nd)
                                                              for span in meta.prefills])
            r, s = self.state_slots(kv_cache.shape[2], kv_cache.shape[3], kv_cache.element_size())
            index = meta.state = mamba_index(rows, t, self.conv_weight.shape[-1], r, s)
        xbc = F.silu(short_conv(xbc, self.conv_weight, kv_cache, meta, self.conv_bias, index.conv).float())
        xs, b, c = xbc.split([self.inner, self.groups * self.state, self.groups * self.state], dim=-1)
        xs = xs.view(t, self.heads, self.head_dim)
        b, c = b.reshape(t, self.groups, self.state), c.reshape(t, self.groups, self.state)
        dt = F.softplus(dt.float() + self.dt_bias)  # (clamped to `time_step_limit` in the scan, as the references)
        y = torch.empty_like(xs)
        nd, numel = index.decode_slots.shape[0], self.heads * self.head_dim * self.state
        if nd:
            y[:nd] = self._decode(xs[:nd], dt[:nd], b[:nd], c[:nd], kv_cache, index, numel)
        for span, slots, fresh in zip(index.spans, index.span_slots, index.span_fresh):
            q = slice(span.q_start, span.q_start + span.q_len)
            start = None if fresh else read_state(kv_cache, slots[None], numel).view(
                self.heads, self.head_dim, self.state)
            # (a span shorter than a chunk is one chunk of its own length: the same sums, without the padding)
            y[q], final = chunk_scan(xs[q], dt[q].clamp(*self.dt_limit), self.A, b[q], c[q], self.D, start,
                                     min(SCAN_CHUNK, span.q_len))
            write_state(kv_cache, slots[None], final.reshape(1, numel))
        return self._gated_norm(y.view(t, self.inner), gate).to(proj.dtype)

    def _decode(self, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                kv_cache: torch.Tensor, index: MambaIndex, numel: int) -> torch.Tensor:
        """One token per row, op by op (where the native kernel does not run): the recurrence over the rows'
        states, read out of the pool and written back."""
        n = x.shape[0]
        decay = torch.exp(dt * self.A)
        b, c = self._per_head(b), self._per_head(c)
        state = read_state(kv_cache, index.decode_slots, numel).view(n, self.heads, self.head_dim, self.state)
        state = torch.where(index.decode_started, state, 0.0)  # (a row with no state yet: zeros, not the page's)
        state = state * decay[..., None, None] + (dt[..., None, None] * b[:, :, None]) * x[..., None]
        write_state(kv_cache, index.decode_slots, state.view(n, numel))
        y = torch.matmul(state.view(-1, self.head_dim, self.state), c.reshape(-1, self.state, 1))
        return y.view(n, self.heads, self.head_dim) + x * self.D[:, None]

    def _per_head(self, v: torch.Tensor) -> torch.Tensor:
        """`[t, groups, N]` -> `[t, heads, N]`: each group's B or C for each of its heads."""
        return v.repeat_interleave(self.heads // self.groups, dim=1)

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each group of `y * silu(gate)` (fp32), times the weight in the model's dtype."""
        h = (y.float() * F.silu(gate.float())).view(y.shape[0], self.groups, self.inner // self.groups)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * h.view(y.shape[0], self.inner).to(gate.dtype)
