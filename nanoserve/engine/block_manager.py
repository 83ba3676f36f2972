"""Chapter 04: KV memory handed out in fixed-size blocks, shared when prompts share a prefix.

The pool is `num_blocks` blocks of `block_size` token positions. A sequence owns a *block table*: the
ids of its blocks in order, so token position p lives in block `table[p // block_size]` at offset
`p % block_size`. Blocks come from a free list on demand, so a sequence holds memory for the tokens it
has, not for the longest it might grow to.

Prefix caching: once a block is full and its keys/values are computed, it gets a hash chained over
its tokens and its parent block's hash (so equal hashes mean equal *prefixes*, not just equal
16-token windows). A new request whose first blocks hash the same reuses them (reference counts) and
skips their prefill. A block whose last user is gone goes back on the free list *with* its hash: it
can still be reused until it is handed out for something else, least recently freed first (LRU).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from nanoserve.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block: its tokens and, through the parent's hash, every token before them."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0          # sequences whose block table holds this block
        self.hash: bytes | None = None  # set once the block is full and computed (prefix caching)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.cached: dict[bytes, int] = {}   # hash -> block id, for computed full blocks
        self.hit_tokens = self.queried_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (some still carry a cached prefix until handed out again)."""
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- a sequence joins: reuse its cached prefix ---------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Give `seq` the cached blocks that start its tokens; returns how many tokens they cover.

        The block holding the last token is never taken from the cache: that token must be computed
        to get the logits for the next one, and a shared block is never written.
        """
        assert not seq.block_table, f"{seq} already holds blocks"
        seq.block_hashes = []
        if not self.enable_prefix_caching or seq.needs_prompt_logits:   # its prompt's logits are wanted: compute it
            return 0
        for h in self.prefix_hashes(seq):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            self._hold(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        seq.num_cached_tokens = len(seq.block_table) * self.block_size
        return seq.num_cached_tokens

    def prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of the full blocks before `seq`'s last token (the blocks a cache hit can cover).
        Kept on the sequence: they only change when it has more tokens (recomputed after a preemption)."""
        if seq.prefix_hashes is not None and seq.prefix_hashes[0] == seq.num_tokens:
            return seq.prefix_hashes[1]
        bs, parent, hashes = self.block_size, None, []
        for i in range((seq.num_tokens - 1) // bs):
            parent = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        seq.prefix_hashes = (seq.num_tokens, hashes)
        return hashes

    def first_missing_block(self, seq: Sequence) -> bytes | None:
        """The hash of `seq`'s first full block that is not in the cache (None: all cached, or no caching)."""
        if not self.enable_prefix_caching:
            return None
        return next((h for h in self.prefix_hashes(seq) if h not in self.cached), None)

    def record_admission(self, seq: Sequence, hit_tokens: int) -> None:
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += hit_tokens
        if seq.num_prefix_hit_tokens is None:   # the request's own count: its first admission (usage.cached_tokens)
            seq.num_prefix_hit_tokens = hit_tokens

    # -- growing and releasing ----------------------------------------------------------------------
    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s table cover `num_tokens` positions. All or nothing: False if the pool is short."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > len(self.free):
            return False
        for _ in range(max(missing, 0)):
            seq.block_table.append(self._take_free())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past those covering `num_tokens` positions (chapter 10: the rejected drafts'
        positions, when a rollback leaves a block with none of the sequence's tokens)."""
        keep = max(self.blocks_for(num_tokens), len(seq.block_hashes))
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = None

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks; unreferenced blocks go back on the free list."""
        for block_id in reversed(seq.block_table):  # tail first, so the tail is evicted before the prefix
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table, seq.block_hashes = [], []
        seq.num_cached_tokens = 0

    def commit_full_blocks(self, seq: Sequence) -> None:
        """After a step: hash the blocks that became full, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_cached_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached:            # an identical block computed by another request wins
                block.hash, self.cached[h] = h, block.block_id

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)   # least recently freed
        block = self.blocks[block_id]
        if block.hash is not None:                    # evict its cached prefix
            del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id
