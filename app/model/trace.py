"""A captured forward pass: every named tensor, the tokens, the cache, and the shape trace.

Captured tensors come from hooks on the real modules. Derived ones (q/k/v per head, per-head outputs,
raw and masked scores) are views or recomputations of captured tensors; the tests check each against
what transformers itself returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.model import attention
from app.model.adapters import ModelAdapter


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
    adapter: ModelAdapter
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
        return self.tensors[f"blocks.{layer}.attn.q"]  # (B, H, T, Dh) as attention uses them (rotated for RoPE)

    def k(self, layer: int) -> torch.Tensor:
        return self.tensors[f"blocks.{layer}.attn.k"]  # (B, H_kv, T, Dh) new tokens only

    def v(self, layer: int) -> torch.Tensor:
        return self.tensors[f"blocks.{layer}.attn.v"]  # (B, H_kv, T, Dh) new tokens only

    def keys(self, layer: int) -> torch.Tensor:
        """All keys the new tokens attend to (cached + new): (B, H_kv, Tk, Dh).

        A prefill's keys are its own; a later step reads the older ones from the cache (a sliding-window
        layer's cache holds only its last ``window - 1`` tokens: transformers drops the rest)."""
        if self.cache is not None and self.past_length:
            return self.adapter.layer_cache(self.cache, layer)[0][:, :, : self.total_length]
        return self.k(layer)

    def values(self, layer: int) -> torch.Tensor:
        if self.cache is not None and self.past_length:
            return self.adapter.layer_cache(self.cache, layer)[1][:, :, : self.total_length]
        return self.v(layer)

    def weights(self, layer: int) -> torch.Tensor:
        return self.tensors[f"blocks.{layer}.attn.weights"]  # (B, H, T, Tk)

    def attention_block(self, layer: int, head: int, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        """Exact softmax weights of one head for query rows ``rows`` (new tokens) and keys ``cols``: (r, c) float32,
        0 where a key is not allowed (future, outside the window). The one entry point for views that read a part
        of a head's map (tiles, cells, summaries)."""
        return self.weights(layer)[0, head, rows, cols].float()

    # --- recomputed from Q and K (app.model.attention, the one place attention is written) ------------
    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the new tokens (T,) and of every key they may read (Tk,)."""
        return torch.arange(self.past_length, self.total_length), torch.arange(self.total_length)

    def scores(self, layer: int, head: int | None = None) -> torch.Tensor:
        """Raw scores q·kᵀ·scale, every pair, future ones included: (B, H, T, Tk) (H = 1 for one head).

        Query head h reads KV head ``adapter.kv_map[h]`` (grouped-query attention)."""
        a = self.adapter
        q, k, kv_map = self.q(layer), self.keys(layer), a.kv_map
        if head is not None:
            q, kv_map = q[:, head : head + 1], (a.kv_map[head],)
        spec = a.spec(layer)
        return attention.scores(q, k, kv_map, spec.scale, spec.softcap)

    def causal_mask(self, layer: int = 0) -> torch.Tensor:
        """True where query i may read key j: j <= past + i, and inside ``layer``'s own window. (T, Tk)"""
        q_pos, k_pos = self.positions()
        return attention.allowed(q_pos, k_pos, self.adapter.window(layer))

    def masked_scores(self, layer: int, head: int | None = None) -> torch.Tensor:
        """Scores with future positions (and those outside the layer's window) set to -inf, what softmax receives."""
        return attention.masked(self.scores(layer, head), self.causal_mask(layer))

    def kv_head(self, head: int) -> int:
        return self.adapter.kv_map[head]

    def nbytes(self) -> int:
        """Bytes of memory the tensors hold (a storage shared by views counted once; shape-only ones hold none)."""
        seen: set[int] = set()
        total = 0
        for t in self.tensors.values():
            if t.is_meta:
                continue
            base = t.untyped_storage()
            if base.data_ptr() in seen:
                continue
            seen.add(base.data_ptr())
            total += base.nbytes()
        return total
