"""Everything specific to the GPT-2 architecture, in one place.

The capture engine, the decoder and the pages speak only in the names below (``blocks.3.attn.q``,
``blocks.3.attn.weights`` ...). A second architecture (say Llama: separate q/k/v projections, RoPE,
grouped-query attention with ``n_kv_head < n_head``) needs a second adapter that fills the same names;
nothing else has to change.

Hook points, in execution order, with the shape each produces (B batch, T new tokens, D model width,
H heads, Dh head width, Tk tokens attended to = past + T, V vocabulary)::

    embed.wte               # (B, T, D)    wte row of each token
    embed.wpe               # (1, T, D)    wpe row of each position
    embed.h0                # (B, T, D)    h0 = wte + wpe
    blocks.{i}.ln_1         # (B, T, D)
    blocks.{i}.attn.qkv     # (B, T, 3D)   fused projection c_attn
    blocks.{i}.attn.weights # (B, H, T, Tk) softmax(QK^T/sqrt(Dh) + causal mask)
    blocks.{i}.attn.merged  # (B, T, D)    heads concatenated, input of c_proj
    blocks.{i}.attn.out     # (B, T, D)    c_proj output
    blocks.{i}.resid_mid    # (B, T, D)    residual after attention
    blocks.{i}.ln_2         # (B, T, D)
    blocks.{i}.mlp.fc       # (B, T, 4D)   c_fc output, before GELU
    blocks.{i}.mlp.hidden   # (B, T, 4D)   after GELU
    blocks.{i}.mlp.out      # (B, T, D)    MLP output (c_proj)
    blocks.{i}.resid_out    # (B, T, D)    block output
    ln_f                    # (B, T, D)
    logits                  # (B, T, V)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Take = Literal["output", "output0", "output1", "input0"]


@dataclass(frozen=True)
class HookPoint:
    name: str  # stable dotted name of the tensor it captures
    module: nn.Module
    take: Take  # which tensor of the module's call to keep
    params: tuple[tuple[str, nn.Parameter], ...]  # parameters used by this step, for the shape trace


class GPT2Adapter:
    """GPT-2 family (GPT-2, DistilGPT-2, the built-in tiny model)."""

    family = "gpt2"

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        if getattr(config, "model_type", None) != "gpt2":
            raise ValueError(f"not a GPT-2-family model: model_type={config.model_type!r}")
        if config._attn_implementation != "eager":
            raise ValueError("attention weights need eager attention (attn_implementation='eager')")
        self.model = model
        self.n_layer: int = config.n_layer
        self.n_head: int = config.n_head
        self.n_kv_head: int = config.n_head  # GPT-2 is plain multi-head attention
        self.d_model: int = config.n_embd
        self.head_dim: int = config.n_embd // config.n_head
        self.d_mlp: int = config.n_inner or 4 * config.n_embd
        self.max_positions: int = config.n_positions
        self.vocab_size: int = config.vocab_size
        self.dtype = next(model.parameters()).dtype

    # --- parameters a page may show -------------------------------------------------------------
    @property
    def wte(self) -> torch.Tensor:
        return self.model.transformer.wte.weight  # (V, D)

    @property
    def wpe(self) -> torch.Tensor:
        return self.model.transformer.wpe.weight  # (n_positions, D)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # --- hooks -----------------------------------------------------------------------------------
    def hook_points(self) -> list[HookPoint]:
        tr = self.model.transformer

        def params(module: nn.Module, prefix: str) -> tuple[tuple[str, nn.Parameter], ...]:
            return tuple((f"{prefix}.{n}", p) for n, p in module.named_parameters())

        points = [
            HookPoint("embed.wte", tr.wte, "output", params(tr.wte, "transformer.wte")),
            HookPoint("embed.wpe", tr.wpe, "output", params(tr.wpe, "transformer.wpe")),
            HookPoint("embed.h0", tr.drop, "output", ()),
        ]
        for i, block in enumerate(tr.h):
            p = f"transformer.h.{i}"
            b = f"blocks.{i}"
            points += [
                HookPoint(f"{b}.ln_1", block.ln_1, "output", params(block.ln_1, f"{p}.ln_1")),
                HookPoint(f"{b}.attn.qkv", block.attn.c_attn, "output", params(block.attn.c_attn, f"{p}.attn.c_attn")),
                HookPoint(f"{b}.attn.weights", block.attn, "output1", ()),
                HookPoint(f"{b}.attn.merged", block.attn.c_proj, "input0", ()),
                HookPoint(f"{b}.attn.out", block.attn.c_proj, "output", params(block.attn.c_proj, f"{p}.attn.c_proj")),
                HookPoint(f"{b}.resid_mid", block.ln_2, "input0", ()),
                HookPoint(f"{b}.ln_2", block.ln_2, "output", params(block.ln_2, f"{p}.ln_2")),
                HookPoint(f"{b}.mlp.fc", block.mlp.c_fc, "output", params(block.mlp.c_fc, f"{p}.mlp.c_fc")),
                HookPoint(f"{b}.mlp.hidden", block.mlp.act, "output", ()),
                HookPoint(f"{b}.mlp.out", block.mlp.c_proj, "output", params(block.mlp.c_proj, f"{p}.mlp.c_proj")),
                HookPoint(f"{b}.resid_out", block, "output", ()),
            ]
        points += [
            HookPoint("ln_f", tr.ln_f, "output", params(tr.ln_f, "transformer.ln_f")),
            HookPoint("logits", self.model.lm_head, "output", (("lm_head.weight", self.model.lm_head.weight),)),
        ]
        return points

    # --- head layout -----------------------------------------------------------------------------
    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, 3D) -> q, k, v each (B, H, T, Dh): the same split and view GPT-2's forward does."""
        q, k, v = qkv.split(self.d_model, dim=2)  # (B, T, D) each
        B, T, _ = q.shape
        return tuple(t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # type: ignore[return-value]

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, H, T, Dh)."""
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

    def layer_cache(self, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached K and V of one layer as transformers keeps them: (B, H_kv, T_cached, Dh) each."""
        entry = cache.layers[layer]
        return entry.keys, entry.values
