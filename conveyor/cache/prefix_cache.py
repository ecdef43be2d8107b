"""Prefix caching (docs/design/prefix-caching.md): content hashes of completed blocks, and the blocks kept for reuse.

A block is *completed* when all `page_size` of its tokens have K/V in the cache. Its digest is
`sha256(parent digest + its token ids as little-endian int64)`, chained from the sequence's first
block, whose parent is the sequence's root: empty, or, where the model's K/V depends on more than the
tokens (RoPE scaled by the prompt's length, `models.base.CausalLM.prefix_key`), the digest of that key.
Equal digests mean equal token prefixes up to and including that block (and equal keys). The digest
depends on nothing else: it is the same in every process and on every machine (Python's `hash` is
salted per process, so it is never used).

`PrefixCache` keeps the hash index, digest <-> block (one block per digest, one digest per
block), and the *cached* blocks: completed blocks that no request holds any more, whose content
and digest are kept so that a later request with the same prefix can reuse them. A block is in
exactly one of three states:

- uninitialized: in the `CachePool`'s free list, no digest;
- held: in one or more requests' block tables (the allocator counts the holders); it may have a
  digest, and then it can be matched;
- cached: held by nobody, digest kept; it can be matched (and becomes held again), or evicted.

Eviction (docs/design/prefix-caching.md#eviction): when the uninitialized pool runs out, the *most recently
initialized* block, that is the one that most recently entered the cached state, goes back to
uninitialized and loses its digest (LIFO over the cached blocks). A request's blocks enter the
cached state in table order when it is freed, so the deepest block of a prefix goes first and the
shorter prefix stays matchable the longest.

Tails (docs/design/prefix-caching.md#tails): a finished request's last block, partly filled, is kept
cached too, under its parent's digest with the tokens it holds, so that a request continuing those
tokens (the next step of a beam search, the next turn of a chat) copies their K/V into a block of its
own instead of computing them again. A tail is never held or shared: it is only read, while pinned
(taken out of the cached blocks, so that no allocation evicts it), and evicted like any cached block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

ROOT_DIGEST = b""


def block_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Digest of a completed block holding `token_ids`, after the block whose digest is `parent`."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class TokenSource(Protocol):
    def token_slice(self, start: int, end: int) -> list[int]: ...


class BlockHashes:
    """The chained digests of one sequence's leading completed blocks, each computed once."""

    def __init__(self, page_size: int, tokens: TokenSource, key: bytes = b"") -> None:
        self.page_size = page_size
        self.tokens = tokens
        self.root = hashlib.sha256(key).digest() if key else ROOT_DIGEST
        self.digests: list[bytes] = []

    def digest(self, index: int) -> bytes:
        """Digest of block `index` (its tokens must all exist), hashing the blocks before it if not done yet."""
        while len(self.digests) <= index:
            i = len(self.digests)
            block = self.tokens.token_slice(i * self.page_size, (i + 1) * self.page_size)
            assert len(block) == self.page_size, f"block {i} is not complete"
            self.digests.append(block_digest(self.digests[-1] if self.digests else self.root, block))
        return self.digests[index]


class PrefixCache:
    """The hash index of completed blocks, and the cached blocks in the order they became cached."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        # The cached blocks, oldest first (evicted from the end), each with its sibling chunks (a block of a
        # type with several layer groups is a chunk in each: `cache.allocator`), which go with it.
        self._cached: dict[int, list[int]] = {}
        self._num_chunks = 0
        self._tails: dict[bytes, dict[int, tuple[int, ...]]] = {}  # parent digest -> {tail block: its tokens}
        self._tail_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # tail block -> (parent digest, tokens)
        self._expected: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # blocks to keep as tails when released

    @property
    def num_cached(self) -> int:
        """Pool chunks the cached blocks hold (a block with siblings counts each)."""
        return self._num_chunks

    def _add(self, block: int, siblings: list[int]) -> None:
        self._cached[block] = siblings
        self._num_chunks += 1 + len(siblings)

    def _remove(self, block: int) -> list[int]:
        siblings = self._cached.pop(block)
        self._num_chunks -= 1 + len(siblings)
        return siblings

    def lookup(self, digest: bytes) -> int | None:
        """The block holding the completed prefix with this digest, held or cached; None if none."""
        return self._block_of.get(digest)

    def digest_of(self, block: int) -> bytes | None:
        return self._digest_of.get(block)

    def register(self, block: int, digest: bytes) -> bool:
        """Index a block that just completed. A digest already indexed keeps its block (two requests
        computed the same prefix at the same time): this one stays unindexed and is simply freed later."""
        assert block not in self._digest_of, f"block {block} completed twice"
        if digest in self._block_of:
            return False
        self._block_of[digest] = block
        self._digest_of[block] = digest
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def park(self, block: int, siblings: list[int] | None = None) -> bool:
        """The last holder freed `block` (and its `siblings`): keep it cached if it has a digest or is an
        expected tail (True); False means it has neither and goes back to the uninitialized pool."""
        tail = self._expected.pop(block, None)
        if tail is not None:
            self.park_tail(block, *tail)
            return True
        if block not in self._digest_of:
            return False
        self._add(block, siblings or [])
        return True

    def expect_tail(self, block: int, parent: bytes, tokens: tuple[int, ...]) -> None:
        """Keep `block` as a tail (`parent`'s, holding `tokens`) when its holder releases it next."""
        self._expected[block] = (parent, tokens)

    def forget_expected(self, block: int) -> None:
        """`block` is no expected tail any more (released as one already, or still held elsewhere)."""
        self._expected.pop(block, None)

    def park_tail(self, block: int, parent: bytes, tokens: tuple[int, ...]) -> None:
        self._tails.setdefault(parent, {})[block] = tokens
        self._tail_of[block] = (parent, tokens)
        self._add(block, [])

    def match_tail(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(tail block, how many of its tokens begin `tokens`) for the longest tail of `parent` whose tokens
        all begin `tokens`; None if none does."""
        best: tuple[int, int] | None = None
        for block, held in self._tails.get(parent, {}).items():
            if len(held) <= len(tokens) and tuple(tokens[:len(held)]) == held and (best is None or len(held) > best[1]):
                best = (block, len(held))
        return best

    def pin(self, block: int) -> tuple[bytes, tuple[int, ...]]:
        """Take a tail out of the cached blocks while it is read (no allocation can evict it); `park_tail`
        with what this returns puts it back."""
        self._remove(block)
        parent, tokens = self._tail_of.pop(block)
        self._drop_tail(parent, block)
        return parent, tokens

    def _drop_tail(self, parent: bytes, block: int) -> None:
        del self._tails[parent][block]
        if not self._tails[parent]:
            del self._tails[parent]

    def reuse(self, block: int) -> list[int]:
        """A cached block was matched: it is held again; its sibling chunks, back to its holder."""
        return self._remove(block)

    def evict(self) -> list[int]:
        """Turn the most recently cached block back into uninitialized chunks (it and its siblings, returned);
        its digest (or its place as a tail) is dropped."""
        block = next(reversed(self._cached))
        chunks = [block, *self._remove(block)]
        if block in self._tail_of:
            self._drop_tail(self._tail_of.pop(block)[0], block)
        else:
            del self._block_of[self._digest_of.pop(block)]
        return chunks
