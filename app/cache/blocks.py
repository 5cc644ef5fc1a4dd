"""Blocks of KV cache and the pool that owns them, with vLLM's nouns and rules.

A request's tokens are cut into fixed-size blocks. Only a *full* block gets a hash, and each hash is
chained to the previous block's hash, so a block's key names its whole prefix, not just its own tokens::

    tokens   | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 |        block_size = 4
    hash     |     h0      |     h1      |  --  |        the partial tail block has no hash
    h0 = H(NONE_HASH, (t0..t3), extra_keys)              extra keys: model identity, cache salt
    h1 = H(h0,        (t4..t7), None)                    later blocks inherit them through h0

So the same four tokens after a different prefix get a different key, and another model or another
salt changes h0 and with it every later hash (vLLM: ``kv_cache_utils.hash_block_tokens``; the salt goes
on the first block only, the chain carries it on).

``BlockPool`` owns ``num_blocks`` ``KVCacheBlock`` objects (just bookkeeping: the K/V tensors live in
whatever storage the caller indexes by ``block_id``). Invariants:

* ``ref_cnt`` counts the running requests that use a block. A block with ``ref_cnt == 0`` sits in the
  free queue. If it still has a hash it is *evictable*: a later request can hit it and take it back.
* The free queue is ordered by eviction priority: new blocks are taken from its front (least recently
  freed first), freed blocks are appended at its back. Taking a block that still has a hash evicts it
  (its hash leaves ``cached_block_hash_to_block``).
* Callers free a finished request's blocks in *reverse* order, so its tail is appended first and is
  evicted first; its first blocks (the prefix most likely shared) survive longest.

Only the code that owns a pool mutates it; nothing here locks (hold your own lock around a pool).

Two implementations of the one pool, held to the same property tests (tests/cache/test_block_pool.py)::

    BlockPool        a block is a ``KVCacheBlock`` object        the prefix lab (caching on), the paged lab (off)
    ArrayBlockPool   a block is its id; ref counts, hashes and   the capacity simulator (millions of
                     the free queue are plain arrays             allocations, no K/V behind them)

Both hand out blocks in the same order, evict the same blocks and find the same hits for the same calls.
With ``enable_caching=False`` no hash is ever registered, so the pool is a plain FIFO of free blocks.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence, Sized
from dataclasses import dataclass
from itertools import islice
from typing import Any

BlockHash = str  # hex sha256

# The parent hash of a request's first block (vLLM seeds it per process; ours is fixed so keys are
# reproducible across restarts and in tests).
NONE_HASH: BlockHash = hashlib.sha256(b"kvscope:none-hash").hexdigest()


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): the blocks ``num_tokens`` token slots occupy (the last one maybe partial)."""
    return -(-num_tokens // block_size)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """Key of one full block: sha256 over (parent hash, the block's token ids, extra keys)."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    payload = repr((parent, tuple(int(t) for t in token_ids), extra_keys))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def fast_block_hash(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> int:
    """Key of one full block by Python's own tuple hash of (parent key, the block's token ids, extra keys): 64 bits,
    the same in every process for int tokens (only str and bytes hashes are salted), a tenth of sha256's cost. For
    a run with no tenants to keep apart (the capacity simulator), as vLLM offers ``xxhash`` beside sha256."""
    return hash((0 if parent_hash is None else parent_hash, tuple(token_ids), extra_keys or ()))


def block_extra_keys(model_id: str, cache_salt: str | None) -> tuple:
    """Extra keys of a request's first block: which model made the K/V, and the optional per-user salt.

    K/V of one model are meaningless for another, and a salt keeps one tenant's cached prompt from
    being found (and timed) by another tenant who guesses it.
    """
    return (("model", model_id), ("salt", cache_salt or None))


def hash_request_tokens(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple | None = None,
    hash_block: Callable[[Any, Sequence[int], tuple | None], Any] = hash_block_tokens,
) -> list:
    """Chained hashes of every *full* block of ``token_ids`` (the partial tail is not hashed).

    ``hash_block(parent or None, block token ids, extra keys)`` keys one block: KVScope's own
    (``hash_block_tokens``) by default; the Engine page passes vLLM's recipe (``app/engine/hashing.py``), so the
    one chain serves both."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    hashes: list = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys if start == 0 else None)
        hashes.append(parent)
    return hashes


def group_block_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """A block's key in KV-cache group ``group`` (vLLM's ``make_block_hash_with_group_id``): the same tokens cached
    by two groups are two blocks (each holds its own layers' K/V). Group 0 keeps the plain hash, so a one-group cache
    reads as before."""
    return block_hash if group == 0 else f"{block_hash}+{group}"


def hybrid_cache_hit(pool, group_keys: Sequence[Sequence[Hashable]], specs: Sequence, block_size: int) -> list[list]:
    """The longest prefix cached in *every* KV-cache group (vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``).

    ``group_keys[g]``: group g's keys of the request's full blocks (at most as many as may be hit), ``specs[g]`` its
    spec. A full-attention group hits the leading run of its blocks. A sliding-window group needs only the blocks
    that cover the window of the first token it will compute, ``ceil((W - 1) / block_size)`` contiguous cached blocks
    ending where the hit ends, found from the right (vLLM's ``SlidingWindowManager``); the blocks before them are
    ``None`` (null blocks: never read again). Each group may shorten the hit, so the groups are asked again until all
    agree; the answer is one list per group, all of one length::

        window 8, blocks of 4, hit of 5 blocks:   full group  [b0, b1, b2, b3, b4]
                                                  sliding     [None, None, None, b3', b4']    (2 blocks cover 7 tokens)
    """
    n = min((len(k) for k in group_keys), default=0)
    get = pool.get_cached_block
    while True:
        hits = []
        for keys, spec in zip(group_keys, specs, strict=True):
            window = spec.sliding_window
            if window is None:
                run = []
                for key in keys[:n]:
                    block = get(key)
                    if block is None:
                        break
                    run.append(block)
            else:
                run = _sliding_hit(get, keys[:n], -(-(window - 1) // block_size))
            hits.append(run)
        shortest = min(len(h) for h in hits) if hits else 0
        if shortest == n:
            return hits
        n = shortest


def _sliding_hit(get, keys: Sequence[Hashable], contiguous: int) -> list:
    """The longest prefix whose last ``contiguous`` blocks are all cached (None before them); or, when no run that long
    exists, the cached blocks at the very start."""
    out: list = [None] * len(keys)
    if contiguous == 0:  # a window of one token reads no earlier block
        return out
    run = 0
    for i in range(len(keys) - 1, -1, -1):
        block = get(keys[i])
        if block is None:
            run = 0
            continue
        out[i] = block
        run += 1
        if run >= contiguous:
            return out[: i + run]
    return out[:run]


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block: its id is its slot in the K/V storage."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and its K/V written

    def __repr__(self) -> str:
        h = self.block_hash[:8] if self.block_hash else None
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={h})"


class FreeKVCacheBlockQueue:
    """The blocks no running request holds, in eviction order (front = evicted next).

    vLLM uses a hand-made doubly linked list so that a block hit by a new request can leave the
    middle of the queue in O(1). An ``OrderedDict`` keyed by ``block_id`` gives the same three O(1)
    operations (pop front, append back, remove anywhere) with less code.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._q: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._q

    def popleft(self) -> KVCacheBlock:
        return self._q.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        self._q[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        del self._q[block.block_id]

    def blocks(self) -> list[KVCacheBlock]:
        """Front (next to evict) to back."""
        return list(self._q.values())


class NoFreeBlocks(RuntimeError):
    """The pool cannot hand out that many blocks: every block is held by a running request."""


class _PoolCounts(ABC):
    """The counts both layouts derive the same way from ``num_blocks``, the free queue and ``eviction_order``."""

    num_blocks: int
    free_block_queue: Sized

    @abstractmethod
    def eviction_order(self) -> list:
        """Free blocks in the order they would be taken (and, if they still have a hash, evicted)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request could take: never used, or evictable."""
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_queue)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.eviction_order())


class BlockPool(_PoolCounts):
    """Owns the blocks, the free queue and the map ``block_hash -> block`` of reusable blocks."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("a pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue: FreeKVCacheBlockQueue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    # --- lookup ----------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash) if self.enable_caching else None

    def find_longest_cache_hit(
        self, block_hashes: Iterable[BlockHash], max_blocks: int | None = None
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest run of leading hashes; stops at the first miss."""
        hits: list[KVCacheBlock] = []
        for h in islice(block_hashes, max_blocks):
            block = self.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # --- reference counting ----------------------------------------------------------------------
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request starts using cached blocks: an evictable block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block in self.free_block_queue:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting any cached content they hold."""
        if n > len(self.free_block_queue):
            raise NoFreeBlocks(f"{n} blocks needed, {len(self.free_block_queue)} free or evictable")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block whose K/V are written. If another block already holds this hash
        (two requests computed the same prefix at once) the first one stays the cached copy."""
        if not self.enable_caching or block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the order given (pass a request's blocks reversed,
        so its tail reaches the free queue first and is evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if any(b.ref_cnt for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    # --- counts ----------------------------------------------------------------------------------
    def eviction_order(self) -> list[KVCacheBlock]:
        """Evictable blocks, the next one to be evicted first."""
        return [b for b in self.free_block_queue.blocks() if b.block_hash is not None]


class ArrayBlockPool(_PoolCounts):
    """``BlockPool`` over plain arrays: a block is its ``block_id``, and a hash is any hashable key.

    Same nouns, same methods, same order of hand-out and eviction as ``BlockPool``; the state is laid out
    for a loop that allocates millions of times without a model behind it::

        ref_cnt[block_id]              int        running requests holding the block
        block_hash[block_id]           key|None   set by cache_full_block, cleared when the block is evicted
        cached_block_hash_to_block     key -> block_id
        free_block_queue               OrderedDict block_id -> None, front = evicted next

    The free queue is an ``OrderedDict`` for the reason ``FreeKVCacheBlockQueue`` wraps one: a hit on a
    freed block pulls it out of the middle in O(1).
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("a pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        self.cached_block_hash_to_block: dict[Hashable, int] = {}
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0

    # --- lookup ----------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: Hashable) -> int | None:
        return self.cached_block_hash_to_block.get(block_hash) if self.enable_caching else None

    def find_longest_cache_hit(self, block_hashes: Iterable[Hashable], max_blocks: int | None = None) -> list[int]:
        """The cached blocks of the longest run of leading hashes; stops at the first miss."""
        if not self.enable_caching:
            return []
        get = self.cached_block_hash_to_block.get
        hits: list[int] = []
        for h in islice(block_hashes, max_blocks):
            block = get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # --- reference counting ----------------------------------------------------------------------
    def touch(self, blocks: Iterable[int]) -> None:
        """A request starts using cached blocks: an evictable block leaves the free queue."""
        ref, free = self.ref_cnt, self.free_block_queue
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, evicting any cached content they hold."""
        free = self.free_block_queue
        if n > len(free):
            raise NoFreeBlocks(f"{n} blocks needed, {len(free)} free or evictable")
        ref, block_hash, popitem = self.ref_cnt, self.block_hash, free.popitem
        out = []
        for _ in range(n):
            b = popitem(last=False)[0]
            h = block_hash[b]
            if h is not None:  # the block's cached content is evicted
                if self.cached_block_hash_to_block.get(h) == b:
                    del self.cached_block_hash_to_block[h]
                block_hash[b] = None
                self.num_evictions += 1
            ref[b] = 1
            out.append(b)
        return out

    def cache_full_block(self, block: int, block_hash: Hashable) -> bool:
        """Register a full block; the first block registered under a hash stays the cached copy."""
        cached = self.cached_block_hash_to_block
        if not self.enable_caching or block_hash in cached:
            return False
        cached[block_hash] = block
        self.block_hash[block] = block_hash
        return True

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given (a request's blocks reversed: tail first)."""
        ref, free = self.ref_cnt, self.free_block_queue
        for b in ordered_blocks:
            r = ref[b] - 1
            if r < 0:
                raise ValueError(f"block {b} freed more often than taken")
            ref[b] = r
            if not r:
                free[b] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if any(self.ref_cnt):
            return False
        self.block_hash[:] = [None] * self.num_blocks
        self.cached_block_hash_to_block.clear()
        return True

    # --- counts ----------------------------------------------------------------------------------
    def eviction_order(self) -> list[int]:
        """Evictable blocks, the next one to be evicted first."""
        return [b for b in self.free_block_queue if self.block_hash[b] is not None]
