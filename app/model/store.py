"""Traces kept in memory while a user clicks around, bounded by a byte budget (LRU), slimmed to what pages show.

A full capture holds every hooked tensor: at T=200 on DistilGPT-2 about 115 MB, most of it the logits of
every position (T × 50 257 floats), the MLP hidden states and the KV cache (the same numbers as K and V).
The pages read only the tensors in ``PAGE_TENSORS``: embeddings, Q/K/V per head, attention weights, each
head's output, and the next-token distribution (``probs``, the last position only, from which the top-k is
taken). ``slim`` keeps those and nothing else, about 4× less. The shape trace was read off every tensor at
capture time, so it still lists them all.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from app.model.trace import Trace

# Tensor names the pages read (by suffix): the inspect views, the arithmetic panel and the embedding rows.
# RoPE models add q and k before rotation (the rotary panel); the logit lens reads each layer's residual
# stream (T × D per layer, small), head ablation compares with the last position's logits.
PAGE_TENSORS = ("embed.wte", "embed.wpe", "embed.h0", ".attn.q", ".attn.k", ".attn.v", ".attn.lse",
                ".attn.head_out", ".attn.q_prerope", ".attn.k_prerope", ".resid_out", "probs", "last_logits")
# Hooked activations no page reads and no per-head tensor is derived from (in either family): an inspect capture
# records them by shape only (``app/model/capture.py``), so its forward frees each as it goes instead of holding
# every layer's to the end (at T=1024 on DistilGPT-2, 240 MB less while it runs). Q/K/V and the heads' outputs
# are views of the fused projection and of c_proj's input, which therefore stay.
SHAPE_ONLY = (".ln_1", ".attn.out", ".resid_mid", ".ln_2", ".mlp.fc", ".mlp.gate", ".mlp.up", ".mlp.hidden",
              ".mlp.out", "ln_f", "logits")


def shape_only(name: str) -> bool:
    """True for a tensor ``slim`` would drop and nothing is derived from (``SHAPE_ONLY``)."""
    return name.endswith(SHAPE_ONLY) and not name.endswith(PAGE_TENSORS)


def slim(trace: Trace) -> Trace:
    """The same trace with only ``PAGE_TENSORS`` kept and no KV cache (keys and values are its K and V)."""
    if trace.past_length:  # a decode step's trace reads older keys from the cache: keep it whole
        return trace
    kept = {name: t for name, t in trace.tensors.items() if name.endswith(PAGE_TENSORS)}
    return Trace(token_ids=trace.token_ids, token_texts=trace.token_texts, tensors=kept, steps=trace.steps,
                 adapter=trace.adapter, past_length=0, cache=None, meta=trace.meta)


class TraceStore:
    """Least-recently-used cache of traces; the total of ``Trace.nbytes()`` stays under ``max_bytes``.

    A trace larger than the whole budget is kept alone (every other trace evicted) if it is at most
    ``keep_one_bytes``, so a long prompt's page does not recompute it for each panel; a bigger one is returned
    to the caller but not kept. Memory held: at most max(max_bytes, keep_one_bytes).
    """

    def __init__(self, max_bytes: int, ttl_s: float = float("inf"), keep_one_bytes: int = 0) -> None:
        self.max_bytes = max_bytes
        self.keep_one_bytes = keep_one_bytes
        self.ttl_s = ttl_s  # a trace nobody looked at for this long is dropped by ``purge`` (recomputable)
        self._items: OrderedDict[Hashable, tuple[Trace, int]] = OrderedDict()
        self._used: dict[Hashable, float] = {}
        self._computing: dict[Hashable, threading.Lock] = {}  # keys being computed now
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get_or_compute(self, key: Hashable, compute: Callable[[], Trace]) -> Trace:
        """The kept trace, or ``compute()`` once: concurrent misses on one key wait for the first one's result
        (a page asks for the grid, a heatmap and the arithmetic of one trace at once)."""
        with self._lock:
            hit = self._hit(key)
            if hit is not None:
                return hit
            key_lock = self._computing.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                hit = self._hit(key)
                if hit is not None:
                    return hit
            try:
                trace = compute()
            finally:
                with self._lock:
                    self._computing.pop(key, None)
            size = trace.nbytes()
            with self._lock:
                self.misses += 1
                if size <= max(self.max_bytes, self.keep_one_bytes) and key not in self._items:
                    while self._items and self.bytes + size > self.max_bytes:
                        old_key, (_, old) = self._items.popitem(last=False)
                        self._used.pop(old_key, None)
                        self.bytes -= old
                    self._items[key] = (trace, size)
                    self._used[key] = time.monotonic()
                    self.bytes += size
            return trace

    def _hit(self, key: Hashable) -> Trace | None:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        self._used[key] = time.monotonic()
        self.hits += 1
        return self._items[key][0]

    def purge(self) -> int:
        """Drop traces idle for more than ``ttl_s``; returns how many."""
        now = time.monotonic()
        with self._lock:
            old = [k for k in self._items if now - self._used.get(k, now) > self.ttl_s]
            for k in old:
                _, size = self._items.pop(k)
                self._used.pop(k, None)
                self.bytes -= size
            return len(old)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._used.clear()
            self.bytes = 0
