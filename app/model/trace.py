"""A captured forward pass: every named tensor, the tokens, the cache, and the shape trace.

Captured tensors come from hooks on the real modules. Derived ones (q/k/v per head, per-head outputs,
raw and masked scores) are views or recomputations of captured tensors; the tests check each against
what transformers itself returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from app.model.adapter import GPT2Adapter


@dataclass(frozen=True)
class ShapeStep:
    """One step of a forward pass: the activation it produced and the parameters it used."""

    name: str  # dotted name, e.g. "blocks.0.attn.qkv"
    shape: tuple[int, ...]
    params: tuple[tuple[str, tuple[int, ...]], ...] = ()
    derived: bool = False  # computed from captured tensors rather than hooked from a module

    @property
    def layer(self) -> int | None:
        parts = self.name.split(".")
        return int(parts[1]) if parts[0] == "blocks" else None

    @property
    def op(self) -> str:
        """The name without its layer: "attn.qkv" for "blocks.0.attn.qkv"."""
        parts = self.name.split(".")
        return ".".join(parts[2:]) if parts[0] == "blocks" else self.name


@dataclass
class Trace:
    token_ids: list[int]  # the tokens fed in this forward (all of them for a prefill)
    token_texts: list[str]
    tensors: dict[str, torch.Tensor]  # every captured and derived tensor, in execution order
    steps: list[ShapeStep]
    adapter: GPT2Adapter
    past_length: int = 0  # tokens already in the cache before this forward
    cache: object | None = None  # transformers' Cache after this forward, if one was kept
    meta: dict = field(default_factory=dict)

    # --- names -----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def total_length(self) -> int:
        return self.past_length + self.n_tokens

    def q(self, layer: int) -> torch.Tensor:
        return self.tensors[f"blocks.{layer}.attn.q"]  # (B, H, T, Dh)

    def k(self, layer: int) -> torch.Tensor:
        return self.tensors[f"blocks.{layer}.attn.k"]  # (B, H, T, Dh) new tokens only

    def v(self, layer: int) -> torch.Tensor:
        return self.tensors[f"blocks.{layer}.attn.v"]  # (B, H, T, Dh) new tokens only

    def keys(self, layer: int) -> torch.Tensor:
        """All keys the new tokens attend to (cached + new): (B, H_kv, Tk, Dh)."""
        if self.cache is not None:
            return self.adapter.layer_cache(self.cache, layer)[0][:, :, : self.total_length]
        return self.k(layer)

    def values(self, layer: int) -> torch.Tensor:
        if self.cache is not None:
            return self.adapter.layer_cache(self.cache, layer)[1][:, :, : self.total_length]
        return self.v(layer)

    def weights(self, layer: int) -> torch.Tensor:
        return self.tensors[f"blocks.{layer}.attn.weights"]  # (B, H, T, Tk)

    # --- recomputed from Q and K -----------------------------------------------------------------
    def scores(self, layer: int, head: int | None = None) -> torch.Tensor:
        """Raw scores QK^T / sqrt(Dh), every pair, future ones included: (B, H, T, Tk)."""
        q, k = self.q(layer), self.keys(layer)
        if head is not None:
            q, k = q[:, head : head + 1], k[:, head : head + 1]
        return q @ k.transpose(-1, -2) / math.sqrt(self.adapter.head_dim)

    def causal_mask(self) -> torch.Tensor:
        """True where query i may read key j: j <= past + i. (T, Tk)"""
        rows = torch.arange(self.n_tokens).unsqueeze(1) + self.past_length
        cols = torch.arange(self.total_length).unsqueeze(0)
        return cols <= rows

    def masked_scores(self, layer: int, head: int | None = None) -> torch.Tensor:
        """Scores with future positions set to -inf, what softmax receives."""
        return self.scores(layer, head).masked_fill(~self.causal_mask(), float("-inf"))

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.tensors.values():
            base = t.untyped_storage()
            if base.data_ptr() in seen:
                continue
            seen.add(base.data_ptr())
            total += base.nbytes()
        return total
