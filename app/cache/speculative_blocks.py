"""The speculative lab's KV caches counted in paged blocks: what each round writes and what its rollback frees.

A ``BlockLedger`` watches one runner's cache (``app.model.speculative.Runner.watch``) and mirrors its length in a
block table drawn from a ``BlockPool`` (``app.cache.blocks``, caching off: a plain FIFO of free blocks), the way a
paged server would hold the same tokens::

    round start   table [ 0 1 2 ]          length 10, block_size 4: blocks_needed(10) = 3 blocks
    verify        table [ 0 1 2 3 4 ]      +γ = 4 drafts -> length 14... 18: new blocks taken from the free queue
    rollback      table [ 0 1 2 3 ]        2 drafts rejected -> length 16: blocks_needed(16) = 4; block 4 is freed
                                           (back to the queue's tail); the slots past 16 in block 3 are free again

The ledger only keeps ids; the K/V stay in the runner's own cache. ``snapshot`` describes the round just ended:
the table at its longest (before the crop), the blocks the crop freed, the table after, the pool's counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.cache.blocks import BlockPool, KVCacheBlock, blocks_needed


@dataclass
class BlockLedger:
    pool: BlockPool
    block_size: int
    table: list[KVCacheBlock] = field(default_factory=list)
    length: int = 0
    peak: list[int] = field(default_factory=list)  # block ids before the latest crop
    peak_length: int = 0
    freed: list[int] = field(default_factory=list)  # ids the latest crop returned to the pool
    free_at_peak: int = 0

    @classmethod
    def for_tokens(cls, max_tokens: int, block_size: int) -> BlockLedger:
        """A pool just large enough for one sequence of ``max_tokens`` tokens."""
        return cls(BlockPool(max(1, blocks_needed(max_tokens, block_size)), enable_caching=False), block_size)

    def __call__(self, before: int, after: int) -> None:
        assert before == self.length, (before, self.length)
        if after >= before:
            self.table += self.pool.get_new_blocks(blocks_needed(after, self.block_size) - len(self.table))
        else:
            self.peak, self.peak_length = self.ids, before
            self.free_at_peak = self.pool.num_free_blocks
            keep = blocks_needed(after, self.block_size)
            gone = self.table[keep:]
            self.table = self.table[:keep]
            self.pool.free_blocks(reversed(gone))  # the tail first, as a finished request's blocks are freed
            self.freed = [b.block_id for b in gone]
        self.length = after

    def crop_marker(self) -> None:
        """A rollback that removed nothing: the round's peak is the table as it stands."""
        self.peak, self.peak_length, self.freed = self.ids, self.length, []
        self.free_at_peak = self.pool.num_free_blocks

    @property
    def ids(self) -> list[int]:
        return [b.block_id for b in self.table]

    def snapshot(self, start: int) -> dict:
        """The round that began at cache length ``start`` and ended with the latest rollback, as plain data."""
        return {"start": start, "peak_length": self.peak_length, "length": self.length,
                "peak": list(self.peak), "table": self.ids, "freed": list(self.freed),
                "taken": self.peak[blocks_needed(start, self.block_size):],
                "free_at_peak": self.free_at_peak, "free": self.pool.num_free_blocks,
                "num_blocks": self.pool.num_blocks, "block_size": self.block_size}


def watch(ledger: BlockLedger):
    """``Runner.watch`` for ``ledger``: a rollback that removes nothing still marks the end of the round."""

    def told(before: int, after: int) -> None:
        if before == after:  # only a rollback leaves the length as it was (a forward feeds at least one token)
            ledger.crop_marker()
        else:
            ledger(before, after)

    return told


def slots(snap: dict) -> list[dict]:
    """Each block of the round's longest table with the state of its slots: ``old`` (held before the round),
    ``kept`` (written this round and kept), ``dropped`` (written this round, cropped by the rollback), ``empty``;
    and whether the rollback freed the block."""
    bs, start, after, peak = snap["block_size"], snap["start"], snap["length"], snap["peak_length"]
    out = []
    for i, block_id in enumerate(snap["peak"]):
        states = []
        for p in range(i * bs, (i + 1) * bs):
            states.append("old" if p < start else "kept" if p < after else "dropped" if p < peak else "empty")
        out.append({"id": block_id, "slots": states, "freed": block_id in snap["freed"],
                    "new": block_id in snap["taken"]})
    return out
