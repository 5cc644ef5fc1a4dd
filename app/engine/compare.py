"""KVScope's own block pool run on the requests an engine was sent, and held against what the engine reported.

The prediction is vLLM's rule on ``app/cache/blocks.py``'s pool (``ArrayBlockPool``: ``BlockPool``'s decisions,
keyed by any hashable, here the engine's integer ids) with the engine's block size, block count and hash
(``app/engine/hashing.py``), one request after the other (each finished before the next)::

    hashes = the chained hashes of the prompt's full blocks
    hits   = the longest run of leading cached hashes, at most (n - 1) // block_size blocks (one token is
             always computed: its logits choose the next token)
    new    = blocks_needed(n) - hits blocks taken from the free queue (evicting what they held)
    stored = the full blocks among them, cached under their hashes        -> BlockStored events
    free   = every block loses its reference, tail first                  -> evictable, still cached

The pool starts with the blocks the engine already holds (its mirror, oldest first), so a run compares from the
engine's real state. Observed per request: the hashes its ``BlockStored`` events carried, the blocks its
``BlockRemoved`` events took, and its ``/metrics`` deltas (prefix-cache queries and hits, in tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.cache.blocks import ArrayBlockPool, blocks_needed
from app.engine.hashing import VllmBlockHasher


@dataclass
class Predicted:
    num_tokens: int
    hashes: list[int]
    hit_blocks: int
    stored: list[int]  # hashes newly cached, in order
    evicted: int
    block_size: int

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size


@dataclass
class Observed:
    stored: list[int] = field(default_factory=list)
    removed: int = 0
    queries: float = 0.0  # tokens (Δ vllm:prefix_cache_queries_total)
    hits: float = 0.0  # tokens (Δ vllm:prefix_cache_hits_total)


class Predictor:
    """KVScope's own engine for one run: a block pool shaped like the engine's, hashed like the engine."""

    def __init__(self, *, num_blocks: int, block_size: int, seed: str | None = None,
                 held: tuple[int, ...] = ()) -> None:
        self.block_size = block_size
        self.hasher = VllmBlockHasher(seed)
        self.pool = ArrayBlockPool(num_blocks, enable_caching=True)
        for h in held[-num_blocks:]:  # what the engine holds now, as cached free blocks, oldest first
            (block,) = self.pool.get_new_blocks(1)
            self.pool.cache_full_block(block, h)
            self.pool.free_blocks([block])
        self.pool.num_evictions = 0

    def run(self, token_ids: list[int]) -> Predicted:
        bs, n = self.block_size, len(token_ids)
        hashes = self.hasher.request(token_ids, bs)
        hits = self.pool.find_longest_cache_hit(hashes, max_blocks=(n - 1) // bs)
        self.pool.touch(hits)
        before = self.pool.num_evictions
        new = self.pool.get_new_blocks(blocks_needed(n, bs) - len(hits))
        blocks = hits + new
        stored = [h for block, h in zip(blocks[len(hits):], hashes[len(hits):], strict=False)
                  if self.pool.cache_full_block(block, h)]
        self.pool.free_blocks(reversed(blocks))
        return Predicted(num_tokens=n, hashes=hashes, hit_blocks=len(hits), stored=stored,
                         evicted=self.pool.num_evictions - before, block_size=bs)


def first_difference(i: int, p: Predicted, o: Observed) -> tuple[str, dict] | None:
    """The first way request ``i`` differs (a catalog key and its parameters), or None when all agree."""
    for j, (a, b) in enumerate(zip(p.stored, o.stored, strict=False)):
        if a != b:
            return "engine.diff.hash", {"request": i + 1, "block": p.hashes.index(a) + 1 if a in p.hashes else j + 1,
                                        "ours": f"{a:016x}", "theirs": f"{b:016x}"}
    if len(p.stored) != len(o.stored):
        return "engine.diff.stored", {"request": i + 1, "ours": len(p.stored), "theirs": len(o.stored)}
    if p.hit_tokens != o.hits:
        return "engine.diff.hits", {"request": i + 1, "ours": p.hit_tokens, "theirs": int(o.hits)}
    if p.num_tokens != o.queries:
        return "engine.diff.queries", {"request": i + 1, "ours": p.num_tokens, "theirs": int(o.queries)}
    if p.evicted != o.removed:
        return "engine.diff.evicted", {"request": i + 1, "ours": p.evicted, "theirs": o.removed}
    return None
