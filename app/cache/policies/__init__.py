"""KV-cache compression policies that run inside real decoding: each one is a KV store
(``ModelAdapter.forward_through`` reads only what it returns), so the model sees only the kept or
dequantized K/V.

    policy               keeps                                                module
    full                 every token, float32 (the reference)                  app.cache.paged_decode.FloatKVStore
    window               the last W tokens, windowed attention from the start  app.cache.window
    streaming            S sink tokens + the last W, keys re-rotated (RoPE)    streaming
    streaming-norerope   the same, keys left at their original rotation (RoPE models only)
    h2o                  heavy hitters by accumulated attention + recent, per head   h2o
    snapkv               prompt tokens voted by an observation window, per head      snapkv
    kivi                 every token, 2-bit (keys per channel, values per token), fp recent residual  kivi
    int8-head, fp8-e4m3, int4-head   every token, quantized per head and token  app.cache.quant

Token-dropping policies take a budget in tokens per head (the same for every layer); the quantizers keep
every token and their size follows from their format. Every store satisfies ``app.cache.store.KVStore``:
``nbytes`` is what it holds, ``kept_positions`` which positions (``KeepsPositions``, else every one fed).
"""

from __future__ import annotations

from app.cache.policies.h2o import H2OStore
from app.cache.policies.kivi import KIVIStore
from app.cache.policies.snapkv import SnapKVStore
from app.cache.policies.streaming import StreamingLLMStore
from app.cache.quant import QuantizedKVStore
from app.cache.store import FloatKVStore, KVStore
from app.cache.store import kept_positions as kept_positions  # one answer for every store
from app.cache.window import WindowKVStore

EVICTING = ("window", "streaming", "streaming-norerope", "h2o", "snapkv")
QUANTIZING = ("kivi", "int8-head", "fp8-e4m3", "int4-head")
POLICIES = ("full", *EVICTING, *QUANTIZING)


def available(adapter) -> list[str]:
    """Policies that mean something for this model (re-rotation is a RoPE matter)."""
    return [p for p in POLICIES if adapter.rotary or p != "streaming-norerope"]


def make_store(name: str, adapter, *, budget: int, reserve: int = 0, sinks: int = 4, kivi_group: int = 32,
               kivi_residual: int = 32) -> KVStore:
    """A fresh KV store running ``name`` for ``adapter``'s model; ``budget`` in tokens per head."""
    shape = {"n_layer": adapter.n_layer, "n_kv_head": adapter.n_kv_head, "head_dim": adapter.head_dim}
    evict = {**shape, "budget": budget, "kv_map": adapter.kv_map}
    if name == "full":
        return FloatKVStore(adapter.n_layer)
    if name == "window":
        return WindowKVStore(budget, **shape)
    if name in ("streaming", "streaming-norerope"):
        return StreamingLLMStore(sinks=sinks, adapter=adapter, rerotate=name == "streaming", **evict)
    if name == "h2o":
        return H2OStore(**evict)
    if name == "snapkv":
        return SnapKVStore(reserve=reserve, **evict)
    if name == "kivi":
        return KIVIStore(**shape, group=kivi_group, residual=kivi_residual)
    if name in QUANTIZING:
        return QuantizedKVStore(name, n_layer=adapter.n_layer)
    raise ValueError(f"unknown policy {name!r}")


def bytes_held(store: KVStore) -> int:
    """Bytes of K/V (and scales) ``store`` holds now (the protocol's ``nbytes``)."""
    return store.nbytes
