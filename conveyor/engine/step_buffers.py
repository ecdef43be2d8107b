"""Static step buffers and shape padding (docs/design/cuda-graphs.md): what lets a step replay a CUDA graph.

A graph replays fixed kernels on fixed addresses, so a padded step writes its inputs (ids,
positions, per layer group the slot mapping, decode block tables and context lengths, and the rows
that sample) into tensors allocated once, and its shape is rounded so that few shapes recur:
query tokens up to a multiple of `q_padding_interval_size`, the block-table width up to a multiple
of `kv_padding_interval_size / page_size` pages, the sampled rows up to a power of two. Padding
tokens are extra decode rows placed after the real decodes (before any prefill chunk): id 0 at
position 0, one context slot, their K/V written to slot 0 and their table all chunk 0, the chunk
the pool reserves for padding, so no request's cache is touched. Padded sample rows point at a
padding row (or row 0) and their logits are never sampled. The same code runs on CPU and CUDA;
only capture and replay (`graph_runner`) are CUDA-only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..layers.attention import AttentionMetadata


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def sample_bucket(n: int) -> int:
    """Sampled rows padded to the next power of two (0 stays 0)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class PaddedShape:
    """The padded shape of a step: what a captured graph is keyed by (with its buffer set)."""

    num_tokens: int
    num_decodes: int
    table_width: int
    num_samples: int
    decode_only: bool


@dataclass
class PaddedStep:
    """A step's inputs as views of the static buffers, padded; `pad_at` is the first padding row and
    `num_pad` how many there are (rows from `pad_at` on move down by `num_pad`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]  # one per layer group
    sample_rows: torch.Tensor  # [shape.num_samples]; the first `num_real_samples` are real
    num_real_samples: int
    shape: PaddedShape
    pad_at: int
    num_pad: int

    def row(self, unpadded_row: int) -> int:
        return unpadded_row if unpadded_row < self.pad_at else unpadded_row + self.num_pad


class StepBuffers:
    """One set of preallocated step inputs on the model's device, sized for the largest step."""

    def __init__(self, num_groups: int, max_tokens: int, max_decodes: int, max_width: int, max_samples: int,
                 q_interval: int, width_multiple: int, device: torch.device) -> None:
        self.q_interval, self.width_multiple = q_interval, width_multiple
        tokens = round_up(max_tokens, q_interval)
        rows = min(tokens, max_decodes + q_interval - 1)
        width = round_up(max_width, width_multiple)
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(tokens, **long)
        self.positions = torch.zeros(tokens, **long)
        self.slot_mapping = torch.zeros(num_groups, tokens, **long)
        self.block_tables = torch.zeros(num_groups, rows * width, **long)  # viewed [rows, width] per step
        self.context_lens = torch.ones(num_groups, rows, **long)
        self.sample_rows = torch.zeros(sample_bucket(max_samples), **long)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.input_ids, self.positions, self.slot_mapping,
                                                          self.block_tables, self.context_lens, self.sample_rows))

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata],
             sample_rows: list[int]) -> PaddedStep:
        """Copy an unpadded step (decode rows first, as the runner lays it out) into the buffers, padded."""
        num_tokens, nd = input_ids.numel(), metas[0].num_decodes
        padded = round_up(num_tokens, self.q_interval)
        pad = padded - num_tokens
        ndp = nd + pad
        width = round_up(max([1] + [m.decode_block_tables.shape[1] for m in metas if m.num_decodes]),
                         self.width_multiple)
        for src, dst in ((input_ids, self.input_ids), (positions, self.positions)):
            self._split_copy(src, dst, nd, pad)
        padded_metas = []
        for g, meta in enumerate(metas):
            self._split_copy(meta.slot_mapping, self.slot_mapping[g], nd, pad)
            tables, lens = self.block_tables[g, :ndp * width].view(ndp, width), self.context_lens[g, :ndp]
            tables.zero_()
            lens[nd:].fill_(1)
            if nd:
                tables[:nd, :meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
                lens[:nd].copy_(meta.decode_context_lens)
            padded_metas.append(AttentionMetadata(
                slot_mapping=self.slot_mapping[g, :padded], page_size=meta.page_size, num_decodes=ndp,
                decode_block_tables=tables if ndp else None, decode_context_lens=lens if ndp else None,
                decode_positions=self.positions[:ndp] if ndp else None,
                prefills=[replace(span, q_start=span.q_start + pad) for span in meta.prefills], window=meta.window,
                decode_shared_rows=meta.decode_shared_rows))
        samples = sample_bucket(len(sample_rows))
        rows = [r if r < nd else r + pad for r in sample_rows] + [nd if pad else 0] * (samples - len(sample_rows))
        out = self.sample_rows[:samples]
        if samples:
            out.copy_(torch.tensor(rows), non_blocking=True)
        shape = PaddedShape(padded, ndp, width, samples, not metas[0].prefills)
        return PaddedStep(self.input_ids[:padded], self.positions[:padded], padded_metas, out, len(sample_rows),
                          shape, nd, pad)

    @staticmethod
    def _split_copy(src: torch.Tensor, dst: torch.Tensor, nd: int, pad: int) -> None:
        """dst = src[:nd], `pad` zeros, src[nd:]."""
        n = src.numel()
        dst[:nd].copy_(src[:nd])
        dst[nd:nd + pad].zero_()
        dst[nd + pad:n + pad].copy_(src[nd:])


class LogitsBuffer:
    """The LM head's fp32 logits, written into one buffer that every step reuses (on CPU).

    A fresh `[rows, vocab]` tensor per step is 50 MB at 256 rows of a 49k vocabulary: above glibc's
    largest mmap threshold (32 MB), so each step maps it anew and faults in and zeroes every page
    (20-28 ms of a 55-64 ms LM head at 256 rows, against 36 ms into a reused buffer, measured on the
    2-core AVX-512 Xeon). The runner takes a view only for logits that die with their step: not for
    the rows kept for speculative verification, which outlive it. Grows to the largest step seen.
    `width`: the head's `CausalLM.logits_out_width` on CPU; None where the head writes into no buffer."""

    def __init__(self, width: int | None) -> None:
        self.width = width
        self.buffer: torch.Tensor | None = None

    def take(self, rows: int) -> torch.Tensor | None:
        """A contiguous `[rows, width]` fp32 view, overwritten by the next `take`; None without a width."""
        if self.width is None:
            return None
        buffer = self.buffer
        if buffer is None or buffer.shape[0] < rows:
            buffer = self.buffer = torch.empty(sample_bucket(rows), self.width)
        return buffer[:rows]
