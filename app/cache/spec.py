"""One KV-cache spec per layer, as vLLM keeps (``vllm/v1/kv_cache_interface.py``), and the KV-cache groups made
from them. Every part that sizes or frees a layer's K/V asks its spec: the capacity calculator, the simulator, the
paged cache's groups, prefix caching, the model card.

A spec says what one layer caches per token and how much of a sequence it keeps::

    FullAttentionSpec(n_kv_head, head_dim)            every token, for as long as the request runs
    SlidingWindowSpec(n_kv_head, head_dim, W)         a query at position n reads keys n-W+1 .. n: every block wholly
                                                      before n-W+1 is freed (vLLM's remove_skipped_blocks)
    MLAAttentionSpec(kv_lora_rank, qk_rope_head_dim)  every token, one latent vector of kv_lora_rank + rope values,
                                                      no separate K and V (DeepSeek-V2/V3)

and answers, for a block size and a dtype:

    page_size_bytes(block_size, dtype)    one block of this layer (vLLM's page_size_bytes)
    num_skipped_tokens(num_computed)      tokens the next query never reads again (0 for full attention)
    tokens_held(n)                        tokens the layer keeps while it computes token n-1
    blocks_held(n, block_size)            blocks that cover them (the partial tail block included)
    max_memory_usage_bytes(...)           the most one request can hold (vLLM's max_memory_usage_bytes)

The one rule a sliding window adds is ``num_skipped_tokens`` (vLLM: ``num_computed_tokens - sliding_window + 1``);
tokens and blocks held both follow from it::

    W = 5, block_size 4, 11 tokens:   [0 1 2 3] [4 5 6 7] [8 9 10 .]    token 10 reads 6..10: 5 tokens, 2 blocks
                                       skipped: 6 tokens = 1 whole block

A window of W tokens spans at most ceil((W - 1) / block_size) + 1 blocks (it need not start on a block boundary),
so a sliding layer never holds more than ceil(W / block_size) + 1 blocks however long the request grows.

Layers are grouped once, from their specs (``kv_cache_groups``): layers with equal specs are one kind; kinds are cut
into KV-cache groups of one size, full attention first (vLLM's ``_get_kv_cache_groups_uniform_page_size``); every
group has its own block table per request and all groups draw from one block pool. A block's page holds
``group_size`` layers of whichever group took it::

    gemma-3-270m, 18 layers:  L L L L L F  L L L L L F  L L L L L F     L: window 512, F: full attention
        kinds   full [5, 11, 17]   sliding-512 [0..4, 6..10, 12..16]   (3 and 15 layers)
        groups  [5, 11, 17]  [0, 1, 2]  [3, 4, 6]  [7, 8, 9]  [10, 12, 13]  [14, 15, 16]     6 groups of 3

The specs live in ``app/cache`` (they count blocks); ``app/catalog.py`` only carries the numbers they are built from
(``ModelConfig.windows``, ``kv_lora_rank`` ...) and ``from_adapter`` reads a loaded model's ``attention(i)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from app import kv_bytes
from app.cache.blocks import blocks_needed
from app.catalog import ModelConfig
from app.kv_bytes import MLA

FULL_ATTENTION, SLIDING_WINDOW, MLA_ATTENTION = "full_attention", "sliding_window", "mla_attention"  # vLLM's kinds


@dataclass(frozen=True)
class AttentionSpec:
    """What every layer's spec answers (vLLM's ``KVCacheSpec`` / ``AttentionSpec``); as written here, a layer that
    keeps every token. Frozen and compared by value: layers with equal specs are one kind."""

    n_kv_head: int
    head_dim: int

    kind: ClassVar[str] = FULL_ATTENTION  # vLLM's ``kv_cache_spec_kind`` (its KV events carry it)
    sliding_window: ClassVar[int | None] = None  # vLLM's ``kv_cache_spec_sliding_window``

    @property
    def label(self) -> str:
        """The page's word for the kind: "full" (every token kept) or "sliding" (a window's)."""
        return "full" if self.sliding_window is None else "sliding"

    def bytes_per_token(self, dtype: str = "bf16", *, scales: str = "head-token", block_size: int = 16,
                        tp: int = 1) -> float:
        """K and V of one token in this layer, on one GPU (``app/kv_bytes.py``'s formula with one layer)."""
        return kv_bytes.bytes_per_token(n_layer=1, n_kv_head=self.n_kv_head, head_dim=self.head_dim, dtype=dtype,
                                        scales=scales, block_size=block_size, tp=tp)

    def page_size_bytes(self, block_size: int, dtype: str = "bf16", *, scales: str = "head-token",
                        tp: int = 1) -> float:
        """One block of ``block_size`` token slots of this layer: 2 · block_size · H_kv · Dh · dtype bytes."""
        total = block_size * self.bytes_per_token(dtype, scales=scales, block_size=block_size, tp=tp)
        return int(total) if float(total).is_integer() else total

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the next query's reach once ``num_computed_tokens`` are computed: none for full attention."""
        return 0

    def tokens_held(self, num_tokens: int) -> int:
        """Tokens the layer keeps while it computes token ``num_tokens - 1``."""
        return num_tokens - self.num_skipped_tokens(num_tokens - 1) if num_tokens > 0 else 0

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks the layer holds while it computes token ``num_tokens - 1``: every block from the first one that
        still holds a kept token to the (maybe partial) last one."""
        if num_tokens <= 0:
            return 0
        return blocks_needed(num_tokens, block_size) - self.num_skipped_tokens(num_tokens - 1) // block_size

    def max_memory_usage_bytes(self, *, max_model_len: int, block_size: int, dtype: str = "bf16",
                               max_num_batched_tokens: int | None = None, scales: str = "head-token",
                               tp: int = 1) -> float:
        """The most one request holds in this layer: every block of ``max_model_len`` tokens."""
        return blocks_needed(max_model_len, block_size) * self.page_size_bytes(block_size, dtype, scales=scales,
                                                                              tp=tp)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that keeps K and V of every token (vLLM's ``FullAttentionSpec``)."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer whose query at position n reads keys n - W + 1 .. n only (vLLM's ``SlidingWindowSpec``): once a block
    lies wholly before that, no query reads it again and the layer gives it back to the pool."""

    sliding_window: int  # type: ignore[misc]  # a field here, a class constant on full attention

    kind: ClassVar[str] = SLIDING_WINDOW

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError("a sliding window holds at least one token")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """vLLM's ``SlidingWindowManager.get_num_skipped_tokens``: the query at ``num_computed_tokens`` reads
        ``num_computed_tokens - W + 1`` onwards, so every earlier token is skipped."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def max_memory_usage_bytes(self, *, max_model_len: int, block_size: int, dtype: str = "bf16",
                               max_num_batched_tokens: int | None = None, scales: str = "head-token",
                               tp: int = 1) -> float:
        """vLLM's rule: a step holds the last W - 1 computed tokens plus the ones it schedules (at most
        ``max_num_batched_tokens``, never more than ``max_model_len``), in blocks, plus one because the window need
        not start on a block boundary."""
        batched = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        tokens = min(self.sliding_window - 1 + batched, max_model_len)
        return (blocks_needed(tokens, block_size) + 1) * self.page_size_bytes(block_size, dtype, scales=scales, tp=tp)


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (vLLM's ``MLAAttentionSpec``): every token, one compressed vector of
    ``kv_lora_rank`` values plus the shared rotary key, no separate K and V (so no ×2), not split across GPUs."""

    kind: ClassVar[str] = MLA_ATTENTION

    @classmethod
    def of(cls, mla: MLA) -> MLAAttentionSpec:
        return cls(n_kv_head=1, head_dim=mla.width, kv_lora_rank=mla.kv_lora_rank,
                   qk_rope_head_dim=mla.qk_rope_head_dim)

    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def bytes_per_token(self, dtype: str = "bf16", *, scales: str = "head-token", block_size: int = 16,
                        tp: int = 1) -> float:
        return kv_bytes.bytes_per_token(n_layer=1, n_kv_head=1, head_dim=self.head_dim, dtype=dtype, scales=scales,
                                        block_size=block_size, tp=tp, mla=MLA(self.kv_lora_rank,
                                                                             self.qk_rope_head_dim))


