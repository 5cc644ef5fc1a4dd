"""Traces kept in memory while a user clicks around, bounded by a byte budget (LRU), slimmed to what pages show.

A full capture holds every hooked tensor: at T=200 on DistilGPT-2 about 115 MB, most of it the logits of
every position (T × 50 257 floats), the MLP hidden states and the KV cache (the same numbers as K and V).
The pages read only the tensors in ``PAGE_TENSORS``: embeddings, Q/K/V per head, each row's log-sum-exp (the
attention weights are computed from these, never stored: ``app/model/trace.py``), each head's output, and the
next-token distribution (``probs``, the last position only, from which the top-k is taken). ``slim`` keeps those
and nothing else. The shape trace was read off every tensor at capture time, so it still lists them all.

A long prompt (more than ``Settings.full_trace_max_tokens`` tokens) keeps at every position only what attention
is read from — q, k, v, log-sum-exp — and the embedding rows; the tensors one query's panels read (each head's
output, q and k before rotation, each layer's residual stream) it keeps at its last ``LENS_POSITIONS`` positions,
where the logit lens reads the residual stream and Inspect's default query sits (``TAIL_ONLY``; the trace
recomputes them elsewhere). Its size, ``trace_bytes``, is O(layers · T · heads · Dh): 8 192 tokens of
SmolLM2-135M hold ~0.92 GiB.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

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


# Per-position tensors a long prompt's capture keeps at its last positions only (hooked: the heads' outputs are
# the output projection's input), and the derived ones ``slim`` cuts the same way.
LENS_POSITIONS = 12
TAIL_ONLY = (".attn.merged", ".resid_out")
TAIL_DERIVED = (".attn.q_prerope", ".attn.k_prerope")


def tail_only(name: str) -> bool:
    return name.endswith(TAIL_ONLY)


def trace_bytes(adapter, n_tokens: int, *, full: bool) -> int:
    """Bytes ``slim`` keeps of a prefill of ``n_tokens`` (``full``: every position of every page tensor; else the
    long-prompt layout above), from the model's sizes alone — before any forward. Per token and layer: q (H·Dh),
    k and v (2·H_kv·Dh), the log-sum-exp (H); with ``full`` also each head's output (H·Dh), the residual stream
    (D) and, for rotary models, q and k before rotation ((H + H_kv)·Dh); per token, the embedding rows."""
    a = adapter
    per_layer = a.n_head * a.head_dim + 2 * a.n_kv_head * a.head_dim + a.n_head
    tail_layer = a.n_head * a.head_dim + a.d_model + ((a.n_head + a.n_kv_head) * a.head_dim if a.rotary else 0)
    # embedding rows: wte, wpe and h0 = wte + wpe (GPT-2); wte and h0 = wte · scale (Gemma); h0 is wte itself (Llama)
    embeds = (3 if a.position_table is not None else 2 if a.embed_scale != 1 else 1) * a.d_model
    item = torch.finfo(a.dtype).bits // 8
    rows = n_tokens if full else min(n_tokens, LENS_POSITIONS)
    return item * (a.n_layer * (per_layer * n_tokens + tail_layer * rows) + embeds * n_tokens + 2 * a.vocab_size)


def check_trace_fits(adapter, n_tokens: int, settings) -> None:
    """Refuse, before any forward, a prompt longer than ``max_context_tokens`` or whose trace would not fit the
    memory one trace may hold (``trace_keep_one_bytes``, or the whole cache when that is larger)."""
    from app.errors import BadInput

    s = settings
    if n_tokens > s.max_context_tokens:
        raise BadInput("err.prompt.context", n=f"{n_tokens:,}", limit=f"{s.max_context_tokens:,}")
    budget = max(s.trace_cache_bytes, s.trace_keep_one_bytes)
    full = n_tokens <= s.full_trace_max_tokens
    size = trace_bytes(adapter, n_tokens, full=full)
    if size > budget:
        fit = n_tokens
        while fit > 1 and trace_bytes(adapter, fit, full=fit <= s.full_trace_max_tokens) > budget:
            fit = fit * 9 // 10
        raise BadInput("err.prompt.trace_bytes", n=f"{n_tokens:,}", size=f"{size / 2**20:,.0f}",
                       limit=f"{budget / 2**20:,.0f}", fit=f"{fit:,}")


def shape_only(name: str) -> bool:
    """True for a tensor ``slim`` would drop and nothing is derived from (``SHAPE_ONLY``)."""
    return name.endswith(SHAPE_ONLY) and not name.endswith(PAGE_TENSORS)


def slim(trace: Trace) -> Trace:
    """The same trace with only ``PAGE_TENSORS`` kept and no KV cache (keys and values are its K and V); a long
    prompt's (captured with ``tail_only``) keeps q and k before rotation at its tail as well."""
    if trace.past_length:  # a decode step's trace reads older keys from the cache: keep it whole
        return trace
    tail = trace.meta.get("tail")
    kept = {name: (t[..., -tail:, :].clone() if tail and name.endswith(TAIL_DERIVED) else t)
            for name, t in trace.tensors.items() if name.endswith(PAGE_TENSORS)}
    return Trace(token_ids=trace.token_ids, token_texts=trace.token_texts, tensors=kept, steps=trace.steps,
                 adapter=trace.adapter, past_length=0, cache=None, meta=trace.meta)


