"""The engine's block pool as its KV events tell it: KVScope never sees the engine's memory, only what it announces.

    BlockStored(hashes h1..hk, parent p, tokens)   k blocks enter the pool, chained: p <- h1 <- h2 … <- hk
    BlockRemoved(hashes)                            those blocks left (evicted, or freed without a hash)
    AllBlocksCleared                                the prefix cache was reset

A block is keyed by (group, medium, hash): one hash may live in several KV-cache groups (a hybrid model's full and
sliding-window layers) and tiers (GPU, CPU offload). Parent links make the stored blocks a forest of prefixes.

Batches are applied strictly in sequence order. Whoever feeds the mirror (``app/engine/link.py``) asks the replay
socket for a missing range *before* applying the batch after it; what replay could not give is recorded as a gap
(``gaps``: first and last missing sequence numbers). A sequence number below the next expected one on the live
stream means the engine restarted (its counter starts at 0 again): the mirror empties, as the engine's cache did.

Bounded: at most ``max_blocks`` blocks holding at most ``max_tokens`` tokens together (the oldest stored go first,
counted in ``dropped``), the newest ``max_changes`` changes kept for pages that follow along (``changes_since``), at
most ``MAX_GAPS`` gaps, ``SEEN_KEPT`` batches remembered. Invariants after every call: ``held`` counts the blocks per
(group, medium) and ``tokens`` their tokens, exactly. Fed only ``EventBatch``es that ``app/engine/events.py``
checked (types and ranges), so no call here fails on what an engine sent.
Not thread-safe: the link holds its lock around every call.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from app.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

MAX_GAPS = 64
SEEN_KEPT = 4096  # batches remembered to tell a duplicate (replayed, then heard live) from a restart
Key = tuple[int, str, int]  # (group_idx, medium, hash)


@dataclass
class MirrorBlock:
    block_hash: int
    parent: int | None
    token_ids: tuple[int, ...]
    group_idx: int
    medium: str
    spec_kind: str | None
    sliding_window: int | None
    seq: int  # the batch that stored it
    text: str | None = None  # its tokens decoded by the engine's tokenizer (filled in later by the link)


class BlockMirror:
    def __init__(self, *, max_blocks: int = 50_000, max_changes: int = 4_000, max_tokens: int = 2_000_000) -> None:
        self.max_blocks, self.max_tokens = max_blocks, max_tokens
        self.blocks: OrderedDict[Key, MirrorBlock] = OrderedDict()  # oldest stored first
        self.held: Counter[tuple[int, str]] = Counter()  # blocks held per (group, medium), kept as blocks change
        self.tokens = 0  # the tokens of every block held
        self.changes: deque[dict] = deque(maxlen=max_changes)
        self.version = 0  # one more per change
        self.next_seq: int | None = None  # the sequence number expected next
        self.gaps: list[tuple[int, int]] = []
        self.restarts = 0
        self.batches = 0
        self.replayed = 0  # batches that came through the replay socket
        self.stored = self.removed = self.cleared = self.other = self.dropped = 0
        self.unknown_removed = 0  # removes of a block the mirror never saw stored (before it connected)
        self.groups: dict[int, tuple[str | None, int | None]] = {}  # group -> (spec kind, sliding window)
        self.block_size: int | None = None
        self._seen: OrderedDict[int, float] = OrderedDict()  # the last SEEN_KEPT batches applied: seq -> ts

    # --- feeding ---------------------------------------------------------------------------------------------
    def missing_before(self, seq: int) -> tuple[int, int] | None:
        """The range a batch with this sequence number would skip (None: nothing is missing)."""
        if self.next_seq is None or seq <= self.next_seq:
            return None
        return (self.next_seq, seq - 1)

    def is_restart(self, batch: EventBatch) -> bool:
        """A batch from before the next expected one that is not one already applied (same number, same time):
        the engine's counter began again."""
        if self.next_seq is None or batch.seq >= self.next_seq:
            return False
        return self._seen.get(batch.seq) != batch.ts

    def record_gap(self, first: int, last: int) -> None:
        if len(self.gaps) < MAX_GAPS:
            self.gaps.append((first, last))
        self._change({"op": "gap", "first": first, "last": last})
        self.next_seq = last + 1

    def restart(self, reason: str) -> None:
        """The engine started again: its cache is empty and its sequence numbers begin at 0."""
        self.restarts += 1
        self._clear()
        self.next_seq = None
        self._seen.clear()
        self._change({"op": "restart", "reason": reason})

    def apply(self, batch: EventBatch, *, replayed: bool = False) -> bool:
        """Apply one batch in order; False (nothing done) for one already applied."""
        if self.next_seq is not None and batch.seq < self.next_seq:
            return False
        self.next_seq = batch.seq + 1
        self._seen[batch.seq] = batch.ts
        if len(self._seen) > SEEN_KEPT:
            self._seen.popitem(last=False)
        self.batches += 1
        self.replayed += replayed
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev, batch.seq)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.cleared += 1
                self._clear()
                self._change({"op": "cleared", "seq": batch.seq})
            else:
                self.other += 1
        return True

    def _stored(self, ev: BlockStored, seq: int) -> None:
        group, medium = ev.group_idx or 0, ev.medium or "GPU"
        self.groups[group] = (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
        self.block_size = ev.block_size
        for h, parent, tokens in ev.blocks():
            key = (group, medium, h)
            self._take(key)
            self.blocks[key] = MirrorBlock(h, parent, tokens, group, medium, ev.kv_cache_spec_kind,
                                           ev.kv_cache_spec_sliding_window, seq)
            self.held[group, medium] += 1
            self.tokens += len(tokens)
            self.stored += 1
            self._change({"op": "stored", "hash": h, "parent": parent, "group": group, "medium": medium, "seq": seq})
        while len(self.blocks) > self.max_blocks or (self.tokens > self.max_tokens and self.blocks):
            self._take(next(iter(self.blocks)))
            self.dropped += 1

    def _removed(self, ev: BlockRemoved) -> None:
        group, medium = ev.group_idx or 0, ev.medium or "GPU"
        for h in ev.block_hashes:
            if self._take((group, medium, h)) is None:
                self.unknown_removed += 1
            self.removed += 1
            self._change({"op": "removed", "hash": h, "group": group, "medium": medium})

    def _take(self, key: Key) -> MirrorBlock | None:
        """Take one block out, its counts with it; None when it was not held."""
        block = self.blocks.pop(key, None)
        if block is not None:
            group, medium, _ = key
            self.held[group, medium] -= 1
            if not self.held[group, medium]:
                del self.held[group, medium]
            self.tokens -= len(block.token_ids)
        return block

    def _clear(self) -> None:
        self.blocks.clear()
        self.held.clear()
        self.tokens = 0

    def _change(self, change: dict) -> None:
        self.version += 1
        change["v"] = self.version
        self.changes.append(change)

    # --- reading ---------------------------------------------------------------------------------------------
    def changes_since(self, version: int) -> list[dict] | None:
        """The changes after ``version``; None when some were already dropped (the reader must start again)."""
        if version >= self.version:
            return []
        if not self.changes or self.changes[0]["v"] > version + 1:
            return None
        return [c for c in self.changes if c["v"] > version]

    def hashes(self, group: int = 0, medium: str = "GPU") -> set[int]:
        return {k[2] for k in self.blocks if k[0] == group and k[1] == medium}