KVCacheSpec = AttentionSpec  # every layer's spec is one


# --- built from a model ----------------------------------------------------------------------------------------

def layer_spec(*, n_kv_head: int, head_dim: int, window: int | None = None, mla: MLA | None = None) -> KVCacheSpec:
    if mla is not None:
        return MLAAttentionSpec.of(mla)
    if window is None:
        return FullAttentionSpec(n_kv_head, head_dim)
    return SlidingWindowSpec(n_kv_head, head_dim, window)


def from_config(c: ModelConfig) -> tuple[KVCacheSpec, ...]:
    """Each layer's spec from a ``ModelConfig`` (a catalog entry, a config.json, hand-entered numbers)."""
    return tuple(layer_spec(n_kv_head=c.n_kv_head, head_dim=c.head_dim, window=c.window(i), mla=c.mla)
                 for i in range(c.n_layer))


def from_adapter(adapter) -> tuple[KVCacheSpec, ...]:
    """Each layer's spec from a loaded model's adapter: its sizes and each layer's ``attention(i).window``."""
    return tuple(layer_spec(n_kv_head=adapter.n_kv_head, head_dim=adapter.head_dim,
                            window=adapter.attention(i).window) for i in range(adapter.n_layer))


def uniform(n_layer: int, n_kv_head: int, head_dim: int) -> tuple[KVCacheSpec, ...]:
    """``n_layer`` full-attention layers of one shape (a cache that keeps every token of every layer)."""
    return (FullAttentionSpec(n_kv_head, head_dim),) * n_layer


