"""Llama family: Llama 2/3, TinyLlama, SmolLM2 (``llama``), Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k RMSNorm).

No position table: positions enter as a rotation of q and k (RoPE) inside every attention layer. Separate
q/k/v projections, grouped-query attention (H_kv KV heads shared by H / H_kv query heads each), RMSNorm, a
SwiGLU MLP (down(silu(gate(x)) · up(x))). ``head_dim`` comes from the config where it is given (Qwen3-0.6B:
1024 / 16 = 64, but head_dim = 128).

RoPE in transformers' layout pairs dimension j with j + Dh/2 and turns each pair by the angle pos · θ_j::

    rotate(x, pos) = x · cos(pos·θ) + rotate_half(x) · sin(pos·θ),   rotate_half([x1, x2]) = [-x2, x1]

so q(m)·k(n) depends on m - n only. The cache keeps K after rotation.

Its hook points (the shared ones, see ``base``, and its own: ``rope.cos``/``rope.sin``, ``attn.q_proj``,
``k_proj``, ``v_proj``, ``mlp.gate``, ``mlp.up``) are declared once, in ``hook_points``, each with its shape beside it
in TransformerLens's axis names (checked on a forward by tests/model/test_hook_shapes.py). Derived from them::

    blocks.{i}.attn.q_prerope   # (B, H, T, Dh)     per head, before rotation
    blocks.{i}.attn.k_prerope   # (B, H_kv, T, Dh)
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from app.model.adapters.base import HookPoint, LayerAttention, ModelAdapter, apply_rope


class LlamaAdapter(ModelAdapter):
    family = "llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    rotary = True
    norm_kind = "rmsnorm"
    mlp_kind = "swiglu"

    def read_sizes(self, config) -> None:
        self.n_layer = config.num_hidden_layers
        self.n_head = config.num_attention_heads
        self.n_kv_head = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.d_model = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.d_mlp = config.intermediate_size
        self.max_positions = config.max_position_embeddings
        self.vocab_size = config.vocab_size
        self.qk_norm = config.model_type == "qwen3"

    @classmethod
    def qkv_parameters(cls, config, layer: int) -> dict[str, str]:
        return {p: f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qkv"}  # three Linear layers

    @property
    def token_table(self) -> torch.Tensor:
        return self.model.get_parameter("model.embed_tokens.weight")  # (V, D)

    def read_attention(self, layer: int) -> LayerAttention:
        c = self.config
        sliding = c.model_type == "mistral" or getattr(c, "use_sliding_window", False)  # Qwen: off unless set
        window = getattr(c, "sliding_window", None) if sliding else None
        base = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", None)
        return LayerAttention(scale=self.head_dim**-0.5, window=window, rope_base=base)

    # --- hooks -----------------------------------------------------------------------------------
    def hook_points(self) -> list[HookPoint]:
        part, params = self.part, self.params
        points = [
            # [batch, pos, d_model]
            HookPoint("embed.wte", part("model.embed_tokens"), "output", params("model.embed_tokens")),
            # [1, pos, d_head]: rotary_emb's cos of every position's angles
            HookPoint("rope.cos", part("model.rotary_emb"), "output0", ()),
            HookPoint("rope.sin", part("model.rotary_emb"), "output1", ()),  # [1, pos, d_head]
        ]
        for i in range(self.n_layer):
            p, b = f"model.layers.{i}", f"blocks.{i}"
            at, mlp = f"{p}.self_attn", f"{p}.mlp"
            q_src = part(f"{at}.q_norm" if self.qk_norm else f"{at}.q_proj")
            k_src = part(f"{at}.k_norm" if self.qk_norm else f"{at}.k_proj")
            q_params, k_params = params(f"{at}.q_proj"), params(f"{at}.k_proj")
            if self.qk_norm:
                q_params += params(f"{at}.q_norm")
                k_params += params(f"{at}.k_norm")
            points += [
                # [batch, pos, d_model]
                HookPoint(f"{b}.ln_1", part(f"{p}.input_layernorm"), "output", params(f"{p}.input_layernorm")),
                # [batch, pos, head * d_head]; q/k norm (Qwen3): after q_norm, [batch, pos, head, d_head]
                HookPoint(f"{b}.attn.q_proj", q_src, "output", q_params),
                # [batch, pos, head_kv * d_head]; q/k norm: [batch, pos, head_kv, d_head]
                HookPoint(f"{b}.attn.k_proj", k_src, "output", k_params),
                # [batch, pos, head_kv * d_head]
                HookPoint(f"{b}.attn.v_proj", part(f"{at}.v_proj"), "output", params(f"{at}.v_proj")),
                HookPoint(f"{b}.attn.lse", part(at), "output1", ()),  # [batch, head, pos]
                HookPoint(f"{b}.attn.merged", part(f"{at}.o_proj"), "input0", ()),  # [batch, pos, head * d_head]
                # [batch, pos, d_model]
                HookPoint(f"{b}.attn.out", part(f"{at}.o_proj"), "output", params(f"{at}.o_proj")),
                # [batch, pos, d_model]
                HookPoint(f"{b}.resid_mid", part(f"{p}.post_attention_layernorm"), "input0", ()),
                HookPoint(f"{b}.ln_2", part(f"{p}.post_attention_layernorm"), "output",  # [batch, pos, d_model]
                          params(f"{p}.post_attention_layernorm")),
                # [batch, pos, d_mlp]
                HookPoint(f"{b}.mlp.gate", part(f"{mlp}.gate_proj"), "output", params(f"{mlp}.gate_proj")),
                # [batch, pos, d_mlp]
                HookPoint(f"{b}.mlp.up", part(f"{mlp}.up_proj"), "output", params(f"{mlp}.up_proj")),
                # [batch, pos, d_mlp]: act(gate) * up
                HookPoint(f"{b}.mlp.hidden", part(f"{mlp}.down_proj"), "input0", ()),
                # [batch, pos, d_model]
                HookPoint(f"{b}.mlp.out", part(f"{mlp}.down_proj"), "output", params(f"{mlp}.down_proj")),
                HookPoint(f"{b}.resid_out", part(p), "output", ()),  # [batch, pos, d_model]
            ]
        points += [
            HookPoint("ln_f", part("model.norm"), "output", params("model.norm")),  # [batch, pos, d_model]
            # [batch, pos, d_vocab]
            HookPoint("logits", self.model.lm_head, "output", (("lm_head.weight", self.model.lm_head.weight),)),
        ]
        return points

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(B, T, n·Dh) or (B, T, n, Dh) -> (B, n, T, Dh)."""
        B, T = x.shape[:2]
        return x.reshape(B, T, n, self.head_dim).transpose(1, 2)

    def derive(self, captured: dict[str, torch.Tensor], positions: torch.Tensor,
               known: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        rope: dict = {}  # what ``_layer_rope`` worked out once and reuses for later layers
        for name, tensor in captured.items():
            if name.endswith(".attn.lse"):
                continue  # placed after q/k/v: the attention module's hook fires after o_proj's
            if name == "embed.wte":
                out.update(self._embedding_rows(tensor))
                continue
            out[name] = tensor
            if name.endswith(".attn.v_proj"):
                prefix = name[: -len("v_proj")]
                if known is not None and prefix + "q" in known:  # this layer's part made them in the forward
                    for part in ("q_prerope", "k_prerope", "q", "k", "v", "lse"):
                        out[prefix + part] = known[prefix + part]
                    continue
                cos, sin = self._layer_rope(int(name.split(".")[1]), captured, positions, rope)
                q_pre, k_pre = self._qk_heads(captured, prefix)
                out[prefix + "q_prerope"], out[prefix + "k_prerope"] = q_pre, k_pre
                out[prefix + "q"] = apply_rope(q_pre, cos, sin)
                out[prefix + "k"] = apply_rope(k_pre, cos, sin)
                out[prefix + "v"] = self._heads(tensor, self.n_kv_head)
                out[prefix + "lse"] = captured[prefix + "lse"]
            elif name.endswith(".attn.merged"):
                out[name[: -len("merged")] + "head_out"] = self.split_heads(tensor)
        return out

    # The three places a family of this kind may differ in ``derive`` (Gemma 3 overrides them).
    def _embedding_rows(self, captured_wte: torch.Tensor) -> dict[str, torch.Tensor]:
        """``embed.wte`` and ``embed.h0`` from the hooked embedding: rotary models add nothing to the row."""
        return {"embed.wte": captured_wte, "embed.h0": captured_wte}

    def _layer_rope(self, layer: int, captured: dict, positions: torch.Tensor, memo: dict):
        """cos, sin (1, T, Dh) that rotate layer ``layer``'s q and k: the rotary module's own, one for all layers."""
        return captured["rope.cos"], captured["rope.sin"]

    def _qk_heads(self, captured: dict, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k before rotation, (B, H, T, Dh) and (B, H_kv, T, Dh)."""
        return (self._heads(captured[prefix + "q_proj"], self.n_head),
                self._heads(captured[prefix + "k_proj"], self.n_kv_head))

    # --- rotary positions ------------------------------------------------------------------------
    def rope_cos_sin(self, positions: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of every position's angles, (T, Dh), from the model's own rotary module (one base for all)."""
        probe = self.token_table[:1].unsqueeze(0)  # only its dtype and device are read
        cos, sin = self.part("model.rotary_emb")(probe, positions.reshape(1, -1))
        return cos[0], sin[0]

    # --- block parts: h = embed[ids]; RMSNorm → q/k/v (→ q/k norm) → rotate → attend → o_proj; RMSNorm → SwiGLU
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.part("model.embed_tokens")(ids)  # (1, T, D): positions enter later, as a rotation

    def attn_in(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return self.part(f"model.layers.{layer}.input_layernorm")(h)

    def qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        at = f"model.layers.{layer}.self_attn"
        B, T = x.shape[:2]
        q, k = self.part(f"{at}.q_proj")(x), self.part(f"{at}.k_proj")(x)
        if self.qk_norm:
            q = self.part(f"{at}.q_norm")(q.view(B, T, self.n_head, self.head_dim))
            k = self.part(f"{at}.k_norm")(k.view(B, T, self.n_kv_head, self.head_dim))
        v = self.part(f"{at}.v_proj")(x)
        return self._heads(q, self.n_head), self._heads(k, self.n_kv_head), self._heads(v, self.n_kv_head)

    def attn_out(self, layer: int, merged: torch.Tensor) -> torch.Tensor:
        return self.output_projection(layer)(merged)

    def mlp_branch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        block = f"model.layers.{layer}"
        return self.part(f"{block}.mlp")(self.part(f"{block}.post_attention_layernorm")(h))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.part("model.norm")(h)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(h)

    def output_projection(self, layer: int) -> nn.Module:
        return self.part(f"model.layers.{layer}.self_attn.o_proj")
