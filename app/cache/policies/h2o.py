"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023): keep the tokens that drew the most attention, plus recent ones.

Rule, per layer and per KV head: every token kept accumulates the attention it receives from every query
(the prompt's queries at prefill, then each new token's), summed over the query heads that share the KV
head. When a head holds more than the budget it keeps its ``recent`` newest tokens and, of the rest, the
highest accumulated scores; the paper splits the budget half heavy hitters, half recent (its 20% = 10% + 10%).
A dropped token's score is gone with it (the greedy, one-token-at-a-time eviction of the paper).
"""

from __future__ import annotations

import torch

from app.cache.policies.base import EvictingKVStore, held, recent_slots, top_with


class H2OStore(EvictingKVStore):
    name = "h2o"

    def __init__(self, *, recent: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.recent = self.budget // 2 if recent is None else min(recent, self.budget)
        self.acc: list[torch.Tensor | None] = [None] * self.n_layer  # (H_kv, n) accumulated attention

    def score(self, layer: int, weights_kv: torch.Tensor) -> None:
        got = weights_kv.sum(dim=1)  # (H_kv, n): attention received from this step's queries
        old = self.acc[layer]
        if old is not None:
            got[:, : old.shape[1]] += old
        self.acc[layer] = got

    def choose(self, layer: int, n: int) -> torch.Tensor:
        forced = recent_slots(held(self.pos, layer), self.recent)
        return top_with(forced, held(self.acc, layer), self.budget)

    def gather(self, layer: int, idx: torch.Tensor) -> None:
        super().gather(layer, idx)
        self.acc[layer] = held(self.acc, layer).gather(1, idx)
