"""A captured forward pass: every named tensor, the tokens, the cache, and the shape trace.

Captured tensors come from hooks on the real modules. Derived ones (q/k/v per head, per-head outputs,
raw and masked scores) are views or recomputations of captured tensors; the tests check each against
what transformers itself returned.

Attention weights are never stored (one head at 8 192 tokens is 256 MB; all of SmolLM2's would be 72 GB). The
trace keeps, per layer, the rotated q (B, H, T, Dh), k and v (B, H_kv, T, Dh) and each query row's log-sum-exp
(B, H, T) that the forward's fused kernel returned, and computes any weight from them, exactly:

    whole rows      ``weights``, ``attention_rows``: softmax of the row's masked scores (eager's arithmetic)
    any block       ``attention_block``: exp(q_i·k_j·scale − lse_i), 0 where key j is not allowed

so memory is O(layers · T · heads · Dh). A long prompt's trace may keep some per-position tensors at its last
``meta["tail"]`` positions only (``app/model/store.py``); ``head_out_row``, ``prerope_row`` and ``residuals``
read them wherever they are held and recompute the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import Cache

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
    cache: Cache | None = None  # transformers' Cache after this forward, if one was kept
    meta: dict = field(default_factory=dict)

    # --- names -----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors and name.startswith("blocks.") and name.endswith(".attn.weights"):
            return self.weights(int(name.split(".")[1]))  # computed, never stored
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

    def lse(self, layer: int) -> torch.Tensor:
        return self.tensors[f"blocks.{layer}.attn.lse"]  # (B, H, T) log Σ_j exp(score_ij) over allowed keys

    def weights_shape(self, layer: int) -> tuple[int, int, int, int]:
        q = self.tensors[f"blocks.{layer}.attn.q"]
        return (q.shape[0], q.shape[1], self.n_tokens, self.keys(layer).shape[-2])  # (B, H, T, Tk)

    def weights(self, layer: int) -> torch.Tensor:
        """Every head's softmax weights, (B, H, T, Tk) float32, computed from q and k now (for short prompts: a
        long one's views read ``attention_rows`` / ``attention_block`` instead). 0 where a key is not allowed."""
        return self.attention_rows(layer)[None]

    def attention_rows(self, layer: int, rows: slice = slice(None), heads: slice = slice(None)) -> torch.Tensor:
        """Whole rows of the weights: query rows ``rows`` (new tokens) of heads ``heads`` over every key,
        (H', r, Tk) float32. The softmax of each row's masked scores, as eager attention computes it."""
        a = self.adapter
        att = a.attention(layer)
        q = self.q(layer)[0, heads, rows]  # (H', r, Dh)
        kv_map = a.kv_map[heads]
        s = attention.scores(q, self.keys(layer)[0], kv_map, att.scale, att.softcap)  # (H', r, Tk)
        # The mask of these rows only (r, Tk): a band of a long prompt's rows never builds the whole (T, Tk) one.
        ok = attention.allowed(self.positions()[0][rows], self.key_positions(layer), att.window)
        return torch.softmax(attention.masked(s, ok, torch.finfo(s.dtype).min), dim=-1).float()

    def attention_block(self, layer: int, head: int, rows: slice = slice(None),
                        cols: slice = slice(None)) -> torch.Tensor:
        """Exact softmax weights of one head for query rows ``rows`` (new tokens) and keys ``cols``: (r, c) float32,
        0 where a key is not allowed (future, outside the window). The one entry point for views that read a part
        of a head's map (tiles, cells, summaries): exp(q_i·k_j·scale − lse_i), no other row or key needed."""
        s, ok, lse = self._block(layer, head, rows, cols)
        return attention.weights_from_lse(s, ok, lse)

    def score_block(self, layer: int, head: int, rows: slice = slice(None),
                    cols: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """The same block as ``attention_block`` before its exp: the scores (r, c) float32, -inf where a key is not
        allowed, and each row's log-sum-exp (r,). Its weights are exp(score − lse); a max over cells can be taken on
        the scores first (exp is increasing), so only one exp per pooled cell is needed (``app.viz.zoom``)."""
        s, ok, lse = self._block(layer, head, rows, cols)
        return s.masked_fill_(~ok, -math.inf), lse  # s is this call's own: filled in place

    def _block(self, layer: int, head: int, rows: slice, cols: slice) -> tuple[torch.Tensor, ...]:
        """One head's raw scores (r, c), the mask of allowed pairs (r, c) and the rows' log-sum-exp (r,)."""
        att = self.adapter.attention(layer)
        q = self.q(layer)[0, head, rows].float()  # (r, Dh)
        k = self.keys(layer)[0, self.adapter.kv_map[head], cols].float()  # (c, Dh)
        q_pos, k_pos = self.positions()[0], self.key_positions(layer)
        s = attention.scores(q[None], k[None], (0,), att.scale, att.softcap)[0]  # (r, c)
        ok = attention.allowed(q_pos[rows], k_pos[cols], att.window)
        return s, ok, self.lse(layer)[0, head, rows].float()

    # --- per-position tensors a long trace holds at its tail only ------------------------------------------
    @property
    def tail_start(self) -> int:
        """First position (of the new tokens) the tail-only tensors hold; 0 when they hold every position."""
        return max(0, self.n_tokens - self.meta["tail"]) if self.meta.get("tail") else 0

    def head_out_row(self, layer: int, head: int, pos: int) -> torch.Tensor:
        """What the model's attention gave head ``head`` at query ``pos``, (Dh,): the hooked output where the trace
        holds it; elsewhere (a long trace) the same fused kernel the forward ran, on that one query row."""
        start = self.tail_start
        if pos >= start:
            return self.tensors[f"blocks.{layer}.attn.head_out"][0, head, pos - start]
        a = self.adapter
        kv = a.kv_map[head]
        n = self.past_length + pos + 1
        att = a.attention(layer)
        q = self.q(layer)[:, head : head + 1, pos : pos + 1]  # (1, 1, 1, Dh)
        k, v = self.keys(layer)[:, kv : kv + 1, :n], self.values(layer)[:, kv : kv + 1, :n]  # (1, 1, n, Dh)
        ok = attention.allowed(torch.tensor([n - 1]), torch.arange(n), att.window)
        if att.softcap:
            out, _ = attention.attend_chunked(q, k, v, ok=ok, kv_map=(0,), scale=att.scale, softcap=att.softcap)
        else:
            out, _ = attention.kernel_attend(q, k, v, scale=att.scale, mask=ok[None, None])
        return out[0, 0, 0]

    def prerope_row(self, layer: int, which: str, head: int, pos: int) -> torch.Tensor:
        """q (``which="q"``, a query head) or k (a KV head) of new token ``pos`` before its rotation, (Dh,): the
        hooked one where the trace holds it; elsewhere (a long trace) the rotated one turned back by its position."""
        start = self.tail_start
        name = f"blocks.{layer}.attn.{which}_prerope"
        if name in self.tensors and pos >= start:
            return self.tensors[name][0, head, pos - start]
        x = (self.q(layer) if which == "q" else self.k(layer))[0, head, pos]
        return self.adapter.rotate(x[None], torch.tensor([-(self.past_length + pos)]), layer)[0]

    def residuals(self, last: int) -> tuple[int, list[torch.Tensor]]:
        """(start, [h0, block 0's output, …]) at positions start .. T-1, the last ``last`` (at most the tail held):
        the residual stream the logit lens reads, each (T - start, D)."""
        T = self.n_tokens
        start = max(0, T - last, self.tail_start)
        held = self.tail_start
        out = [self.tensors["embed.h0"][0, start:]]
        for i in range(self.adapter.n_layer):
            out.append(self.tensors[f"blocks.{i}.resid_out"][0, start - held :])
        return start, out

    # --- recomputed from Q and K (app.model.attention, the one place attention is written) ------------
    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the new tokens (T,) and of every key they may read (Tk,), on the device q is on."""
        device = self.tensors["embed.h0"].device if "embed.h0" in self.tensors else None
        return (torch.arange(self.past_length, self.total_length, device=device),
                torch.arange(self.total_length, device=device))

    def scores(self, layer: int, head: int | None = None) -> torch.Tensor:
        """Raw scores q·kᵀ·scale, every pair, future ones included: (B, H, T, Tk) (H = 1 for one head).

        Query head h reads KV head ``adapter.kv_map[h]`` (grouped-query attention)."""
        a = self.adapter
        q, k, kv_map = self.q(layer), self.keys(layer), a.kv_map
        if head is not None:
            q, kv_map = q[:, head : head + 1], (a.kv_map[head],)
        att = a.attention(layer)
        return attention.scores(q, k, kv_map, att.scale, att.softcap)

    def key_positions(self, layer: int) -> torch.Tensor:
        """Positions of the keys ``keys(layer)`` holds, (Tk,): every one, but a sliding-window layer's cache past
        its window holds only the last ``window - 1`` older ones."""
        k = self.keys(layer)
        return torch.arange(self.total_length - k.shape[-2], self.total_length, device=k.device)

    def causal_mask(self, layer: int = 0) -> torch.Tensor:
        """True where query i may read key j: j <= past + i, and inside ``layer``'s own window. (T, Tk)"""
        return attention.allowed(self.positions()[0], self.key_positions(layer), self.adapter.window(layer))

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
