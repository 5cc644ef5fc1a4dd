"""A fleet of engines (replicas, or the data-parallel ranks of one): which engine holds which prefix, and where a new
prompt would find the most cached blocks — the decision a KV-aware router makes, from each engine's KV events only.

What a router knows of engine e is its event-fed index (``app/engine/mirror.py``): the set of block hashes its
``BlockStored`` events announced and its ``BlockRemoved`` events have not taken back. llm-d's KV-cache indexer and
Dynamo's KV router both score a prompt the same way::

    hashes   = the chained hashes of the prompt's full blocks, with *that engine's* block size and hash function
               (``cache_config_info``: block_size, prefix_caching_hash_algo) and its tokenizer
    matched  = the longest run of leading hashes found in the engine's index (a chain: block i is reusable only
               when blocks 0 … i-1 are, since its hash includes theirs)
    score    = matched × block size, in tokens (equal to a score in blocks when every engine has one block size)
    reused   = min(matched, (n - 1) // block size) blocks: what the engine will really skip (one token is always
               computed, its logits choose the next token) — the ``/metrics`` prefix-cache hits the request adds

The pick is the highest score; engines that tie are all named and the tie is broken by the lower KV-cache usage
(the load term both routers add), then the lower index. A score of 0 everywhere: no engine holds any of it.

Which engine holds which prefix: each engine's index as chains (root → leaf paths along the parent links), the
chains of all engines merged by their hashes (the same tokens hash the same on every engine with one block size and
seed), each with how many of its leading blocks every engine holds. Pure: the lab copies what it needs out of each
link under the link's lock and calls these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MAX_DEPTH = 4096  # blocks followed up one chain (a guard against a parent cycle in a misbehaving engine's events)


@dataclass(frozen=True)
class IndexBlock:
    """One block of an engine's index, as the fleet needs it."""

    block_hash: int
    parent: int | None
    tokens: int
    text: str | None  # decoded by the engine's tokenizer (None: not yet)


@dataclass
class EngineIndex:
    """What a router knows of one engine: its held blocks (one KV-cache group and medium) and how it hashes."""

    index: int
    name: str
    block_size: int | None
    hash_algo: str | None
    usage: float | None  # vllm:kv_cache_usage_perc (0-1), the tie-breaker
    blocks: dict[int, IndexBlock] = field(default_factory=dict)  # hash -> block

    def matched(self, hashes: Sequence[int]) -> int:
        """The longest run of leading ``hashes`` this engine holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Score:
    index: int
    tokens: int  # the prompt's length in this engine's tokens
    blocks: int  # its full blocks
    matched: int  # leading blocks found in the engine's index
    block_size: int

    @property
    def matched_tokens(self) -> int:
        return self.matched * self.block_size

    @property
    def reused(self) -> int:
        """The blocks the engine will skip: vLLM computes at least the last token."""
        return min(self.matched, max(0, (self.tokens - 1) // self.block_size))

    @property
    def hit_tokens(self) -> int:
        return self.reused * self.block_size


def score(engine: EngineIndex, token_ids: Sequence[int], hashes: Sequence[int]) -> Score:
    """``hashes``: the prompt's chain under this engine's block size and hash function (``VllmBlockHasher``)."""
    if not engine.block_size:
        raise ValueError("an engine without a block size cannot be scored")
    return Score(index=engine.index, tokens=len(token_ids), blocks=len(hashes), matched=engine.matched(hashes),
                 block_size=engine.block_size)


@dataclass(frozen=True)
class Decision:
    pick: int | None  # the engine a KV-aware router sends the prompt to (None: no engine holds any of it)
    best_tokens: int  # the winning score, in tokens
    tied: tuple[int, ...]  # every engine with the winning score (more than one: a tie, broken by usage then index)


def decide(scores: Iterable[Score], usage: dict[int, float | None] | None = None) -> Decision:
    scores = list(scores)
    best = max((s.matched_tokens for s in scores), default=0)
    if best == 0:
        return Decision(pick=None, best_tokens=0, tied=())
    tied = tuple(sorted(s.index for s in scores if s.matched_tokens == best))
    load = usage or {}
    pick = min(tied, key=lambda i: (load.get(i) if load.get(i) is not None else float("inf"), i))
    return Decision(pick=pick, best_tokens=best, tied=tied)


@dataclass
class Chain:
    """One prefix held somewhere in the fleet: block hashes root first, and how deep each engine holds it."""

    hashes: list[int]
    texts: list[str | None]
    tokens: int
    from_start: bool  # its first block is a request's first (no parent); else its parents were evicted
    held: dict[int, int] = field(default_factory=dict)  # engine index -> leading blocks of this chain it holds


def engine_chains(engine: EngineIndex) -> list[list[int]]:
    """The engine's index as root → leaf paths (a leaf: a block no held block names as parent)."""
    parents = {b.parent for b in engine.blocks.values() if b.parent is not None}
    out = []
    for h, b in engine.blocks.items():
        if h in parents:
            continue
        path, seen, cur = [h], {h}, b
        while cur.parent is not None and cur.parent in engine.blocks and cur.parent not in seen \
                and len(path) < MAX_DEPTH:
            seen.add(cur.parent)
            path.append(cur.parent)
            cur = engine.blocks[cur.parent]
        out.append(path[::-1])
    return out


def fleet_chains(engines: Sequence[EngineIndex], *, max_chains: int) -> tuple[list[Chain], int]:
    """Every engine's chains merged across the fleet (a chain inside another one is counted in the longer one),
    the most widely held and then the longest first; at most ``max_chains`` of them, and how many there were."""
    paths: dict[int, list[int]] = {}  # leaf -> path
    for e in engines:
        for path in engine_chains(e):  # the longest path to a leaf (another engine may hold parents this lost)
            if len(path) > len(paths.get(path[-1], ())):
                paths[path[-1]] = path
    inner = {h for p in paths.values() for h in p[:-1]}
    chains = []
    for leaf, path in paths.items():
        if leaf in inner:  # another engine holds it and more after it
            continue
        texts, tokens, root = [], 0, None
        for h in path:
            b = next((e.blocks[h] for e in engines if h in e.blocks and e.blocks[h].text is not None), None) \
                or next(e.blocks[h] for e in engines if h in e.blocks)
            texts.append(b.text)
            tokens += b.tokens
            if root is None:
                root = b
        held = {e.index: n for e in engines if (n := e.matched(path))}
        assert root is not None, "a chain holds at least its leaf"
        chains.append(Chain(hashes=path, texts=texts, tokens=tokens, from_start=root.parent is None, held=held))
    chains.sort(key=lambda c: (-len(c.held), -len(c.hashes), c.hashes[0]))
    return chains[:max_chains], len(chains)
