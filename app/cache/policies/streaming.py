"""StreamingLLM (Xiao et al., 2023): keep S "attention sink" tokens and the W most recent ones.

Rule: every head of every layer keeps positions 0 .. S-1 (the sinks) and the last W tokens; everything in
between is dropped. Budget = S + W.

Why sinks: softmax must hand out a total weight of 1 even when no key is relevant, and trained models
learn to park that surplus on the first tokens (which every later token can see). Dropping them shifts
that mass onto other tokens and the model falls apart; keeping a few restores it.

Positions. For RoPE models the paper caches keys *before* rotation and rotates them by their place in the
cache, not in the text: with n kept tokens the keys sit at 0 .. n-1 and the query at n-1, so distances
never exceed what the model saw in training. Here the store keeps the pre-rotation keys (the adapter hands
them over through ``prerope_k``) and rotates them at every read. Only distances matter to RoPE
(q(m)·k(n) depends on m - n), so the keys are rotated to ``cache index + (query position - (n-1))``, which
gives exactly the scores of a query at n-1. ``rerotate=False`` keeps the keys as rotated at their original
positions, the variant the arena shows beside it.

GPT-2 adds a learned absolute position embedding before K/V are computed, so its cached K/V already carry
their original positions and cannot be moved: for GPT-2 StreamingLLM is sinks + window at absolute positions.
"""

from __future__ import annotations

import torch

from app.cache.policies.base import EvictingKVStore, held


class StreamingLLMStore(EvictingKVStore):
    name = "streaming"

    def __init__(self, *, sinks: int = 4, adapter=None, rerotate: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.sinks = min(sinks, self.budget)
        self.adapter = adapter
        self.rerotate = bool(rerotate and adapter is not None and adapter.rotary)
        self._pre: dict[int, torch.Tensor] = {}

    def prerope_k(self, layer: int, k: torch.Tensor) -> None:
        self._pre[layer] = k

    def stored_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        if self.rerotate:
            return self._pre.pop(layer)  # keep the keys before rotation
        return k

    def read_keys(self, layer: int) -> torch.Tensor:
        if not self.rerotate:
            return held(self.k, layer)
        return self.adapter.rotate(held(self.k, layer), self.cache_places(layer), layer)

    def cache_places(self, layer: int) -> torch.Tensor:
        """Where the kept keys are rotated to: cache index, shifted so the newest query sits at its position."""
        n = held(self.k, layer).shape[1]
        last = self.length + self._new - 1  # the newest query's position
        return torch.arange(n) + (last - (n - 1))

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Re-rotated keys are also masked at their cache places: a layer's own sliding window (Gemma 3) then
        counts kept tokens, as the model run on the kept tokens alone would."""
        keys, values, positions = super().attend_kv(layer, k, v)
        return keys, values, self.cache_places(layer) if self.rerotate else positions

    def choose(self, layer: int, n: int) -> torch.Tensor:
        recent = self.budget - self.sinks
        idx = torch.cat((torch.arange(self.sinks), torch.arange(n - recent, n)))
        return idx.expand(self.n_kv_head, -1)