class TraceStore:
    """Traces kept while browsers click around, each one its browser's (the one that computed it), bounded in bytes.

    Two kinds, by size against ``max_bytes`` (``Settings.trace_cache_bytes``):

    - **short** traces (at most ``max_bytes``) share ``max_bytes`` among all browsers, least recently used first out:
      cheap to recompute;
    - **long** ones (larger, at most ``keep_one_bytes``: a long prompt's page reads it for every panel and tile) are
      never dropped for another browser's short trace. One goes only when it has been idle for ``hold_s``
      (``purge``; ``Settings.trace_hold_s``, minutes: a page showing it says it is open, ``touch``), when its own
      browser's newer traces need the room (each browser holds at most ``browser_bytes`` in all,
      ``Settings.trace_browser_bytes``), or when another browser's *long* trace needs the room and it is the least
      recently used long one. A short trace that does not fit beside the long ones kept is returned, not kept.

    A trace larger than both budgets is returned to the caller but not kept. Memory held, at every moment (room is
    made before the forward, from its ``expected`` size): at most ``max(max_bytes, keep_one_bytes)`` in all, at most
    ``max_bytes`` of it short traces, at most ``browser_bytes`` of it one browser's.

    A trace is shared by key (the same model and tokens); the browser whose request computed it owns it (``owner``,
    passed by the caller: the ``Requester``'s owner a route hands the lab; "" the server itself).
    """

    def __init__(self, max_bytes: int, ttl_s: float = float("inf"), keep_one_bytes: int = 0,
                 browser_bytes: int | None = None, hold_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``hold_s``: a long trace's idle time before ``purge`` drops it (default ``ttl_s``); ``clock``: the
        store's seconds (a test passes its own)."""
        self.max_bytes = max_bytes
        self.hold_s = ttl_s if hold_s is None else hold_s
        self.clock = clock
        self.keep_one_bytes = keep_one_bytes
        self.browser_bytes = browser_bytes  # None: a browser may hold the whole store
        self.ttl_s = ttl_s  # a trace nobody looked at for this long is dropped by ``purge`` (recomputable)
        self._items: OrderedDict[Hashable, tuple[Trace, int]] = OrderedDict()
        self._owner: dict[Hashable, str] = {}
        self._used: dict[Hashable, float] = {}
        self._computing: dict[Hashable, threading.Lock] = {}  # keys being computed now
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def cap(self) -> int:
        """The most the store holds in all."""
        return max(self.max_bytes, self.keep_one_bytes)

    def _browser_cap(self) -> int:
        return self.cap if self.browser_bytes is None else min(self.browser_bytes, self.cap)

    def get_or_compute(self, key: Hashable, compute: Callable[[], Trace], expected: int = 0,
                       *, owner: str) -> Trace:
        """The kept trace, or ``compute()`` once: concurrent misses on one key wait for the first one's result
        (a page asks for the grid, a heatmap and the arithmetic of one trace at once).

        ``expected``: the bytes the new trace will hold (``trace_bytes``). Room is made before the forward, by the
        rules of the class docstring, so a long capture never runs beside a full store. ``owner``: the browser
        the new trace is kept for (the caller's ``Requester.owner``; "" the server itself)."""
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
                if expected:
                    self._make_room(expected, owner)
            try:
                trace = compute()
            finally:
                with self._lock:
                    self._computing.pop(key, None)
            size = trace.nbytes()
            with self._lock:
                self.misses += 1
                if size <= self.cap and key not in self._items and self._make_room(size, owner):
                    self._items[key] = (trace, size)
                    self._owner[key] = owner
                    self._used[key] = self.clock()
                    self.bytes += size
            return trace

    # --- internals (store lock held) -----------------------------------------------------------------------------
    def _long(self, size: int) -> bool:
        return size > self.max_bytes

    def _drop(self, key: Hashable) -> None:
        _, size = self._items.pop(key)
        self._owner.pop(key, None)
        self._used.pop(key, None)
        self.bytes -= size

    def _lru(self, pick: Callable[[Hashable, int], bool]) -> Hashable | None:
        return next((k for k, (_, size) in self._items.items() if pick(k, size)), None)

    def _make_room(self, size: int, owner: str) -> bool:
        """Drop what the rules allow until a trace of ``size`` bytes for ``owner`` fits; True if it does now."""
        long = self._long(size)
        # 1. the browser's own budget: its least recently used traces first
        while sum(s for k, (_, s) in self._items.items() if self._owner.get(k) == owner) + size > self._browser_cap():
            victim = self._lru(lambda k, _s: self._owner.get(k) == owner)
            if victim is None:
                break
            self._drop(victim)
        # 2. short traces share max_bytes
        if not long:
            while sum(s for _, s in self._items.values() if not self._long(s)) + size > self.max_bytes:
                victim = self._lru(lambda _k, s: not self._long(s))
                if victim is None:
                    break
                self._drop(victim)
        # 3. the store's whole bound: short traces go first; a long one only for another long one
        while self.bytes + size > self.cap:
            victim = self._lru(lambda _k, s: not self._long(s))
            if victim is None and long:
                victim = self._lru(lambda _k, s: self._long(s))
            if victim is None:
                break
            self._drop(victim)
        own = sum(s for k, (_, s) in self._items.items() if self._owner.get(k) == owner)
        return self.bytes + size <= self.cap and own + size <= self._browser_cap()

    def _hit(self, key: Hashable) -> Trace | None:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        self._used[key] = self.clock()
        self.hits += 1
        return self._items[key][0]

    def holds(self, key: Hashable) -> bool:
        """Whether the trace of ``key`` is kept now (nothing computed, nothing touched)."""
        with self._lock:
            return key in self._items

    def touch(self, key: Hashable) -> bool:
        """A page showing the trace of ``key`` is still open: it counts as used now (its idle time starts again,
        and it is the most recently used: the last a long one's room is taken from). False if it is not kept."""
        with self._lock:
            if key not in self._items:
                return False
            self._items.move_to_end(key)
            self._used[key] = self.clock()
            return True

    def owner_bytes(self, owner: str) -> int:
        """Bytes kept for one browser."""
        with self._lock:
            return sum(s for k, (_, s) in self._items.items() if self._owner.get(k) == owner)

    def purge(self) -> int:
        """Drop traces idle for more than ``ttl_s`` (a long one: ``hold_s``); returns how many."""
        now = self.clock()
        with self._lock:
            old = [k for k, (_, size) in self._items.items()
                   if now - self._used.get(k, now) > (self.hold_s if self._long(size) else self.ttl_s)]
            for k in old:
                self._drop(k)
            return len(old)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._owner.clear()
            self._used.clear()
            self.bytes = 0
