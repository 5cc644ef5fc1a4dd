"""SnapKV (Li et al., 2024): at prefill, the prompt's last tokens vote for the earlier tokens each head keeps.

Rule, per layer and per KV head, once, at the end of the prefill:

    window   the last ``window`` prompt tokens (the observation window) are always kept
    votes    attention those window queries give each earlier prompt token, summed over the window's
             queries and the query heads sharing the KV head                      (H_kv, T - window)
    pooling  a 1-D max-pool (kernel ``kernel``, stride 1) over positions, so a chosen token brings its
             neighbours and the kept set stays in readable clusters
    keep     the ``budget - reserve - window`` earlier tokens with the most pooled votes

SnapKV compresses the prompt only; tokens generated afterwards are appended. ``reserve`` is the room left
for them (the arena sets it to the number of decode steps), so the cache never exceeds the budget; past
the reserve, the oldest generated token is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.cache.policies.base import EvictingKVStore, held, top_with


class SnapKVStore(EvictingKVStore):
    name = "snapkv"

    def __init__(self, *, window: int = 16, kernel: int = 7, reserve: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.obs_window = window
        self.kernel = kernel
        self.reserve = min(reserve, self.budget - 1)
        self.votes: list[torch.Tensor | None] = [None] * self.n_layer  # (H_kv, T) pooled votes, prompt tokens

    def score(self, layer: int, weights_kv: torch.Tensor) -> None:
        if not self.prefill:
            return
        T = weights_kv.shape[1]
        w = min(self.obs_window, T)
        votes = weights_kv[:, T - w :, :].sum(dim=1)  # (H_kv, T)
        votes[:, T - w :] = 0  # the window itself is kept anyway
        pooled = F.max_pool1d(votes[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        self.votes[layer] = pooled[:, :T]

    def end(self, n_new: int) -> None:
        super().end(n_new)
        self.votes = [None] * self.n_layer  # one selection, at the end of the prefill

    def choose(self, layer: int, n: int) -> torch.Tensor:
        votes = self.votes[layer]
        if votes is not None:  # the end of the prefill: the one selection
            keep = max(1, self.budget - self.reserve)
            w = min(self.obs_window, n, keep)
            forced = torch.zeros(self.n_kv_head, n, dtype=torch.bool)
            forced[:, n - w :] = True
            idx = top_with(forced, votes, keep)
            self.votes[layer] = None
            return idx
        # decoding past the reserve: drop the oldest generated token (the oldest token if none was generated)
        generated = held(self.pos, layer) >= self.prompt_length  # (H_kv, n)
        first_gen = torch.where(generated.any(dim=1), generated.float().argmax(dim=1), torch.zeros(self.n_kv_head,
                                dtype=torch.long))
        slots = torch.arange(n).expand(self.n_kv_head, -1)
        drop = slots == first_gen[:, None]
        return slots[~drop].view(self.n_kv_head, n - 1)[:, -self.budget :]
