"""GPT-2 family: GPT-2, DistilGPT-2, the built-in tiny model.

Learned absolute positions (a ``wpe`` table added to the token embedding), LayerNorm, one fused
projection ``c_attn`` for q, k and v, a GELU MLP, plain multi-head attention (H_kv = H).

Its hook points (the shared ones, see ``base``, and its own: ``embed.wpe``, ``attn.qkv``, ``mlp.fc``) are declared
once, in ``hook_points``, each with its shape beside it in TransformerLens's axis names (checked on a forward by
tests/model/test_hook_shapes.py).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from app.model.adapters.base import FusedQKV, HookPoint, LayerAttention, ModelAdapter


class GPT2Adapter(ModelAdapter):
    family = "gpt2"
    model_types = ("gpt2",)

    def read_sizes(self, config) -> None:
        self.n_layer = config.n_layer
        self.n_head = config.n_head
        self.n_kv_head = config.n_head  # plain multi-head attention
        self.d_model = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.d_mlp = config.n_inner or 4 * config.n_embd
        self.max_positions = config.n_positions
        self.vocab_size = config.vocab_size

    # --- parameters by role: one Conv1D, c_attn, makes q, k and v; its weight is stored (in, out) = (D, 3D) ----
    FUSED = re.compile(r"transformer\.h\.\d+\.attn\.c_attn\.(weight|bias)")

    @classmethod
    def qkv_parameters(cls, config, layer: int) -> dict[str, str]:
        return {"qkv": f"transformer.h.{layer}.attn.c_attn.weight"}

    @classmethod
    def fused_qkv(cls, config, name: str) -> FusedQKV | None:
        """Columns [0, D) of c_attn make q, [D, 2D) k, [2D, 3D) v: ``q, k, v = c_attn(x).split(D, dim=-1)``."""
        if not cls.FUSED.fullmatch(name):
            return None
        return FusedQKV(axis=-1, widths=(config.n_embd,) * 3)

    @property
    def token_table(self) -> torch.Tensor:
        return self.model.get_parameter("transformer.wte.weight")  # (V, D)

    @property
    def position_table(self) -> torch.Tensor:
        return self.model.get_parameter("transformer.wpe.weight")  # (n_positions, D)

    # kept for the pages' older names
    wte = token_table
    wpe = position_table

    def hook_points(self) -> list[HookPoint]:
        part, params = self.part, self.params
        points = [
            # [batch, pos, d_model]: wte row of each token
            HookPoint("embed.wte", part("transformer.wte"), "output", params("transformer.wte")),
            # [1, pos, d_model]: wpe row of each position
            HookPoint("embed.wpe", part("transformer.wpe"), "output", params("transformer.wpe")),
            # [batch, pos, d_model]: wte + wpe (after dropout)
            HookPoint("embed.h0", part("transformer.drop"), "output", ()),
        ]
        for i in range(self.n_layer):
            p, b = f"transformer.h.{i}", f"blocks.{i}"
            points += [
                # [batch, pos, d_model]
                HookPoint(f"{b}.ln_1", part(f"{p}.ln_1"), "output", params(f"{p}.ln_1")),
                # [batch, pos, 3 * d_model]: c_attn; q, k, v its three d_model-wide slices
                HookPoint(f"{b}.attn.qkv", part(f"{p}.attn.c_attn"), "output", params(f"{p}.attn.c_attn")),
                HookPoint(f"{b}.attn.lse", part(f"{p}.attn"), "output1", ()),  # [batch, head, pos]
                HookPoint(f"{b}.attn.merged", part(f"{p}.attn.c_proj"), "input0", ()),  # [batch, pos, head * d_head]
                # [batch, pos, d_model]
                HookPoint(f"{b}.attn.out", part(f"{p}.attn.c_proj"), "output", params(f"{p}.attn.c_proj")),
                HookPoint(f"{b}.resid_mid", part(f"{p}.ln_2"), "input0", ()),  # [batch, pos, d_model]
                # [batch, pos, d_model]
                HookPoint(f"{b}.ln_2", part(f"{p}.ln_2"), "output", params(f"{p}.ln_2")),
                # [batch, pos, d_mlp]: c_fc, before GELU
                HookPoint(f"{b}.mlp.fc", part(f"{p}.mlp.c_fc"), "output", params(f"{p}.mlp.c_fc")),
                HookPoint(f"{b}.mlp.hidden", part(f"{p}.mlp.act"), "output", ()),  # [batch, pos, d_mlp]
                # [batch, pos, d_model]
                HookPoint(f"{b}.mlp.out", part(f"{p}.mlp.c_proj"), "output", params(f"{p}.mlp.c_proj")),
                HookPoint(f"{b}.resid_out", part(p), "output", ()),  # [batch, pos, d_model]
            ]
        points += [
            HookPoint("ln_f", part("transformer.ln_f"), "output", params("transformer.ln_f")),  # [batch, pos, d_model]
            # [batch, pos, d_vocab]
            HookPoint("logits", self.model.lm_head, "output", (("lm_head.weight", self.model.lm_head.weight),)),
        ]
        return points

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, 3D) -> q, k, v each (B, H, T, Dh): the same split and view GPT-2's forward does."""
        q, k, v = qkv.split(self.d_model, dim=2)  # (B, T, D) each
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    def derive(self, captured: dict[str, torch.Tensor], positions: torch.Tensor,
               known: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        # ``known`` is not needed: q, k and v are views of the fused projection, nothing is computed
        out: dict[str, torch.Tensor] = {}
        for name, tensor in captured.items():
            if name.endswith(".attn.lse"):
                continue  # placed with q/k/v below: the attention module's hook fires after c_proj's
            out[name] = tensor
            if name.endswith(".attn.qkv"):
                prefix = name[: -len("qkv")]
                out[prefix + "q"], out[prefix + "k"], out[prefix + "v"] = self.split_qkv(tensor)
                out[prefix + "lse"] = captured[prefix + "lse"]
            elif name.endswith(".attn.merged"):
                out[name[: -len("merged")] + "head_out"] = self.split_heads(tensor)
        return out

    def read_attention(self, layer: int) -> LayerAttention:
        config = self.config
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        return LayerAttention(scale=scale / (layer + 1) if config.scale_attn_by_inverse_layer_idx else scale)

    # --- block parts: h = wte[ids] + wpe[pos]; ln_1 → c_attn → attend → c_proj; ln_2 → MLP ------------------
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.part("transformer.wte")(ids) + self.part("transformer.wpe")(positions)[None]  # (1, T, D)

    def attn_in(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.part(f"transformer.h.{layer}.ln_1")(h)

    def qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.split_qkv(self.part(f"transformer.h.{layer}.attn.c_attn")(x))  # (1, H, T, Dh) each

    def attn_out(self, layer: int, merged: torch.Tensor) -> torch.Tensor:
        return self.output_projection(layer)(merged)

    def mlp_branch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        block = f"transformer.h.{layer}"
        return self.part(f"{block}.mlp")(self.part(f"{block}.ln_2")(h))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.part("transformer.ln_f")(h)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(h)

    def output_projection(self, layer: int) -> nn.Module:
        return self.part(f"transformer.h.{layer}.attn.c_proj")
