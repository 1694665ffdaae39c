"""Paged KV-cache bookkeeping: blocks, reference counts, prefix caching (nano-vllm / vLLM names).

Prefix caching reuses FULL blocks only, found by a hash of the block's token ids chained
with its parent block's hash, so a hit means the whole causal prefix is the same. A reused
(shared) block is never written: the engine writes K/V only at positions
>= ``seq.num_computed_tokens``, and hits cover positions below it. A block is not hit in the step
that computes it: the scheduler holds back a request whose next block another request of the step
computes (``computing_next``), and the request hits it a step later (so the n samples of one
prompt in a ``generate`` call share its prefill). Reused K/V has the same bits as recomputed K/V
because every kernel's result for a token depends only on the token and its causal prefix (the
bitmatch contract).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from bitmatch.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


def compute_block_hash(token_ids: list[int], parent_hash: int = -1) -> int:
    h = xxhash.xxh64()
    if parent_hash != -1:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_state_slots: int = 0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (oldest first); a free block keeps its hash, so its
        # cached K/V can still be hit until the block is handed out again.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self._seq_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its registered full blocks
        self.computing: set[int] = set()  # hashes of the full blocks the step being scheduled computes
        # Per-sequence state slots (cache groups of kind "per_seq"): one per running sequence; the
        # scheduler admits at most max_num_seqs = num_state_slots sequences.
        self.free_state_slots: list[int] = list(range(num_state_slots - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    # -- prefix cache ---------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, full blocks only, always leaving
        at least one token to compute (its logits give the next token)."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], -1
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block_tokens(i)
            h = compute_block_hash(tokens, parent)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def computing_next(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether the full block after ``hits`` (``seq``'s cached prefix) is one that a request
        scheduled in this step computes: ``seq`` then waits a step and hits it."""
        i = len(hits)
        if not self.computing or (i + 1) * self.block_size >= len(seq):
            return False
        parent = self.blocks[hits[-1]].hash if hits else -1
        return compute_block_hash(seq.block_tokens(i), parent) in self.computing

    def begin_step(self) -> None:
        self.computing.clear()

    def note_scheduled(self, seq: Sequence, num_new_tokens: int) -> None:
        """Record the hashes of the full blocks ``seq`` completes in this step (``computing_next``)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.get(seq.seq_id, [])
        parent = hashes[-1] if hashes else -1
        for i in range(len(hashes), (seq.num_computed_tokens + num_new_tokens) // self.block_size):
            parent = compute_block_hash(seq.block_tokens(i), parent)
            self.computing.add(parent)

    def num_free_blocks_taken_by(self, hits: list[int]) -> int:
        return sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def allocate_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Start ``seq`` on the cached blocks ``hits`` (from get_computed_blocks)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        hashes = []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            hashes.append(block.hash)
        seq.block_table = list(hits)
        if self.free_state_slots:
            seq.state_slot = self.free_state_slots.pop()
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)
        self._seq_hashes[seq.seq_id] = hashes

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (call after the weights change: cached K/V is stale)."""
        self.hash_to_block_id.clear()
        self.computing.clear()
        for block in self.blocks:
            block.hash, block.token_ids = -1, []
        for seq_id in self._seq_hashes:
            self._seq_hashes[seq_id] = []

    # -- allocation -----------------------------------------------------------------------
    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, num_computed: int | None = None) -> int:
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        have = len(seq.block_table) if num_computed is None else computed // self.block_size
        return max(0, seq.num_blocks_for(computed + num_new_tokens) - have)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` the blocks to hold its next ``num_new_tokens`` tokens."""
        for _ in range(self.num_new_blocks(seq, num_new_tokens)):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.reset()
            seq.block_table.append(block_id)

    def mark_computed(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed (their K/V is in the cache)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        for i in range(len(hashes), seq.num_computed_tokens // self.block_size):
            tokens = seq.block_tokens(i)
            h = compute_block_hash(tokens, hashes[-1] if hashes else -1)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tokens
            self.hash_to_block_id.setdefault(h, block.block_id)
            hashes.append(h)

    def deallocate(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are evicted before its head blocks.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._seq_hashes.pop(seq.seq_id, None)
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1
