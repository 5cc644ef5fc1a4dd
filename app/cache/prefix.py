"""Prefix caching over the model's real K/V tensors.

``PrefixCache`` keeps K/V in a ``PagedKVCache`` (the paged lab's store) whose ``BlockPool`` has prefix
caching on, so the pool also says which block holds which prefix. Its KV-cache groups are the model's
(``app/cache/spec.py``); a block is cached per group (``group_block_hash``), and a hit needs every group's blocks, as
vLLM's hybrid KV cache manager finds it (``hybrid_cache_hit``): the longest prefix whose full blocks a full-attention
group has, and whose last window's blocks a sliding-window group has (the blocks before them are never read again).
One request goes through vLLM's three steps::

    get_computed_blocks   the longest prefix of full blocks whose chained hashes every group has cached -> hits
    allocate_slots        attach the hits to a new sequence (ref_cnt += 1), take new blocks for the rest
    prefill               ``forward_through`` the sequence's ``PagedSeqStore``: only the tokens after the
                          hits run; attention reads the hits' K/V through the block table, the new K/V are
                          written into the new blocks; then each new *full* block of every group is registered
                          under its hash (the partial tail block is never shared), and only then does a
                          sliding-window group give back the blocks outside its window: still cached, evictable,
                          as vLLM's are

and later ``free`` (finished or cancelled): every block loses one reference, tail first, so the
request's last blocks are evicted before its first ones.

At least one token is always computed (its logits are the next-token prediction), so a prompt that is
entirely cached still recomputes its last block, as in vLLM.

The prefix-cache lab (``app/labs/prefix.py``) keeps one ``PrefixCache`` per browser, with its request records, and
picks the prompts (``PRESETS``, ``timestamp_prompts``) and block sizes (``auto_block_size``, ``blocks_for_run``)
from here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from app import kv_bytes
from app.cache import spec as kv_spec
from app.cache.blocks import (
    BlockHash,
    BlockPool,
    KVCacheBlock,
    block_extra_keys,
    blocks_needed,
    group_block_hash,
    hash_request_tokens,
    hybrid_cache_hit,
)
from app.cache.paged import NULL_BLOCK, PagedKVCache
from app.cache.store import FloatKVStore, PagedSeqStore
from app.errors import BadInput
from app.model.loading import LoadedModel

DEFAULT_BLOCK_SIZE = 16
BLOCK_SIZES = (4, 8, 16, 32)
# "auto" block size: the largest size that still gives the shortest prompt this many full blocks.
AUTO_MIN_FULL_BLOCKS = 4


@dataclass
class PrefixRequest:
    """One prefill through the prefix cache, with what it reused and what it measured."""

    request_id: int
    group: str
    text: str
    token_ids: list[int]
    salt: str | None
    block_size: int
    block_hashes: list[BlockHash]  # one per full block
    blocks: list[KVCacheBlock]  # every block the request holds in the first group, the partial tail included
    block_ids: list[int]  # snapshot of blocks' ids (blocks may be reused by others after eviction)
    num_hit_blocks: int  # blocks of prefix reused: the same number of token positions in every group
    group_hit_blocks: list[int] = field(default_factory=list)  # per KV-cache group: cached blocks it read (a
    #                                         sliding window reads only those of its last window, the rest are null)
    status: str = "running"  # running | finished | cancelled
    prefill_ms_reuse: float = 0.0  # forward of the uncached tokens, reading the hits through the block table
    prefill_ms_full: float = 0.0  # forward of every token, from an empty contiguous cache
    max_abs_diff: float = 0.0  # logits of the computed positions, reuse vs from scratch
    next_token_reuse: int = -1
    next_token_full: int = -1
    newly_cached: list[bool] = field(default_factory=list)  # per full block: registered by this request

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_hit_tokens(self) -> int:
        return self.num_hit_blocks * self.block_size

    @property
    def num_computed_tokens(self) -> int:
        return self.num_tokens - self.num_hit_tokens


class PrefixCache:
    """A paged K/V store with prefix caching on, for one model and one block size. A request is a sequence
    of the store, its id the request id.

    Storage layout (L layers, H_kv heads, Dh head width, bs block size, G layers per KV-cache group: G = L when
    all layers are alike)::

        kv.key_cache[layer][block_id]   (H_kv, bs, Dh)      value_cache likewise
        page bytes per block = 2 · G · H_kv · bs · Dh · dtype bytes
    """

    def __init__(self, lm: LoadedModel, *, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        a = lm.adapter
        self.lm = lm
        self.block_size = block_size
        self.kv = PagedKVCache(num_blocks=num_blocks, block_size=block_size, n_layer=a.n_layer, n_kv_head=a.n_kv_head,
                               head_dim=a.head_dim, dtype=a.dtype, enable_caching=True,
                               specs=kv_spec.from_adapter(a))

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    @torch.no_grad()
    def warm_up(self) -> None:
        """One untimed forward, so the first measured request does not pay torch's first-call costs."""
        self.lm.adapter.forward_through(FloatKVStore(self.lm.adapter.n_layer), [0, 0])

    @staticmethod
    def page_bytes_for(lm: LoadedModel, block_size: int) -> int:
        """One block: the layers of one KV-cache group (every layer when all are alike), from their specs."""
        a = lm.adapter
        groups = kv_spec.kv_cache_groups(kv_spec.from_adapter(a))
        return int(kv_spec.block_bytes(groups, block_size, kv_bytes.dtype_name(a.dtype)))

    @property
    def page_bytes(self) -> int:
        return self.page_bytes_for(self.lm, self.block_size)

    def extra_keys(self, salt: str | None) -> tuple:
        return block_extra_keys(self.lm.name, salt)

    # --- step 1: get_computed_blocks -------------------------------------------------------------
    def get_computed_blocks(self, token_ids: list[int],
                            salt: str | None) -> tuple[list[BlockHash], list[list[KVCacheBlock | None]]]:
        """The request's block hashes, and per KV-cache group the blocks of the longest prefix every group has
        cached (None where a window does not need the block; all lists of one length)."""
        hashes = hash_request_tokens(token_ids, self.block_size, self.extra_keys(salt))
        max_hit_blocks = (len(token_ids) - 1) // self.block_size  # keep >= 1 token to compute
        keys = hashes[:max_hit_blocks]
        groups = self.kv.groups
        group_keys = [[group_block_hash(h, g) for h in keys] for g in range(len(groups))]
        return hashes, hybrid_cache_hit(self.pool, group_keys, [g.spec for g in groups], self.block_size)

    # --- step 2 + 3: allocate and prefill --------------------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: list[int], *, request_id: int, group: str = "", text: str = "",
                salt: str | None = None) -> PrefixRequest:
        bs = self.block_size
        hashes, hits = self.get_computed_blocks(token_ids, salt)
        n_blocks = len(hits[0])
        n_hit = n_blocks * bs
        # Every group takes its own blocks for the rest; a null entry needs none.
        need = len(hits) * blocks_needed(len(token_ids), bs) - sum(len(h) for h in hits)
        evictable = sum(1 for h in hits for b in h if b is not None and b.ref_cnt == 0)  # taken back from the queue
        free = self.pool.num_free_blocks - evictable
        if need > free:
            raise BadInput("err.prefix.full", need=need, free=free)
        # Attach the hits before allocating, so they cannot be evicted by this request's own allocation.
        self.kv.attach(request_id, hits)
        req = PrefixRequest(request_id=request_id, group=group, text=text, token_ids=list(token_ids), salt=salt,
                            block_size=bs, block_hashes=hashes, blocks=[b for b in hits[0] if b is not None],
                            block_ids=[], num_hit_blocks=n_blocks,
                            group_hit_blocks=[sum(b is not None for b in h) for h in hits])
        try:
            t0 = time.perf_counter()
            # The window's outside is given back only after the hashes are registered (below).
            store = PagedSeqStore(self.kv, request_id, free_skipped=False)
            logits = self.lm.adapter.forward_through(store, req.token_ids[n_hit:])
            req.prefill_ms_reuse = (time.perf_counter() - t0) * 1000  # (T_new, V) logits, hits read in place
            req.block_ids = list(self.kv.block_tables[request_id])
            req.blocks = [self.pool.blocks[i] for i in req.block_ids if i != NULL_BLOCK]
            self._compare_with_full(req, logits, n_hit)
        except BaseException:
            # Cancelled mid-prefill: nothing half-written may become findable, so no hash is registered.
            self.free(req, reason="cancelled")
            raise
        tables = self.kv.seq_tables(request_id)
        req.newly_cached = [False] * n_blocks
        for i in range(n_blocks, len(hashes)):
            cached = [self.pool.cache_full_block(self.pool.blocks[t[i]], group_block_hash(hashes[i], g))
                      for g, t in enumerate(tables) if t[i] != NULL_BLOCK]
            req.newly_cached.append(bool(cached) and cached[0])
        self.kv.remove_skipped_blocks(request_id)  # freed, still cached: a later hit may take them back
        return req

    def _compare_with_full(self, req: PrefixRequest, logits: torch.Tensor, n_hit: int) -> None:
        """Every token again, through a fresh contiguous store: the same arithmetic, without the reused blocks."""
        t0 = time.perf_counter()
        full = self.lm.adapter.forward_through(FloatKVStore(self.lm.adapter.n_layer), req.token_ids)  # (T, V)
        req.prefill_ms_full = (time.perf_counter() - t0) * 1000
        ref = full[n_hit:]  # (T_new, V)
        req.max_abs_diff = float((logits - ref).abs().max())
        req.next_token_reuse = int(logits[-1].argmax())
        req.next_token_full = int(ref[-1].argmax())

    # --- free ------------------------------------------------------------------------------------
    def free(self, req: PrefixRequest, *, reason: str = "finished") -> None:
        """Release a request's blocks, tail first. Safe to call twice."""
        if req.status != "running":
            return
        if req.request_id in self.kv.block_tables:
            self.kv.free(req.request_id)
        req.status = reason

    def is_cached(self, block_hash: BlockHash, block_id: int) -> bool:
        block = self.pool.cached_block_hash_to_block.get(block_hash)
        return block is not None and block.block_id == block_id


