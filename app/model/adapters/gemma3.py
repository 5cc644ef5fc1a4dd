"""Gemma 3 family (text): gemma-3-270m, gemma-3-1b (``gemma3_text``).

A Llama-shaped decoder with four differences, all read from the config:

  * local and global layers: five of every six layers attend through a sliding window (512 tokens on
    gemma-3-270m, rotary base 10 000), the sixth to everything (rotary base 1 000 000); ``config.layer_types``
    says which is which, and each layer's ``LayerAttention`` carries its window and base. transformers' cache keeps
    only the last ``window - 1`` K/V of a local layer (the next query's own key makes ``window``).
  * scores scaled by ``query_pre_attn_scalar ** -0.5`` (256 on gemma-3-270m, which is head_dim anyway).
  * embeddings multiplied by √d_model on the way in (the table itself is plain; the tied unembedding reads it as is).
  * "sandwich" norms: RMSNorm after attention and after the MLP as well as before them, RMSNorm on q and k per
    head, every RMSNorm scaling by (1 + weight); the MLP is a gated GELU (down(gelu(gate(x)) · up(x))).

gemma-3-270m: 18 layers, 4 query heads on 1 KV head (multi-query attention), head_dim 256, d_model 640.

Its hook points (the shared ones, see ``base``, and its own: ``attn.q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``mlp.gate``, ``mlp.up``, ``mlp.down``) are declared once, in ``hook_points``, each with its shape beside it in
TransformerLens's axis names (checked on a forward by tests/model/test_hook_shapes.py). Derived from them::

    blocks.{i}.attn.q_prerope   # (B, H, T, Dh)     the same as q_proj, named as the Llama family names it
    blocks.{i}.attn.k_prerope   # (B, H_kv, T, Dh)

``embed.wte`` is the table row; ``embed.h0`` the row times √d_model.
"""

from __future__ import annotations

import torch

from app.model.adapters.base import HookPoint, LayerAttention
from app.model.adapters.llama import LlamaAdapter


