"""The model boundary: what every page, cache and view may know about a model.

Outside ``app/model/adapters/`` nothing knows a checkpoint's module names. Everything else speaks the
adapter's words:

  sizes        n_layer, n_head (query heads), n_kv_head (key/value heads), head_dim, d_model, d_mlp,
               max_positions, vocab_size, dtype
  kv_map       query head -> the KV head it reads (grouped-query attention; identity for plain MHA)
  embeddings   token_table (V, D); position_table (P, D) or None when positions are rotary (nothing added)
  hook points  named tensors in execution order (``blocks.3.attn.weights``), each with its module
  derive       per-head q / k / v as attention uses them (after rotation for RoPE models, with the
               pre-rotation q / k beside them), per-head outputs
  cache        ``layer_cache(cache, i)`` -> K, V of transformers' cache, (B, H_kv, T, Dh) each
  forward      ``forward_through(store, ids)``: the model's own modules, with attention done by
               ``app.model.attention.attend`` over K/V read from and written to an external store
               (paged, quantized, windowed, compressed ...)
  lens         ``final_norm(h)`` and ``unembed(h)`` (logit lens)
  ablation     ``ablate({layer: [heads]})``: a scoped hook that zeroes those heads' outputs

Hook names shared by every family (B batch, T new tokens, D width, H heads, H_kv KV heads, Dh head
width, Tk keys attended to = past + T, V vocabulary)::

    embed.wte                 # (B, T, D)       token-table row of each token
    embed.h0                  # (B, T, D)       the residual stream entering block 0
    blocks.{i}.ln_1           # (B, T, D)       norm before attention
    blocks.{i}.attn.q         # (B, H, T, Dh)   queries as attention uses them
    blocks.{i}.attn.k         # (B, H_kv, T, Dh) keys as cached
    blocks.{i}.attn.v         # (B, H_kv, T, Dh)
    blocks.{i}.attn.weights   # (B, H, T, Tk)   softmax weights
    blocks.{i}.attn.merged    # (B, T, H·Dh)    heads concatenated, input of the output projection
    blocks.{i}.attn.head_out  # (B, H, T, Dh)   the same, per head
    blocks.{i}.attn.out       # (B, T, D)
    blocks.{i}.resid_mid      # (B, T, D)
    blocks.{i}.ln_2           # (B, T, D)
    blocks.{i}.mlp.hidden     # (B, T, d_mlp)   input of the MLP's down projection
    blocks.{i}.mlp.out        # (B, T, D)
    blocks.{i}.resid_out      # (B, T, D)
    ln_f                      # (B, T, D)
    logits                    # (B, T, V)

Each family adds its own (``embed.wpe`` and ``attn.qkv`` for GPT-2; ``attn.q_proj``, ``attn.q_prerope``,
``rope.cos``, ``mlp.gate`` ... for Llama); its module docstring lists them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from app.model.attention import kv_map_for

Take = Literal["output", "output0", "output1", "input0"]


@dataclass(frozen=True)
class HookPoint:
    name: str  # stable dotted name of the tensor it captures
    module: nn.Module
    take: Take  # which tensor of the module's call to keep
    params: tuple[tuple[str, nn.Parameter], ...]  # parameters used by this step, for the shape trace


def params_of(module: nn.Module, prefix: str) -> tuple[tuple[str, nn.Parameter], ...]:
    return tuple((f"{prefix}.{n}", p) for n, p in module.named_parameters())


class ModelAdapter(ABC):
    """One model family. Subclasses set the class variables and implement the abstract methods."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.model_type values this adapter reads
    rotary: ClassVar[bool] = False  # positions enter as a rotation of q and k (RoPE), not an added table
    norm_kind: ClassVar[str] = "layernorm"  # "layernorm" | "rmsnorm"
    mlp_kind: ClassVar[str] = "gelu"  # "gelu" (fc -> act -> proj) | "swiglu" (act(gate) * up -> down)

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        if getattr(config, "model_type", None) not in self.model_types:
            raise ValueError(f"{type(self).__name__} does not read model_type={config.model_type!r}")
        if config._attn_implementation != "eager":
            raise ValueError("attention weights need eager attention (attn_implementation='eager')")
        self.model = model
        self.config = config
        self.dtype = next(model.parameters()).dtype
        self.read_sizes(config)
        self.kv_map: tuple[int, ...] = kv_map_for(self.n_head, self.n_kv_head)

    # --- sizes (set by read_sizes) -----------------------------------------------------------------
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_model: int
    d_mlp: int
    max_positions: int
    vocab_size: int

    @abstractmethod
    def read_sizes(self, config) -> None:
        """(abstract)"""

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for plain multi-head attention)."""
        return self.n_head // self.n_kv_head

    @property
    def attention_kind(self) -> str:
        if self.n_kv_head == self.n_head:
            return "MHA"
        return "MQA" if self.n_kv_head == 1 else "GQA"

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # --- embeddings --------------------------------------------------------------------------------
    @property
    @abstractmethod
    def token_table(self) -> torch.Tensor:  # (V, D)
        """The token embedding table."""

    @property
    def position_table(self) -> torch.Tensor | None:  # (P, D), or None for rotary positions
        return None

    # --- hooks and derived tensors -------------------------------------------------------------------
    @abstractmethod
    def hook_points(self) -> list[HookPoint]:
        """(abstract)"""

    @abstractmethod
    def derive(self, captured: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Captured tensors (in hook order) -> every named tensor in execution order, per-head ones added."""

    def split_heads(self, x: torch.Tensor, n_heads: int | None = None) -> torch.Tensor:
        """(B, T, n·Dh) -> (B, n, T, Dh)."""
        B, T, _ = x.shape
        return x.view(B, T, n_heads or self.n_head, self.head_dim).transpose(1, 2)

    # --- attention ----------------------------------------------------------------------------------
    def attn_scale(self, layer: int) -> float:
        """The factor scores are multiplied by (1/√Dh for the families here)."""
        return self.head_dim**-0.5

    @property
    def model_window(self) -> int | None:
        """A sliding window the model itself was trained with (None: full causal attention)."""
        return None

    def layer_cache(self, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached K and V of one layer as transformers keeps them: (B, H_kv, T_cached, Dh) each."""
        entry = cache.layers[layer]
        return entry.keys, entry.values

    # --- decoding through an external KV store -----------------------------------------------------------
    @abstractmethod
    def forward_through(self, store, ids: list[int]) -> torch.Tensor:
        """Run ``ids`` (the next T tokens) through the model reading and writing K/V via ``store``: logits (T, V).

        The store contract is ``app.cache.store.KVStore``: ``length`` (tokens stored), ``window`` (None or W),
        ``begin(T)`` (reserve room for T new tokens; raises before changing anything if it cannot),
        ``attend_kv(layer, k, v)`` -> (keys, values, key positions) with k, v of shape (H_kv, T, Dh), ``end(T)``,
        and ``nbytes``.

        Two optional methods, for compression policies (``app.cache.policies``); a store without them sees
        nothing more:

          ``observe(layer, weights)``  called after each layer's attention with the softmax weights
                                       (H, T, Tk), keys in the order ``attend_kv`` returned them (H2O, SnapKV)
          ``prerope_k(layer, k)``      RoPE families only: this step's keys before rotation (H_kv, T, Dh),
                                       called just before ``attend_kv`` (StreamingLLM re-rotates cached keys)
        """

    def check_room(self, start: int, n_new: int) -> None:
        from app.errors import BadInput

        if start + n_new > self.max_positions:
            raise BadInput("err.model.positions", positions=self.max_positions, needed=start + n_new)

    # --- rotary positions (RoPE families only) ---------------------------------------------------------
    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(f"{self.family} models have no rotary positions")

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate (..., T, Dh) vectors as if they sat at ``positions`` (T,)."""
        raise ValueError(f"{self.family} models have no rotary positions")

    def rope_pairs(self) -> list[tuple[int, int]]:
        """Which dimensions rotate together, one pair per frequency."""
        raise ValueError(f"{self.family} models have no rotary positions")

    # --- the residual stream read out (logit lens) -------------------------------------------------------
    @abstractmethod
    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """(abstract)"""

    @abstractmethod
    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """(abstract)"""

    # --- head ablation -----------------------------------------------------------------------------------
    @abstractmethod
    def output_projection(self, layer: int) -> nn.Module:
        """The module that takes the concatenated heads (B, T, H·Dh); used only by ``ablate``."""

    @contextmanager
    def ablate(self, heads: dict[int, list[int]]) -> Iterator[None]:
        """Zero the outputs of ``heads`` ({layer: [head, ...]}) for the forwards run inside the block."""
        handles = []
        dh = self.head_dim

        def make(hs: list[int]):
            def pre(_module, args):
                x = args[0].clone()
                for h in hs:
                    x[..., h * dh : (h + 1) * dh] = 0
                return (x, *args[1:])

            return pre

        try:
            for layer, hs in heads.items():
                if hs:
                    handles.append(self.output_projection(layer).register_forward_pre_hook(make(list(hs))))
            yield
        finally:
            for handle in handles:
                handle.remove()

    # --- what the pages say about the model ----------------------------------------------------------------
    def describe(self) -> dict:
        return {
            "family": self.family, "n_layer": self.n_layer, "n_head": self.n_head, "n_kv_head": self.n_kv_head,
            "head_dim": self.head_dim, "d_model": self.d_model, "d_mlp": self.d_mlp,
            "max_positions": self.max_positions, "vocab_size": self.vocab_size, "kv_map": list(self.kv_map),
            "attention_kind": self.attention_kind, "rotary": self.rotary, "norm": self.norm_kind,
            "mlp": self.mlp_kind, "position_table": self.position_table is not None,
        }