# --- the lab ---------------------------------------------------------------------------------------

_SYSTEM = "you are a kind helper. answer in one short line and keep it plain."
_QUESTION = "\nuser. what does a cache keep.\n"
_TIMES = ("one", "two", "nine")
_TURN1 = "user. what is a cache.\nai. it keeps old keys.\n"
_TURN2 = _TURN1 + "user. why keep them.\nai. to save time.\n"
_TURN3 = _TURN2 + "user. and values.\nai. those too.\n"

# The presets use only lowercase letters, spaces, full stops and newlines and stay under 128
# characters, so they fit the built-in character-level model (128 positions, a ~25-character
# vocabulary without digits, capitals or colons) as well as GPT-2's tokenizer. Hence "time now is
# one past ten." for the "Current time: 10:01" anti-pattern.
# name -> list of (group, prompt). Groups are compared side by side in the stats.
PRESETS: dict[str, list[tuple[str, str]]] = {
    "system": [
        ("system", f"{_SYSTEM}\nuser. {q}\n")
        for q in ("what does a cache keep.", "why are old keys kept.", "is a query cached too.")
    ],
    "chat": [("chat", t) for t in (_TURN1, _TURN2, _TURN3)],
}


def scaled_presets(scale: int, run_index: int = 0) -> dict[str, list[tuple[str, str]]]:
    """The presets with their shared parts said ``scale`` times: the same lessons (one shared system prompt, a
    chat growing turn by turn, the clock that breaks sharing at the start and not at the end), long enough for a
    real engine's 32-token blocks (the Engine page). ``scale`` 1 gives ``PRESETS`` itself."""
    system = " ".join([_SYSTEM] * scale)
    turns = [_TURN1, _TURN2[len(_TURN1):], _TURN3[len(_TURN2):]]
    chat, grown = [], ""
    for turn in turns:
        grown += turn * scale
        chat.append(("chat", grown))
    hour = _HOURS[run_index % len(_HOURS)]
    times = [f"{_MINUTES[(3 * run_index + j) % len(_MINUTES)]} past {hour}" for j in range(3)]
    return {
        "system": [("system", f"{system}\nuser. {q}\n")
                   for q in ("what does a cache keep.", "why are old keys kept.", "is a query cached too.")],
        "chat": chat,
        "timestamp": [("time at start", f"time now is {t}. {system}{_QUESTION}") for t in times]
        + [("time at end", f"{system} time now is {t}.{_QUESTION}") for t in times],
    }


