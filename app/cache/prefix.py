"""Prefix caching over the model's real K/V tensors.

``PrefixCache`` keeps K/V in a block store indexed by ``block_id`` and a ``BlockPool`` that says which
block holds which prefix. One request goes through vLLM's three steps::

    get_computed_blocks   longest run of leading full blocks whose chained hash is cached  -> hits
    allocate_slots        touch the hits (ref_cnt += 1), take new blocks for the rest      -> blocks
    prefill               hits' K/V (per layer, concatenated) -> DynamicCache -> forward only the
                          tokens after the hits; write their K/V into the new blocks; register each
                          new *full* block under its hash (the partial tail block is never shared)

and later ``free`` (finished or cancelled): every block loses one reference, tail first, so the
request's last blocks are evicted before its first ones.

At least one token is always computed (its logits are the next-token prediction), so a prompt that is
entirely cached still recomputes its last block, as in vLLM.

``PrefixLab`` is the bounded object the web page keeps for each browser in ``state.prefix_labs``: one
cache (capacity in blocks), and at most ``MAX_STORED_REQUESTS`` request records. Callers hold the lab's
own lock around every method, and the model gate around every method that runs the model.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from app.cache import kv_bytes
from app.cache.blocks import (
    BlockHash,
    BlockPool,
    KVCacheBlock,
    NoFreeBlocks,
    block_extra_keys,
    hash_request_tokens,
)
from app.errors import BadInput, NotFound
from app.model.loading import LoadedModel
from app.model.prompts import encode_prompt

DEFAULT_BLOCK_SIZE = 16
BLOCK_SIZES = (4, 8, 16, 32)
DEFAULT_NUM_BLOCKS = 64
MAX_NUM_BLOCKS = 512
MAX_STORE_BYTES = 256 * 1024**2  # K and V of all blocks together
MAX_PROMPTS_PER_RUN = 8
MAX_STORED_REQUESTS = 24
MAX_PROMPT_CHARS = 4000
MAX_SALT_CHARS = 64
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
    blocks: list[KVCacheBlock]  # every block the request holds, the partial tail included
    block_ids: list[int]  # snapshot of blocks' ids (blocks may be reused by others after eviction)
    num_hit_blocks: int
    status: str = "running"  # running | finished | cancelled
    prefill_ms_reuse: float = 0.0  # gather cached K/V + forward of the uncached tokens
    prefill_ms_full: float = 0.0  # forward of every token, from an empty cache
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
    """A block pool plus the storage of each block's K/V, for one model and one block size.

    Storage layout (L layers, H_kv heads, Dh head width, bs block size)::

        key_store[block_id]   (L, H_kv, bs, Dh)      value_store likewise
        page bytes per block = 2 · L · H_kv · bs · Dh · dtype bytes
    """

    def __init__(self, lm: LoadedModel, *, block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int = DEFAULT_NUM_BLOCKS):
        a = lm.adapter
        self.lm = lm
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        shape = (num_blocks, a.n_layer, a.n_kv_head, block_size, a.head_dim)
        self.key_store = torch.zeros(shape, dtype=a.dtype)  # (N, L, H_kv, bs, Dh)
        self.value_store = torch.zeros(shape, dtype=a.dtype)  # (N, L, H_kv, bs, Dh)

    @torch.no_grad()
    def warm_up(self) -> None:
        """One untimed forward, so the first measured request does not pay torch's first-call costs."""
        model = self.lm.model
        model(input_ids=torch.zeros((1, 2), dtype=torch.long), cache=DynamicCache(config=model.config), use_cache=True)

    @staticmethod
    def page_bytes_for(lm: LoadedModel, block_size: int) -> int:
        a = lm.adapter
        return int(kv_bytes.page_bytes(block_size=block_size, n_layer=a.n_layer, n_kv_head=a.n_kv_head,
                                       head_dim=a.head_dim, dtype=kv_bytes.dtype_name(a.dtype)))

    @property
    def page_bytes(self) -> int:
        return self.page_bytes_for(self.lm, self.block_size)

    def extra_keys(self, salt: str | None) -> tuple:
        return block_extra_keys(self.lm.name, salt)

    # --- step 1: get_computed_blocks -------------------------------------------------------------
    def get_computed_blocks(self, token_ids: list[int], salt: str | None) -> tuple[list[BlockHash], list[KVCacheBlock]]:
        hashes = hash_request_tokens(token_ids, self.block_size, self.extra_keys(salt))
        max_hit_blocks = (len(token_ids) - 1) // self.block_size  # keep >= 1 token to compute
        return hashes, self.pool.find_longest_cache_hit(hashes, max_hit_blocks)

    # --- step 2 + 3: allocate and prefill --------------------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: list[int], *, request_id: int, group: str = "", text: str = "",
                salt: str | None = None) -> PrefixRequest:
        bs = self.block_size
        hashes, hits = self.get_computed_blocks(token_ids, salt)
        n_hit = len(hits) * bs
        n_blocks = -(-len(token_ids) // bs)
        self.pool.touch(hits)  # before allocating, so the hits cannot be evicted by our own allocation
        try:
            new_blocks = self.pool.get_new_blocks(n_blocks - len(hits))
        except NoFreeBlocks:
            free = len(self.pool.free_block_queue)
            self.pool.free_blocks(reversed(hits))
            raise BadInput("err.prefix.full", need=n_blocks - len(hits), free=free) from None
        blocks = hits + new_blocks
        req = PrefixRequest(request_id=request_id, group=group, text=text, token_ids=list(token_ids), salt=salt,
                            block_size=bs, block_hashes=hashes, blocks=blocks,
                            block_ids=[b.block_id for b in blocks], num_hit_blocks=len(hits))
        try:
            logits = self._run(req, hits, new_blocks, n_hit)
            self._compare_with_full(req, logits, n_hit)
        except BaseException:
            # Cancelled mid-prefill: nothing half-written may become findable, so no hash is registered.
            self.free(req, reason="cancelled")
            raise
        req.newly_cached = [False] * len(hits) + [
            self.pool.cache_full_block(blocks[i], hashes[i]) for i in range(len(hits), len(hashes))
        ]
        return req

    def _run(self, req: PrefixRequest, hits: list[KVCacheBlock], new_blocks: list[KVCacheBlock], n_hit: int):
        model = self.lm.model
        t0 = time.perf_counter()
        cache = self.gather(hits)
        ids = torch.tensor([req.token_ids[n_hit:]])  # (1, T_new)
        out = model(input_ids=ids, cache=cache, use_cache=True)
        req.prefill_ms_reuse = (time.perf_counter() - t0) * 1000
        self.scatter(out.cache, new_blocks, start=n_hit, end=req.num_tokens)
        return out.logits[0]  # (T_new, V)

    def _compare_with_full(self, req: PrefixRequest, logits: torch.Tensor, n_hit: int) -> None:
        model = self.lm.model
        t0 = time.perf_counter()
        full = model(input_ids=torch.tensor([req.token_ids]), cache=DynamicCache(config=model.config), use_cache=True)
        req.prefill_ms_full = (time.perf_counter() - t0) * 1000
        ref = full.logits[0, n_hit:]  # (T_new, V)
        req.max_abs_diff = float((logits - ref).abs().max())
        req.next_token_reuse = int(logits[-1].argmax())
        req.next_token_full = int(ref[-1].argmax())

    def gather(self, blocks: list[KVCacheBlock]) -> DynamicCache:
        """The cached K/V of ``blocks`` as a DynamicCache: per layer (1, H_kv, len(blocks)·bs, Dh).

        Built without the model's config, so every layer keeps every token: a sliding-window layer's cache
        (transformers keeps its last ``window - 1`` only) could not hand the new blocks' K/V to ``scatter``.
        The model still masks such a layer to its window."""
        cache = DynamicCache()
        if not blocks:
            return cache
        idx = torch.tensor([b.block_id for b in blocks])
        keys = self.key_store[idx]  # (nb, L, H_kv, bs, Dh)
        values = self.value_store[idx]
        nb, n_layer, h, bs, dh = keys.shape
        for layer in range(n_layer):
            k = keys[:, layer].permute(1, 0, 2, 3).reshape(1, h, nb * bs, dh)  # (1, H_kv, nb·bs, Dh)
            v = values[:, layer].permute(1, 0, 2, 3).reshape(1, h, nb * bs, dh)
            cache.update(k, v, layer)
        return cache

    def scatter(self, cache: DynamicCache, blocks: list[KVCacheBlock], *, start: int, end: int) -> None:
        """Write positions ``start..end`` of ``cache`` into ``blocks`` (``start`` is block-aligned)."""
        bs = self.block_size
        for layer in range(self.lm.adapter.n_layer):
            k, v = self.lm.adapter.layer_cache(cache, layer)  # (1, H_kv, end, Dh) each
            for j, block in enumerate(blocks):
                lo = start + j * bs
                hi = min(lo + bs, end)
                self.key_store[block.block_id, layer, :, : hi - lo] = k[0, :, lo:hi]
                self.value_store[block.block_id, layer, :, : hi - lo] = v[0, :, lo:hi]

    # --- free ------------------------------------------------------------------------------------
    def free(self, req: PrefixRequest, *, reason: str = "finished") -> None:
        """Release a request's blocks, tail first. Safe to call twice."""
        if req.status != "running":
            return
        self.pool.free_blocks(reversed(req.blocks))
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


@dataclass
class LabCounts:
    requests: int = 0
    requests_hit: int = 0  # requests that reused at least one block
    tokens: int = 0
    hit_tokens: int = 0

    def add(self, req: PrefixRequest) -> None:
        self.requests += 1
        self.requests_hit += req.num_hit_blocks > 0
        self.tokens += req.num_tokens
        self.hit_tokens += req.num_hit_tokens


class PrefixLab:
    """What the prefix-cache page keeps on the server (bounded: one cache, a few request records)."""

    def __init__(self) -> None:
        self.cache: PrefixCache | None = None
        self.requests: OrderedDict[int, PrefixRequest] = OrderedDict()
        self.next_id = 1
        self.totals = LabCounts()
        self.last_run: list[int] = []
        self.notes: list[tuple[str, dict]] = []  # (catalog key, parameters)
        self.timestamp_runs = 0  # the timestamp preset's clock
        # Called with a new cache's bytes before it is allocated; raises if the server's labs have no room.
        self.admit: Callable[[int], None] | None = None

    @property
    def running(self) -> list[PrefixRequest]:
        return [r for r in self.requests.values() if r.status == "running"]

    def configure(self, lm: LoadedModel, block_size: int, num_blocks: int) -> None:
        """Use this model, block size and capacity; any change starts an empty cache."""
        if block_size not in BLOCK_SIZES:
            raise BadInput("err.block_size", sizes=", ".join(map(str, BLOCK_SIZES)))
        if not 1 <= num_blocks <= MAX_NUM_BLOCKS:
            raise BadInput("err.prefix.capacity", n=MAX_NUM_BLOCKS)
        store = num_blocks * PrefixCache.page_bytes_for(lm, block_size)
        if store > MAX_STORE_BYTES:
            raise BadInput("err.prefix.store", n=num_blocks, size=block_size, model=lm.name,
                           mib=f"{store / 1024**2:.0f}", limit=MAX_STORE_BYTES // 1024**2)
        c = self.cache
        # ``c.lm is lm``: a model loaded again under the same name has other weights; its cache starts empty.
        if c and c.lm is lm and (c.block_size, c.pool.num_blocks) == (block_size, num_blocks):
            return
        if self.admit is not None:
            self.admit(store)
        note = ("prefix.note.new_cache", {"model": lm.name, "size": block_size, "n": num_blocks, "old_model": c.lm.name,
                                          "old_size": c.block_size, "old_n": c.pool.num_blocks}) if c else None
        self.reset()
        self.cache = PrefixCache(lm, block_size=block_size, num_blocks=num_blocks)
        self.cache.warm_up()
        if note:
            self.notes.append(note)

    def reset(self) -> None:
        """Drop the cache and every record."""
        self.cache = None
        self.requests.clear()
        self.totals = LabCounts()
        self.last_run = []
        self.notes = []

    def run(self, lm: LoadedModel, prompts: list[tuple[str, str]], *, block_size: int | None,
            num_blocks: int = DEFAULT_NUM_BLOCKS, salt: str | None = None) -> list[PrefixRequest]:
        """Finish the previous run's requests, then prefill ``prompts`` ((group, text) pairs) in order.
        Requests of one run stay running together, so their shared blocks show ref counts > 1."""
        if not prompts:
            raise BadInput("err.prefix.no_prompts")
        if len(prompts) > MAX_PROMPTS_PER_RUN:
            raise BadInput("err.prefix.too_many", n=MAX_PROMPTS_PER_RUN)
        if salt is not None and len(salt) > MAX_SALT_CHARS:
            raise BadInput("err.prefix.salt", n=MAX_SALT_CHARS)
        encoded = [encode_prompt(lm, text, max_chars=MAX_PROMPT_CHARS) for _, text in prompts]
        unk = lm.tokenizer.unk_token_id
        if unk is not None and any(unk in ids for ids in encoded):
            # GPT-2's unknown id is its end-of-text id, and its byte-level BPE knows every character:
            # refuse only when some character really maps to the unknown token.
            bad = _unknown_chars(lm, [t for _, t in prompts])
            if bad:
                raise BadInput("err.prefix.unknown_chars", model=lm.name, chars=bad)
        self.notes = []
        block_size = block_size or auto_block_size([len(ids) for ids in encoded])
        # The run's requests stay running together, so all their blocks must fit at once. The default capacity
        # grows to fit a run (and says so) rather than failing halfway; a capacity the user chose is kept, so
        # a student can still watch a too-small cache run full.
        need = blocks_for_run(encoded, block_size, salt or None)
        if need > num_blocks and num_blocks == DEFAULT_NUM_BLOCKS:
            if need > MAX_NUM_BLOCKS:
                raise BadInput("err.prefix.run_too_big", n=len(encoded), need=need, size=block_size,
                               limit=MAX_NUM_BLOCKS)
            grown = [("prefix.note.grown", {"n": len(encoded), "need": need, "size": block_size, "chosen": num_blocks})]
            num_blocks = need
        else:
            grown = []
        self.configure(lm, block_size, num_blocks)
        self.notes.extend(grown)
        assert self.cache is not None
        for req in self.running:
            self.cache.free(req)
        self.last_run = []
        out = []
        for (group, text), ids in zip(prompts, encoded, strict=True):
            req = self.cache.prefill(ids, request_id=self.next_id, group=group, text=text, salt=salt or None)
            self.next_id += 1
            self.requests[req.request_id] = req
            self.totals.add(req)
            self.last_run.append(req.request_id)
            out.append(req)
        self._trim()
        return out

    def _trim(self) -> None:
        while len(self.requests) > MAX_STORED_REQUESTS:
            oldest = next((rid for rid, r in self.requests.items() if r.status != "running"), None)
            if oldest is None:
                break
            del self.requests[oldest]

    def finish(self, request_id: int | None = None, *, reason: str = "finished") -> list[PrefixRequest]:
        """End one running request (or all of them): its blocks lose a reference, tail first."""
        if reason not in ("finished", "cancelled"):
            raise BadInput("err.prefix.reason")
        if self.cache is None:
            return []
        if request_id is None:
            targets = self.running
        elif request_id in self.requests:
            targets = [self.requests[request_id]]
        else:
            raise NotFound("err.prefix.no_request", id=request_id, n=MAX_STORED_REQUESTS)
        for req in targets:
            self.cache.free(req, reason=reason)
        return targets


def _unknown_chars(lm: LoadedModel, texts: list[str]) -> str:
    unk = lm.tokenizer.unk_token_id
    bad = sorted({ch for t in texts for ch in set(t) if lm.encode(ch) == [unk]})
    return " ".join(repr(c) for c in bad[:20])


def lab_entry(state, owner: str = ""):
    """This browser's lab (an ``Entry`` of ``state.prefix_labs``: the lab and its lock), made on first use."""
    labs = state.prefix_labs
    entry = labs.find(owner, owner)
    if entry is None:
        labs.create(owner, PrefixLab, sid=owner)
        entry = labs.entry(owner, owner)
        entry.obj.admit = lambda nbytes: labs.resize(owner, owner, nbytes)
    return entry


def get_lab(state, owner: str = "") -> PrefixLab:
    return lab_entry(state, owner).obj


def peek_lab(state, owner: str = "") -> PrefixLab:
    """This browser's lab to show; a browser that never ran one sees an empty lab (nothing is kept for it)."""
    entry = state.prefix_labs.find(owner, owner)
    return entry.obj if entry is not None else PrefixLab()


def blocks_for_run(encoded: list[list[int]], block_size: int, salt: str | None = None) -> int:
    """Blocks the requests of one run hold at once: full blocks with the same prefix are shared (one block
    each), every partial tail block is its own."""
    full: set[tuple] = set()
    tails = 0
    for ids in encoded:
        n_full = len(ids) // block_size
        full.update((salt, tuple(ids[: (b + 1) * block_size])) for b in range(n_full))
        tails += len(ids) % block_size > 0
    return len(full) + tails


def parse_block_size(value: str | int | None) -> int | None:
    """``"auto"``/None -> None (chosen from the prompts), else one of ``BLOCK_SIZES``."""
    if value in (None, "", "auto"):
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = -1
    if size not in BLOCK_SIZES:
        raise BadInput("err.prefix.block_size", sizes=", ".join(map(str, BLOCK_SIZES)))
    return size


def run_lab(state, *, model: str | None, preset: str | None, prompts: list[str] | None,
            block_size: str | int | None, num_blocks: int, salt: str | None, owner: str = "") -> PrefixLab:
    """Run a preset (or the given prompts) through this browser's prefix cache."""
    lm = state.model(model)
    if preset and preset != "custom" and preset not in PRESETS:
        raise BadInput("err.prefix.preset", preset=repr(preset), presets=", ".join(PRESETS))
    entry = lab_entry(state, owner)
    lab = entry.obj
    with entry.lock:
        if preset and preset != "custom":
            pairs = timestamp_prompts(lab.timestamp_runs) if preset == "timestamp" else PRESETS[preset]
        else:
            pairs = [("custom", p) for p in (prompts or []) if p.strip()]
        with state.model_lock:
            lab.run(lm, pairs, block_size=parse_block_size(block_size), num_blocks=num_blocks, salt=salt or None)
            lab.timestamp_runs += preset == "timestamp"
    return lab


def finish_lab(state, *, request_id: int | None, reason: str = "finished", owner: str = "") -> PrefixLab:
    entry = lab_entry(state, owner)
    with entry.lock:
        entry.obj.finish(request_id, reason=reason)
    return entry.obj


def reset_lab(state, owner: str = "") -> PrefixLab:
    entry = lab_entry(state, owner)
    with entry.lock:
        entry.obj.reset()
        state.prefix_labs.resize(owner, owner, 0)
    return entry.obj