# --- grouping, done once ----------------------------------------------------------------------------------------

def _order(spec: KVCacheSpec) -> tuple:
    return (spec.sliding_window is not None, spec.sliding_window or 0, spec.kind)


def layer_kinds(specs: Sequence[KVCacheSpec]) -> list[tuple[KVCacheSpec, tuple[int, ...]]]:
    """The distinct specs, full attention first (then windows, smallest first), each with its layers."""
    kinds: dict[KVCacheSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        kinds.setdefault(spec, []).append(layer)
    return [(spec, tuple(kinds[spec])) for spec in sorted(kinds, key=_order)]


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one spec that share block tables (vLLM's ``KVCacheGroupSpec``)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]

    @property
    def window(self) -> int | None:
        return self.spec.sliding_window

    @property
    def kind(self) -> str:
        return self.spec.label


def kv_cache_groups(specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """Split the layers into groups of one spec and (nearly) one size, full attention first, as vLLM does
    (``_get_kv_cache_groups_uniform_page_size``): one kind is one group of all its layers; otherwise the group size
    is the smallest kind's layer count, or the largest one's when the largest kind has fewer than 1.5x the smallest
    one's layers (vLLM pads the smaller kinds' groups), and each kind's layers are cut into chunks of that size.
    (vLLM deals a kind's layers out round-robin, ``layers[i::num_groups]``, where this cuts them in runs: the
    groups' sizes and so every block count are the same.)"""
    kinds = layer_kinds(specs)
    if len(kinds) == 1:
        ((spec, layers),) = kinds
        return [KVCacheGroup(spec, layers)]
    counts = [len(layers) for _, layers in kinds]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    return [KVCacheGroup(spec, layers[i : i + size]) for spec, layers in kinds for i in range(0, len(layers), size)]


def group_size(groups: Sequence[KVCacheGroup]) -> int:
    """Layers one block's page holds: the largest group's (vLLM gives every group one page size)."""
    return max(len(g.layers) for g in groups)


def block_bytes(groups: Sequence[KVCacheGroup], block_size: int, dtype: str) -> float:
    """One block of a pool shared by ``groups``: ``group_size`` layers' pages (the first group's spec: all groups of a
    pool have one page size)."""
    return group_size(groups) * groups[0].spec.page_size_bytes(block_size, dtype, scales="tensor")


def pool_bytes(specs: Sequence[KVCacheSpec], *, num_blocks: int, block_size: int, dtype: str) -> int:
    """K/V bytes a pool of ``num_blocks`` blocks reserves: each block holds ``group_size`` layers, not every layer
    (the groups take turns on the blocks)."""
    return int(num_blocks * block_bytes(kv_cache_groups(specs), block_size, dtype))


# --- what one request holds ---------------------------------------------------------------------------------------

def kind_rows(specs: Sequence[KVCacheSpec], context: int, *, block_size: int, dtype: str = "bf16",
              scales: str = "head-token", tp: int = 1) -> list[dict]:
    """One row per kind of layer: what one request of ``context`` tokens holds in those layers, exactly (``bytes``)
    and in whole blocks (``block_bytes``), on one GPU."""
    rows = []
    for spec, layers in layer_kinds(specs):
        n = len(layers)
        layer = spec.bytes_per_token(dtype, scales=scales, block_size=block_size, tp=tp)
        held, blocks = spec.tokens_held(context), spec.blocks_held(context, block_size)
        rows.append({"kind": spec.label, "spec_kind": spec.kind, "window": spec.sliding_window, "layers": list(layers),
                     "n_layers": n, "bytes_per_token": n * layer, "tokens_held": held, "blocks": blocks,
                     "bytes": n * held * layer, "block_bytes": n * blocks * block_size * layer})
    return rows


def request_bytes(specs: Sequence[KVCacheSpec], context: int, *, block_size: int, dtype: str = "bf16",
                  scales: str = "head-token", tp: int = 1) -> float:
    """Whole blocks one request of ``context`` tokens holds on one GPU, summed layer kind by layer kind."""
    return sum(r["block_bytes"] for r in kind_rows(specs, context, block_size=block_size, dtype=dtype, scales=scales,
                                                     tp=tp))


def sizes(c: ModelConfig, *, dtype: str = "bf16", scales: str = "head-token", block_size: int = 16,
          tp: int = 1) -> dict:
    """Parameters and KV bytes of a config, the numbers every page shows about a model's size.

    ``layer_bytes``: K and V of one token in one layer (on one GPU); ``kinds``: the layer kinds with their layer
    count and their share of one token; ``bytes_per_token``: every layer; ``mha_bytes_per_token``: the same model
    with one KV head per query head (what grouped- or multi-query attention saves against); ``kv_saving``: their
    ratio (query heads per KV head).
    """
    specs = from_config(c)

    def token_bytes(spec: KVCacheSpec) -> float:
        return spec.bytes_per_token(dtype, scales=scales, block_size=block_size, tp=tp)

    kinds = [{k: r[k] for k in ("kind", "spec_kind", "window", "layers", "n_layers", "bytes_per_token")}
             for r in kind_rows(specs, 1, dtype=dtype, scales=scales, block_size=block_size, tp=tp)]
    per_token = sum(token_bytes(s) for s in specs)
    mha = per_token if c.mla else sum(token_bytes(FullAttentionSpec(c.n_head, c.head_dim)) for _ in specs)
    return {"parameters": c.parameters, "layer_bytes": token_bytes(specs[0]),
            "bytes_per_token": per_token, "kinds": kinds, "mha_bytes_per_token": mha,
            "kv_saving": mha / per_token if per_token else 1.0, "attention": c.attention}