# A clock the tiny vocabulary can spell. Every run of the timestamp preset reads the clock anew, as a
# server stamping "Current time: ..." into each request would: run k says "<minute> past <hour>".
_HOURS = ("ten", "one", "two", "three", "seven", "eight", "nine")
_MINUTES = ("one", "two", "nine", "three", "seven", "eight", "ten")


def timestamp_prompts(run_index: int = 0) -> list[tuple[str, str]]:
    hour = _HOURS[run_index % len(_HOURS)]
    times = [f"{_MINUTES[(3 * run_index + j) % len(_MINUTES)]} past {hour}" for j in range(3)]
    return [("time at start", f"time now is {t}. {_SYSTEM}{_QUESTION}") for t in times] + [
        ("time at end", f"{_SYSTEM} time now is {t}.{_QUESTION}") for t in times]


PRESETS["timestamp"] = timestamp_prompts(0)



def auto_block_size(token_counts: list[int]) -> int:
    """Largest of 16, 8, 4 that gives the shortest prompt at least ``AUTO_MIN_FULL_BLOCKS`` full blocks
    (16 for the character-level model's ~100-token presets, 4 for the same text in GPT-2 BPE)."""
    shortest = min(token_counts) if token_counts else 0
    for size in (16, 8, 4):
        if shortest // size >= AUTO_MIN_FULL_BLOCKS:
            return size
    return 4


def blocks_for_run(encoded: list[list[int]], block_size: int, salt: str | None = None) -> int:
    """Blocks the requests of one run hold at once in one full-attention KV-cache group: full blocks with the same
    prefix are shared (one block each), every partial tail block is its own. A sliding-window group holds no more, so
    the run needs at most this many times the number of groups."""
    full: set[tuple] = set()
    tails = 0
    for ids in encoded:
        n_full = len(ids) // block_size
        full.update((salt, tuple(ids[: (b + 1) * block_size])) for b in range(n_full))
        tails += len(ids) % block_size > 0
    return len(full) + tails
