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

import torch

from app.cache.blocks import BlockPool, KVCacheBlock, blocks_needed
from app.kv_bytes import dtype_name, page_bytes

__all__ = ["PagedKVCache", "PoolExhausted", "blocks_needed"]


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
        dtype: torch.dtype = torch.float32, enable_caching: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_layer = n_layer
        shape = (num_blocks, n_kv_head, block_size, head_dim)
        self.key_cache = [torch.zeros(shape, dtype=dtype) for _ in range(n_layer)]
        self.value_cache = [torch.zeros(shape, dtype=dtype) for _ in range(n_layer)]
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.block_tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}  # tokens whose K/V are (or are being) stored, per sequence
        self.cow_copies = 0  # copy-on-write copies made, a metric the article asks engines to expose

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
        _, n_kv_head, block_size, head_dim = self.key_cache[0].shape
        return int(page_bytes(block_size=block_size, n_layer=self.n_layer, n_kv_head=n_kv_head, head_dim=head_dim,
                              dtype=dtype_name(self.key_cache[0].dtype)))

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
        self._check(seq_id, blocks_needed(num_tokens, self.block_size))
        table = self._take_free_blocks(blocks_needed(num_tokens, self.block_size))
        self.block_tables[seq_id] = table
        self.num_tokens[seq_id] = num_tokens
        return list(table)

    def attach(self, seq_id: int, computed_blocks: list[KVCacheBlock]) -> None:
        """A new sequence whose first tokens are already cached: it starts with ``computed_blocks`` (full blocks
        a prefix hit found, ref_cnt + 1 each, so they leave the free queue) and grows with ``append_slots``."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        self.pool.touch(computed_blocks)
        self.block_tables[seq_id] = [b.block_id for b in computed_blocks]
        self.num_tokens[seq_id] = len(computed_blocks) * self.block_size

    def blocks_to_append(self, seq_id: int, n_new: int = 1) -> int:
        """Free blocks the next ``append_slots(n_new)`` will take: new blocks past the tail, plus 1 when the tail
        is partial and shared (its copy)."""
        n = self.num_tokens[seq_id]
        table = self.block_tables[seq_id]
        cow = 1 if n % self.block_size and self.blocks[table[-1]].ref_cnt > 1 else 0
        return blocks_needed(n + n_new, self.block_size) - len(table) + cow

    def append_slots(self, seq_id: int, n_new: int) -> None:
        """Reserve the slots of the sequence's next ``n_new`` tokens (vLLM's allocate_slots).

        A tail shared with a fork is copied first (copy-on-write): only that one block, and only its written
        slots; the full blocks before it stay shared. Then new blocks for whatever does not fit.
        """
        table = self.block_tables[seq_id]
        n = self.num_tokens[seq_id]
        offset = n % self.block_size
        self._check(seq_id, self.blocks_to_append(seq_id, n_new))
        if offset and self.blocks[table[-1]].ref_cnt > 1:
            old = table[-1]
            (new,) = self._take_free_blocks(1)
            for layer in range(self.n_layer):
                self.key_cache[layer][new, :, :offset] = self.key_cache[layer][old, :, :offset]
                self.value_cache[layer][new, :, :offset] = self.value_cache[layer][old, :, :offset]
            self.pool.free_blocks([self.blocks[old]])
            table[-1] = new
            self.cow_copies += 1
        table += self._take_free_blocks(blocks_needed(n + n_new, self.block_size) - len(table))
        self.num_tokens[seq_id] = n + n_new

    def append_slot(self, seq_id: int) -> tuple[int, int]:
        """Reserve the slot of the sequence's next token; returns (physical block id, offset in block)."""
        self.append_slots(seq_id, 1)
        return self.slot(seq_id, self.num_tokens[seq_id] - 1)

    def fork(self, parent_id: int, child_id: int) -> list[int]:
        """The child shares every block of the parent (ref_cnt + 1 each); nothing is copied yet."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        table = list(self.block_tables[parent_id])
        self.pool.touch(self.blocks[b] for b in table)
        self.block_tables[child_id] = table
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        return list(table)

    def free(self, seq_id: int) -> list[int]:
        """Finish or cancel: drop the sequence's references, tail first. Returns the blocks now free."""
        table = self.block_tables.pop(seq_id)
        del self.num_tokens[seq_id]
        self.pool.free_blocks(self.blocks[b] for b in reversed(table))
        return [b for b in reversed(table) if self.blocks[b].ref_cnt == 0]

    # --- K/V through the block table -----------------------------------------------------------------
    def slot(self, seq_id: int, position: int) -> tuple[int, int]:
        """Logical token position -> (physical block id, offset)."""
        if not 0 <= position < self.num_tokens[seq_id]:
            raise IndexError(f"position {position} outside sequence {seq_id}")
        return self.block_tables[seq_id][position // self.block_size], position % self.block_size

    def write_kv(self, seq_id: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of tokens ``start .. start+T-1`` (k, v: (H_kv, T, Dh)) into their slots."""
        slots = [self.slot(seq_id, start + t) for t in range(k.shape[1])]
        for block_id in {b for b, _ in slots}:
            if self.blocks[block_id].ref_cnt != 1:
                # Writing a shared block would change another sequence's history: refuse, never corrupt.
                raise RuntimeError(f"block {block_id} is shared (ref_cnt {self.blocks[block_id].ref_cnt})")
        block_ids = torch.tensor([b for b, _ in slots])  # (T,)
        offsets = torch.tensor([o for _, o in slots])  # (T,)
        dtype = self.key_cache[layer].dtype
        self.key_cache[layer][block_ids, :, offsets] = k.transpose(0, 1).to(dtype)  # (T, H_kv, Dh) into T slots
        self.value_cache[layer][block_ids, :, offsets] = v.transpose(0, 1).to(dtype)

    def gather_kv(self, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's K and V in logical order: (H_kv, T, Dh) each, read block by block."""
        table = torch.tensor(self.block_tables[seq_id])
        n = self.num_tokens[seq_id]
        k = self.key_cache[layer][table]  # (n_blocks, H, block_size, Dh)
        v = self.value_cache[layer][table]
        nb, h, bs, d = k.shape
        k = k.transpose(0, 1).reshape(h, nb * bs, d)[:, :n]  # (H, T, Dh)
        v = v.transpose(0, 1).reshape(h, nb * bs, d)[:, :n]
        return k, v
