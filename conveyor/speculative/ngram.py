"""Prompt-lookup proposals: continue the request as it continued the last time its current suffix
appeared in its own prompt or output (copying, quoting, code edits, repetitive formats).

For n from `max_n` down to `min_n`, the last n tokens are searched for in the earlier tokens; the
most recent earlier occurrence of the longest n-gram that has one wins, and up to k tokens that
followed it are proposed. The search is one vectorized comparison per n (numpy), O(length) per
request and step, with no Python loop over tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, max_n: int, min_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max ({max_n})")
        self.k, self.max_n, self.min_n = num_speculative_tokens, max_n, min_n

    def propose(self, tokens: np.ndarray | list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: the configured number) proposed next tokens; [] when no n-gram matches."""
        k = self.k if k is None else k
        seq = np.asarray(tokens, dtype=np.int64)
        length = seq.shape[0]
        if k < 1 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = seq[length - n:]
            windows = sliding_window_view(seq[:length - 1], n)  # windows ending before the last token
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence; what followed it
                return seq[start:start + k].tolist()
        return []
