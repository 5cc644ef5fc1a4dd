"""A paged KV cache: the block pool of ``app/cache/blocks.py``, block tables, and the K/V tensors.

The nouns are vLLM's (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``) so a reader can go on to
read vLLM next. One ``PagedKVCache`` owns a ``BlockPool`` (prefix caching off for the /paged lab, which shares
blocks by forking; on for the /prefix lab, which ``attach``es cached blocks to a new sequence) and, for every
layer, a K tensor and a V tensor cut into ``num_blocks`` physical blocks of ``block_size`` token slots each::

    key_cache[layer]  (num_blocks, H_kv, block_size, Dh)      value_cache[layer] likewise

    sequence 0: block table [5, 2, 7]       tokens 0..3 -> block 5, 4..7 -> block 2, 8..9 -> block 7
                                            (block 7 holds 2 of 4 slots: 2 slots of tail waste)
    sequence 1 (forked from 0): [5, 2, 7]   every block ref_cnt 2 until one of them writes
    sequence 2 (attached [5, 2]): [5, 2, 9] a prefix hit: blocks 5 and 2 hold its first 8 tokens already,
                                            only tokens 8.. are computed and written (into block 9)

Sliding-window layers (Gemma 3's local layers) are kept apart, as vLLM's hybrid allocator keeps them: the layers'
KV-cache specs (``app/cache/spec.py``) split them into KV-cache groups of one spec each (full attention, or one
sliding window) and equal size, every group has its own block table per sequence, and all groups draw from the one
pool. A block's page holds ``group_size``
layers: layer j of every group shares the j-th K/V tensor, so a block id means "these token slots of the layers of
whichever group holds it" and no memory sits unused. A sliding-window group frees a block once it falls wholly
outside the window (vLLM's ``SlidingWindowManager.remove_skipped_blocks``) and leaves ``NULL_BLOCK`` in its place::

    tiny Gemma 3 (layers 0, 1 local, window 8; layer 2 full), block_size 4, 14 tokens, next query at 14:
        group 0  full     [layer 2]   [3, 4, 5, 6]        every token
        group 1  sliding  [layer 0]   [-, 8, 9, 10]       positions 7..14 read: block 0 (0..3) freed
        group 2  sliding  [layer 1]   [-, 12, 13, 14]

A model whose layers are all of one kind has one group of every layer: the layout above, unchanged.

Invariants (checked by tests/cache/test_paged_stress.py after every operation):
  * a block's ``ref_cnt`` equals the number of block-table entries that point at it;
  * a block is in the free block queue exactly when its ``ref_cnt`` is 0;
  * a token's K/V is only ever written into a block whose ``ref_cnt`` is 1 (copy-on-write first):
    no physical block is written by two sequences;
  * every operation that needs blocks checks the free count first and raises ``PoolExhausted`` before
    touching anything, so a failed call leaves the pool exactly as it was.

Who mutates what: only the methods below change the pool (``blocks``, its free block queue) and ``block_tables``;
the decoder (``app/cache/paged_decode.py``) writes K/V through ``write_kv`` and reads through ``gather_kv``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from app.cache import spec as kv_spec
from app.cache.blocks import BlockPool, KVCacheBlock, blocks_needed
from app.cache.spec import KVCacheGroup, KVCacheSpec, kv_cache_groups
from app.kv_bytes import dtype_name

__all__ = ["NULL_BLOCK", "KVCacheGroup", "PagedKVCache", "PoolExhausted", "blocks_needed", "kv_cache_groups"]

NULL_BLOCK = -1  # a block-table entry whose block a sliding-window group freed (vLLM's null_block)


class PoolExhausted(RuntimeError):
    """The pool has fewer free blocks than an operation needs. Nothing was changed."""

    def __init__(self, seq_id: int, needed: int, free: int) -> None:
        super().__init__(f"sequence {seq_id} needs {needed} free block(s); the pool has {free}")
        self.seq_id = seq_id
        self.needed = needed
        self.free = free


class PagedKVCache:
    """Block pool + block tables + the K/V tensors themselves.

    The pool's free block queue is a FIFO here: a freed block goes to its back and allocation takes from its
    front, so a just-freed block is reused last (blocks of a finished sequence are freed in reverse order, tail
    first, as vLLM does). With prefix caching off no block keeps a hash, so nothing is ever evicted.
    """

    def __init__(
        self, *, num_blocks: int, block_size: int, n_layer: int, n_kv_head: int, head_dim: int,
        dtype: torch.dtype = torch.float32, enable_caching: bool = False, specs: Sequence[KVCacheSpec] | None = None,
    ) -> None:
        """``specs``: each layer's KV-cache spec (``app.cache.spec.from_adapter``); None: every layer full attention,
        one group (the window, if any, applied by the attention mask alone)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if specs is not None and len(specs) != n_layer:
            raise ValueError(f"{len(specs)} specs for {n_layer} layers")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_layer = n_layer
        self.specs = tuple(specs) if specs is not None else kv_spec.uniform(n_layer, n_kv_head, head_dim)
        self.groups = kv_cache_groups(self.specs)
        self.group_of = [0] * n_layer  # layer -> its group
        slot_of = [0] * n_layer  # layer -> the K/V tensor it shares with the same place in every other group
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                self.group_of[layer], slot_of[layer] = g, j
        self.group_size = kv_spec.group_size(self.groups)  # layers one block's page holds
        shape = (num_blocks, n_kv_head, block_size, head_dim)
        keys = [torch.zeros(shape, dtype=dtype) for _ in range(self.group_size)]
        values = [torch.zeros(shape, dtype=dtype) for _ in range(self.group_size)]
        self.key_cache = [keys[slot_of[layer]] for layer in range(n_layer)]  # layers of different groups share
        self.value_cache = [values[slot_of[layer]] for layer in range(n_layer)]
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.tables: list[dict[int, list[int]]] = [{} for _ in self.groups]  # per group: seq id -> block table
        self.num_tokens: dict[int, int] = {}  # tokens whose K/V are (or are being) stored, per sequence
        self.cow_copies = 0  # copy-on-write copies made, a metric the article asks engines to expose
        self.window_frees = 0  # blocks sliding-window groups gave back because they fell outside the window

    @property
    def block_tables(self) -> dict[int, list[int]]:
        """The first group's block tables (the full-attention layers', or every layer's when all are alike)."""
        return self.tables[0]

    def seq_tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's block table in every group (``NULL_BLOCK`` where a sliding window freed one)."""
        return [t[seq_id] for t in self.tables]

    def held_blocks(self, seq_id: int, group: int | None = None) -> list[int]:
        """Block ids the sequence references (one group, or all), null entries left out."""
        tables = self.seq_tables(seq_id) if group is None else [self.tables[group][seq_id]]
        return [b for t in tables for b in t if b != NULL_BLOCK]

    def tables_of_all(self) -> Iterator[tuple[int, int, list[int]]]:
        """(group, seq id, table) for every block table."""
        for g, tables in enumerate(self.tables):
            for seq_id, table in tables.items():
                yield g, seq_id, table

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def blocks(self) -> list[KVCacheBlock]:
        return self.pool.blocks

    @property
    def free_block_queue(self) -> list[int]:
        """Ids of the free blocks, the next one to be taken first."""
        return [b.block_id for b in self.pool.free_block_queue.blocks()]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def bytes_per_block(self) -> int:
        """One block's page: its slots in the ``group_size`` layers of the group holding it (the specs' page size)."""
        return int(kv_spec.block_bytes(self.groups, self.block_size, dtype_name(self.key_cache[0].dtype)))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a prefill of ``num_tokens`` takes: that many token slots in every group."""
        return len(self.groups) * blocks_needed(num_tokens, self.block_size)

    def tail_waste(self, seq_id: int) -> int:
        """Unused slots in the sequence's last block (internal fragmentation)."""
        return len(self.block_tables[seq_id]) * self.block_size - self.num_tokens[seq_id]

    # --- block pool --------------------------------------------------------------------------------
    def _take_free_blocks(self, n: int) -> list[int]:
        return [b.block_id for b in self.pool.get_new_blocks(n)]

    def _check(self, seq_id: int, needed: int) -> None:
        if needed > self.pool.num_free_blocks:
            raise PoolExhausted(seq_id, needed, self.pool.num_free_blocks)

    # --- sequence lifecycle ----------------------------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Give a new sequence the blocks for ``num_tokens`` tokens (its prompt, at prefill)."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        if num_tokens < 1:
            raise ValueError("a sequence needs at least one token")
        self._check(seq_id, self.blocks_for(num_tokens))
        for tables in self.tables:
            tables[seq_id] = self._take_free_blocks(blocks_needed(num_tokens, self.block_size))
        self.num_tokens[seq_id] = num_tokens
        return list(self.block_tables[seq_id])

    def attach(self, seq_id: int, computed_blocks: Sequence[Sequence[KVCacheBlock | None]]) -> None:
        """A new sequence whose first tokens are already cached: in every group it starts with that group's
        ``computed_blocks`` (the full blocks a prefix hit found, ref_cnt + 1 each, so they leave the free queue;
        None where a sliding window does not need the block: ``NULL_BLOCK``) and grows with ``append_slots``."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        if len(computed_blocks) != len(self.groups) or len({len(h) for h in computed_blocks}) > 1:
            raise ValueError("one list of computed blocks per group, all of one length")
        for tables, hits in zip(self.tables, computed_blocks, strict=True):
            self.pool.touch(b for b in hits if b is not None)
            tables[seq_id] = [NULL_BLOCK if b is None else b.block_id for b in hits]
        self.num_tokens[seq_id] = len(computed_blocks[0]) * self.block_size

    def blocks_to_append(self, seq_id: int, n_new: int = 1) -> int:
        """Free blocks the next ``append_slots(n_new)`` will take, in every group: new blocks past the tail, plus 1
        when the tail is partial and shared (its copy)."""
        n = self.num_tokens[seq_id]
        total = 0
        for table in self.seq_tables(seq_id):
            cow = 1 if n % self.block_size and self.blocks[table[-1]].ref_cnt > 1 else 0
            total += blocks_needed(n + n_new, self.block_size) - len(table) + cow
        return total

    def remove_skipped_blocks(self, seq_id: int) -> list[int]:
        """Free, in each sliding-window group, the blocks no future query of the sequence reads (vLLM's
        ``remove_skipped_blocks``): the next query, at position n, reads keys n - W + 1 .. n, so every block wholly
        before n - W + 1 goes back to the pool (newest first) and ``NULL_BLOCK`` takes its place. Returns the
        block ids now free."""
        n, freed = self.num_tokens[seq_id], []
        for group, tables in zip(self.groups, self.tables, strict=True):
            table = tables[seq_id]
            skipped = group.spec.num_skipped_tokens(n) // self.block_size  # 0 for full attention
            removed = []
            for j in range(skipped - 1, -1, -1):
                if table[j] == NULL_BLOCK:
                    break  # the ones before were freed by an earlier step
                removed.append(table[j])
                table[j] = NULL_BLOCK
            self.pool.free_blocks(self.blocks[b] for b in removed)
            self.window_frees += len(removed)
            freed += [b for b in removed if self.blocks[b].ref_cnt == 0]
        return freed

    def append_slots(self, seq_id: int, n_new: int) -> None:
        """Reserve the slots of the sequence's next ``n_new`` tokens (vLLM's allocate_slots).

        Sliding-window groups first give back the blocks that fell outside their window. A tail shared with a
        fork is copied first (copy-on-write): only that one block, only its written slots, only the layers of its
        group; the full blocks before it stay shared. Then new blocks for whatever does not fit.
        """
        self.remove_skipped_blocks(seq_id)
        n = self.num_tokens[seq_id]
        offset = n % self.block_size
        self._check(seq_id, self.blocks_to_append(seq_id, n_new))
        for group, table in zip(self.groups, self.seq_tables(seq_id), strict=True):
            if offset and self.blocks[table[-1]].ref_cnt > 1:
                old = table[-1]
                (new,) = self._take_free_blocks(1)
                for layer in group.layers:
                    self.key_cache[layer][new, :, :offset] = self.key_cache[layer][old, :, :offset]
                    self.value_cache[layer][new, :, :offset] = self.value_cache[layer][old, :, :offset]
                self.pool.free_blocks([self.blocks[old]])
                table[-1] = new
                self.cow_copies += 1
            table += self._take_free_blocks(blocks_needed(n + n_new, self.block_size) - len(table))
        self.num_tokens[seq_id] = n + n_new

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        """The child shares every block of the parent (ref_cnt + 1 each); nothing is copied yet."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        for tables in self.tables:
            tables[child_id] = list(tables[parent_id])
        self.pool.touch(self.blocks[b] for b in self.held_blocks(child_id))
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        return list(self.block_tables[child_id])

    def free(self, seq_id: int) -> list[int]:
        """Finish or cancel: drop the sequence's references, group by group, tail first. Returns the blocks now
        free."""
        freed = []
        for tables in self.tables:
            table = [b for b in reversed(tables.pop(seq_id)) if b != NULL_BLOCK]
            self.pool.free_blocks(self.blocks[b] for b in table)
            freed += [b for b in table if self.blocks[b].ref_cnt == 0]
        del self.num_tokens[seq_id]
        return freed

    # --- K/V through the block table -----------------------------------------------------------------
    def slot(self, seq_id: int, position: int, group: int = 0) -> tuple[int, int]:
        """Logical token position -> (physical block id, offset) in one group's table."""
        if not 0 <= position < self.num_tokens[seq_id]:
            raise IndexError(f"position {position} outside sequence {seq_id}")
        return self.tables[group][seq_id][position // self.block_size], position % self.block_size

    def first_kept(self, seq_id: int, layer: int) -> int:
        """The first position whose K/V ``layer`` still holds for the sequence (0 unless a window freed blocks)."""
        table = self.tables[self.group_of[layer]][seq_id]
        return next((j for j, b in enumerate(table) if b != NULL_BLOCK), len(table)) * self.block_size

    def write_kv(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of tokens ``start .. start+T-1`` (k, v: (H_kv, T, Dh)) into their slots."""
        slots = [self.slot(seq_id, start + t, self.group_of[layer]) for t in range(k.shape[1])]
        for block_id in {b for b, _ in slots}:
            if block_id == NULL_BLOCK:
                raise RuntimeError(f"position outside layer {layer}'s window: its block was freed")
            if self.blocks[block_id].ref_cnt != 1:
                # Writing a shared block would change another sequence's history: refuse, never corrupt.
                raise RuntimeError(f"block {block_id} is shared (ref_cnt {self.blocks[block_id].ref_cnt})")
        block_ids = torch.tensor([b for b, _ in slots])  # (T,)
        offsets = torch.tensor([o for _, o in slots])  # (T,)
        dtype = self.key_cache[layer].dtype
        self.key_cache[layer][block_ids, :, offsets] = k.transpose(0, 1).to(dtype)  # (T, H_kv, Dh) into T slots
        self.value_cache[layer][block_ids, :, offsets] = v.transpose(0, 1).to(dtype)

    def gather_kv(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V ``layer`` holds for the sequence, in logical order, read block by block: (H_kv, T, Dh)
        each, positions ``first_kept(seq_id, layer)`` .. num_tokens - 1."""
        start = self.first_kept(seq_id, layer)
        table = torch.tensor(self.tables[self.group_of[layer]][seq_id][start // self.block_size :])
        n = self.num_tokens[seq_id] - start
        k = self.key_cache[layer][table]  # (n_blocks, H, block_size, Dh)
        v = self.value_cache[layer][table]
        nb, h, bs, d = k.shape
        k = k.transpose(0, 1).reshape(h, nb * bs, d)[:, :n]  # (H, T, Dh)
        v = v.transpose(0, 1).reshape(h, nb * bs, d)[:, :n]
        return k, v
