"""What every eviction policy shares: per-head kept K/V, a token budget, and the order of a step.

A policy's store keeps, per layer and per KV head, the K/V of at most ``budget`` tokens between steps.
Different heads may keep different tokens (H2O, SnapKV choose per head), so a layer's cache is::

    k, v   (H_kv, n, Dh)   kept keys / values, per head in position order
    pos    (H_kv, n)       the position each kept slot came from

The order of one step (the KV-store protocol ``ModelAdapter.forward_through`` drives)::

    begin(T)                 T new tokens (the whole prompt at prefill, then 1 per decode step)
    attend_kv(layer, k, v)   the query reads kept + new: n + T keys per head
    observe(layer, weights)  the softmax weights of that read, (H, T, n + T) (policies that score tokens)
    end(T)                   the policy drops each head down to ``budget`` tokens

So a step transiently holds budget + 1 tokens, like a cache that evicts after attending (H2O's rule); at
prefill the prompt's tokens attend to each other in full, as in every paper here, and the policy chooses
what stays from the whole prompt. With a budget as large as the sequence nothing is ever dropped and the
keys a query reads are the very tensors a plain cache would give it, so the output equals full attention
exactly.

Masking: after the prefill every kept key is in the past of the new query, so the positions handed back
for the causal mask only need to be ≤ the query's; a slot's position is the largest of its heads'. The
positions a policy reports (``kept_positions``) are the real per-head ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class EvictingKVStore(ABC):
    """Base of the token-dropping policies; subclasses implement ``choose`` (and may score tokens)."""

    window: int | None = None
    name = "evict"

    def __init__(self, *, budget: int, n_layer: int, n_kv_head: int, head_dim: int, kv_map) -> None:
        if budget < 1:
            raise ValueError("the budget must hold at least one token")
        self.budget = budget
        self.n_layer, self.n_kv_head, self.head_dim = n_layer, n_kv_head, head_dim
        self.kv_map = torch.as_tensor(list(kv_map), dtype=torch.long)  # query head -> KV head
        self.k: list[torch.Tensor | None] = [None] * n_layer  # (H_kv, n, Dh)
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.pos: list[torch.Tensor | None] = [None] * n_layer  # (H_kv, n)
        self.length = 0
        self.prompt_length = 0
        self._new = 0

    # --- the KV-store protocol -----------------------------------------------------------------------
    def begin(self, n_new: int) -> None:
        self._new = n_new

    @property
    def prefill(self) -> bool:
        return self.length == 0

    def stored_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """What the store keeps of this step's keys (as received; StreamingLLM keeps them before rotation)."""
        return k

    def read_keys(self, layer: int) -> torch.Tensor:
        """The keys attention reads, from what is kept (identity here; StreamingLLM re-rotates)."""
        return held(self.k, layer)

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        T = k.shape[1]
        new_pos = torch.arange(self.length, self.length + T)
        new_pos_h = new_pos.expand(self.n_kv_head, T)
        k = self.stored_keys(layer, k)
        old_k, old_v, old_pos = self.k[layer], self.v[layer], self.pos[layer]
        if old_k is None or old_v is None or old_pos is None:
            self.k[layer], self.v[layer], self.pos[layer] = k, v, new_pos_h.clone()
            mask_pos = new_pos
        else:
            self.k[layer] = torch.cat((old_k, k), dim=1)
            v = torch.cat((old_v, v), dim=1)
            self.v[layer] = v
            mask_pos = torch.cat((old_pos.amax(dim=0), new_pos))
            self.pos[layer] = torch.cat((old_pos, new_pos_h), dim=1)
        return self.read_keys(layer), v, mask_pos

    def observe(self, layer: int, weights: torch.Tensor) -> None:
        """Softmax weights (H, T, n) -> per KV head, summed over the query heads that share it: (H_kv, T, n)."""
        per_kv = torch.zeros(self.n_kv_head, *weights.shape[1:], dtype=weights.dtype)
        per_kv.index_add_(0, self.kv_map, weights)
        self.score(layer, per_kv)

    def score(self, layer: int, weights_kv: torch.Tensor) -> None:  # noqa: B027 (a hook, empty by default)
        """Policies that rank tokens by attention override this."""

    def end(self, n_new: int) -> None:
        if self.prefill:
            self.prompt_length = n_new
        self.length += n_new
        for layer in range(self.n_layer):
            n = held(self.k, layer).shape[1]
            if n > self.budget:
                idx = self.choose(layer, n)  # (H_kv, budget) slot indices
                idx = idx.sort(dim=1).values  # keep position order
                self.gather(layer, idx)

    @abstractmethod
    def choose(self, layer: int, n: int) -> torch.Tensor:
        """Which ``budget`` of the ``n`` slots each head keeps: (H_kv, budget) indices (each policy's rule)."""

    def gather(self, layer: int, idx: torch.Tensor) -> None:
        expand = idx[..., None].expand(-1, -1, self.head_dim)
        self.k[layer] = held(self.k, layer).gather(1, expand)
        self.v[layer] = held(self.v, layer).gather(1, expand)
        self.pos[layer] = held(self.pos, layer).gather(1, idx)

    # --- what the arena reads ---------------------------------------------------------------------------
    def kept_positions(self, layer: int) -> torch.Tensor:
        """(H_kv, n) positions each KV head holds now."""
        return held(self.pos, layer)

    @property
    def tokens_held(self) -> int:
        """Kept tokens per head, the largest over layers."""
        return max((p.shape[1] for p in self.pos if p is not None), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held (float32); bookkeeping (positions, scores) is not counted."""
        return sum(2 * k.numel() * k.element_size() for k in self.k if k is not None)


def held(per_layer: list[torch.Tensor | None], layer: int) -> torch.Tensor:
    """``per_layer[layer]``, which the layer's first ``attend_kv`` of the run set."""
    tensor = per_layer[layer]
    if tensor is None:
        raise RuntimeError(f"layer {layer} holds nothing yet: its first attend_kv comes before any read")
    return tensor


def recent_slots(pos: torch.Tensor, count: int) -> torch.Tensor:
    """(H_kv, n) positions -> (H_kv, n) bool: each head's ``count`` most recent slots (slots are in position order)."""
    n = pos.shape[1]
    out = torch.zeros_like(pos, dtype=torch.bool)
    if count > 0:
        out[:, max(0, n - count) :] = True
    return out


def top_with(forced: torch.Tensor, score: torch.Tensor, budget: int) -> torch.Tensor:
    """Per head: every forced slot, then the highest-scoring others until ``budget``: (H_kv, budget) indices.

    Ties go to the earlier slot (a stable sort), so a hand-made example has one answer.
    """
    rank = torch.where(forced, torch.full_like(score, float("inf")), score)
    order = torch.sort(rank, dim=1, descending=True, stable=True).indices
    return order[:, :budget]