class Gemma3Adapter(LlamaAdapter):
    family = "gemma3"
    model_types = ("gemma3_text",)
    mlp_kind = "geglu"
    post_norms = True  # RMSNorm after attention and after the MLP too ("sandwich" norms)

    def read_sizes(self, config) -> None:
        super().read_sizes(config)
        self.qk_norm = True
        self.embed_scale = config.hidden_size**0.5

    def read_attention(self, layer: int) -> LayerAttention:
        c = self.config
        kind = c.layer_types[layer]  # "sliding_attention" | "full_attention"
        return LayerAttention(scale=c.query_pre_attn_scalar**-0.5,
                               window=c.sliding_window if kind == "sliding_attention" else None,
                               softcap=getattr(c, "attn_logit_softcapping", None),
                               rope_base=c.rope_parameters[kind]["rope_theta"])

    # --- hooks -----------------------------------------------------------------------------------
    def hook_points(self) -> list[HookPoint]:
        part, params = self.part, self.params
        points = [
            # [batch, pos]: the ids; ``derive`` looks their rows up
            HookPoint("embed.wte", part("model.embed_tokens"), "input0", params("model.embed_tokens")),
            # [batch, pos, d_model]: rows * sqrt(d_model)
            HookPoint("embed.h0", part("model.embed_tokens"), "output", ()),
        ]
        for i in range(self.n_layer):
            p, b = f"model.layers.{i}", f"blocks.{i}"
            at, mlp = f"{p}.self_attn", f"{p}.mlp"
            pre_ff, post_ff = f"{p}.pre_feedforward_layernorm", f"{p}.post_feedforward_layernorm"  # around the MLP
            points += [
                # [batch, pos, d_model]
                HookPoint(f"{b}.ln_1", part(f"{p}.input_layernorm"), "output", params(f"{p}.input_layernorm")),
                # [batch, head, pos, d_head]: after q_norm, before rotation
                HookPoint(f"{b}.attn.q_proj", part(f"{at}.q_norm"), "output",
                          params(f"{at}.q_proj") + params(f"{at}.q_norm")),
                # [batch, head_kv, pos, d_head]: after k_norm
                HookPoint(f"{b}.attn.k_proj", part(f"{at}.k_norm"), "output",
                          params(f"{at}.k_proj") + params(f"{at}.k_norm")),
                # [batch, pos, head_kv * d_head]
                HookPoint(f"{b}.attn.v_proj", part(f"{at}.v_proj"), "output", params(f"{at}.v_proj")),
                HookPoint(f"{b}.attn.lse", part(at), "output1", ()),  # [batch, head, pos]
                HookPoint(f"{b}.attn.merged", part(f"{at}.o_proj"), "input0", ()),  # [batch, pos, head * d_head]
                # [batch, pos, d_model]: before the norm after attention
                HookPoint(f"{b}.attn.o_proj", part(f"{at}.o_proj"), "output", params(f"{at}.o_proj")),
                HookPoint(f"{b}.attn.out", part(f"{p}.post_attention_layernorm"), "output",  # [batch, pos, d_model]
                          params(f"{p}.post_attention_layernorm")),
                HookPoint(f"{b}.resid_mid", part(pre_ff), "input0", ()),  # [batch, pos, d_model]
                HookPoint(f"{b}.ln_2", part(pre_ff), "output", params(pre_ff)),  # [batch, pos, d_model]
                # [batch, pos, d_mlp]
                HookPoint(f"{b}.mlp.gate", part(f"{mlp}.gate_proj"), "output", params(f"{mlp}.gate_proj")),
                # [batch, pos, d_mlp]
                HookPoint(f"{b}.mlp.up", part(f"{mlp}.up_proj"), "output", params(f"{mlp}.up_proj")),
                # [batch, pos, d_mlp]: act(gate) * up
                HookPoint(f"{b}.mlp.hidden", part(f"{mlp}.down_proj"), "input0", ()),
                # [batch, pos, d_model]: before the norm after the MLP
                HookPoint(f"{b}.mlp.down", part(f"{mlp}.down_proj"), "output", params(f"{mlp}.down_proj")),
                HookPoint(f"{b}.mlp.out", part(post_ff), "output", params(post_ff)),  # [batch, pos, d_model]
                HookPoint(f"{b}.resid_out", part(p), "output", ()),  # [batch, pos, d_model]
            ]
        points += [
            HookPoint("ln_f", part("model.norm"), "output", params("model.norm")),  # [batch, pos, d_model]
            # [batch, pos, d_vocab]
            HookPoint("logits", self.model.lm_head, "output", (("lm_head.weight", self.model.lm_head.weight),)),
        ]
        return points

    # --- what derive() does differently (the loop itself is the Llama adapter's) ---------------------------
    def _embedding_rows(self, captured_wte: torch.Tensor) -> dict[str, torch.Tensor]:
        """The hook sees the token ids: ``embed.wte`` is their table rows (``embed.h0`` has a hook of its own)."""
        return {"embed.wte": torch.nn.functional.embedding(captured_wte, self.token_table)}  # (B, T, D)

    def _layer_rope(self, layer: int, captured: dict, positions: torch.Tensor, memo: dict):
        """cos, sin (1, T, Dh) of this layer's rotary base (local and global layers differ), each base once."""
        base = self.attention(layer).rope_base
        if base not in memo:
            cos, sin = self.rope_cos_sin(positions, layer)  # (T, Dh)
            memo[base] = cos[None], sin[None]
        return memo[base]

    def _qk_heads(self, captured: dict, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        return captured[prefix + "q_proj"], captured[prefix + "k_proj"]  # hooked after q/k norm: (B, n, T, Dh)

    # --- rotary positions: one base per kind of layer ------------------------------------------------
    def rope_cos_sin(self, positions: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        probe = self.token_table[:1].unsqueeze(0)  # only its dtype and device are read
        cos, sin = self.part("model.rotary_emb")(probe, positions.reshape(1, -1), self.config.layer_types[layer])
        return cos[0], sin[0]

    # --- block parts ---------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.part("model.embed_tokens")(ids)  # (1, T, D) rows · √d_model

    def attn_out(self, layer: int, merged: torch.Tensor) -> torch.Tensor:
        block = f"model.layers.{layer}"
        return self.part(f"{block}.post_attention_layernorm")(self.output_projection(layer)(merged))

    def mlp_branch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        b = f"model.layers.{layer}"
        before, after = self.part(f"{b}.pre_feedforward_layernorm"), self.part(f"{b}.post_feedforward_layernorm")
        return after(self.part(f"{b}.mlp")(before(h)))

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(h)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits
