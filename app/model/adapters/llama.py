"""Llama family: Llama 2/3, TinyLlama, SmolLM2 (``llama``), Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k RMSNorm).

No position table: positions enter as a rotation of q and k (RoPE) inside every attention layer. Separate
q/k/v projections, grouped-query attention (H_kv KV heads shared by H / H_kv query heads each), RMSNorm, a
SwiGLU MLP (down(silu(gate(x)) · up(x))). ``head_dim`` comes from the config where it is given (Qwen3-0.6B:
1024 / 16 = 64, but head_dim = 128).

RoPE in transformers' layout pairs dimension j with j + Dh/2 and turns each pair by the angle pos · θ_j::

    rotate(x, pos) = x · cos(pos·θ) + rotate_half(x) · sin(pos·θ),   rotate_half([x1, x2]) = [-x2, x1]

so q(m)·k(n) depends on m - n only. The cache keeps K after rotation.

Family-specific hook points, besides the shared ones (see ``base``)::

    rope.cos, rope.sin          # (1, T, Dh)        cos/sin of every position's angles (rotary_emb output)
    blocks.{i}.attn.q_proj      # (B, T, H·Dh)      q projection (Qwen3: after q_norm, (B, T, H, Dh))
    blocks.{i}.attn.k_proj      # (B, T, H_kv·Dh)
    blocks.{i}.attn.v_proj      # (B, T, H_kv·Dh)
    blocks.{i}.attn.q_prerope   # (B, H, T, Dh)     derived: per head, before rotation
    blocks.{i}.attn.k_prerope   # (B, H_kv, T, Dh)
    blocks.{i}.mlp.gate         # (B, T, d_mlp)
    blocks.{i}.mlp.up           # (B, T, d_mlp)
"""

from __future__ import annotations

import torch
from torch import nn

from app.model.adapters.base import HookPoint, ModelAdapter, params_of
from app.model.attention import attend


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, T, Dh), cos/sin (B, T, Dh): the rotation transformers applies (same ops, same floats)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


class LlamaAdapter(ModelAdapter):
    family = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3")
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

    @property
    def _base(self) -> nn.Module:
        return self.model.model

    @property
    def token_table(self) -> torch.Tensor:
        return self._base.embed_tokens.weight  # (V, D)

    @property
    def model_window(self) -> int | None:
        c = self.config
        if c.model_type == "mistral":
            return getattr(c, "sliding_window", None)
        if c.model_type in ("qwen2", "qwen3") and getattr(c, "use_sliding_window", False):
            return getattr(c, "sliding_window", None)
        return None

    # --- hooks -----------------------------------------------------------------------------------
    def hook_points(self) -> list[HookPoint]:
        m = self._base
        points = [
            HookPoint("embed.wte", m.embed_tokens, "output", params_of(m.embed_tokens, "model.embed_tokens")),
            HookPoint("rope.cos", m.rotary_emb, "output0", ()),
            HookPoint("rope.sin", m.rotary_emb, "output1", ()),
        ]
        for i, layer in enumerate(m.layers):
            p, b = f"model.layers.{i}", f"blocks.{i}"
            at, mlp = layer.self_attn, layer.mlp
            q_src = at.q_norm if self.qk_norm else at.q_proj
            k_src = at.k_norm if self.qk_norm else at.k_proj
            q_params = params_of(at.q_proj, f"{p}.self_attn.q_proj")
            k_params = params_of(at.k_proj, f"{p}.self_attn.k_proj")
            if self.qk_norm:
                q_params += params_of(at.q_norm, f"{p}.self_attn.q_norm")
                k_params += params_of(at.k_norm, f"{p}.self_attn.k_norm")
            points += [
                HookPoint(f"{b}.ln_1", layer.input_layernorm, "output",
                          params_of(layer.input_layernorm, f"{p}.input_layernorm")),
                HookPoint(f"{b}.attn.q_proj", q_src, "output", q_params),
                HookPoint(f"{b}.attn.k_proj", k_src, "output", k_params),
                HookPoint(f"{b}.attn.v_proj", at.v_proj, "output", params_of(at.v_proj, f"{p}.self_attn.v_proj")),
                HookPoint(f"{b}.attn.weights", at, "output1", ()),
                HookPoint(f"{b}.attn.merged", at.o_proj, "input0", ()),
                HookPoint(f"{b}.attn.out", at.o_proj, "output", params_of(at.o_proj, f"{p}.self_attn.o_proj")),
                HookPoint(f"{b}.resid_mid", layer.post_attention_layernorm, "input0", ()),
                HookPoint(f"{b}.ln_2", layer.post_attention_layernorm, "output",
                          params_of(layer.post_attention_layernorm, f"{p}.post_attention_layernorm")),
                HookPoint(f"{b}.mlp.gate", mlp.gate_proj, "output", params_of(mlp.gate_proj, f"{p}.mlp.gate_proj")),
                HookPoint(f"{b}.mlp.up", mlp.up_proj, "output", params_of(mlp.up_proj, f"{p}.mlp.up_proj")),
                HookPoint(f"{b}.mlp.hidden", mlp.down_proj, "input0", ()),
                HookPoint(f"{b}.mlp.out", mlp.down_proj, "output", params_of(mlp.down_proj, f"{p}.mlp.down_proj")),
                HookPoint(f"{b}.resid_out", layer, "output", ()),
            ]
        points += [
            HookPoint("ln_f", m.norm, "output", params_of(m.norm, "model.norm")),
            HookPoint("logits", self.model.lm_head, "output", (("lm_head.weight", self.model.lm_head.weight),)),
        ]
        return points

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(B, T, n·Dh) or (B, T, n, Dh) -> (B, n, T, Dh)."""
        B, T = x.shape[:2]
        return x.reshape(B, T, n, self.head_dim).transpose(1, 2)

    def derive(self, captured: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        cos, sin = captured["rope.cos"], captured["rope.sin"]
        for name, tensor in captured.items():
            if name.endswith(".attn.weights"):
                continue  # placed after q/k/v: the attention module's hook fires after o_proj's
            out[name] = tensor
            if name == "embed.wte":
                out["embed.h0"] = tensor  # rotary models add nothing to the token embedding
            elif name.endswith(".attn.v_proj"):
                prefix = name[: -len("v_proj")]
                q_pre = self._heads(captured[prefix + "q_proj"], self.n_head)
                k_pre = self._heads(captured[prefix + "k_proj"], self.n_kv_head)
                out[prefix + "q_prerope"], out[prefix + "k_prerope"] = q_pre, k_pre
                out[prefix + "q"] = apply_rope(q_pre, cos, sin)
                out[prefix + "k"] = apply_rope(k_pre, cos, sin)
                out[prefix + "v"] = self._heads(tensor, self.n_kv_head)
                out[prefix + "weights"] = captured[prefix + "weights"]
            elif name.endswith(".attn.merged"):
                out[name[: -len("merged")] + "head_out"] = self.split_heads(tensor)
        return out

    # --- rotary positions ------------------------------------------------------------------------
    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of every position's angles, (T, Dh), from the model's own rotary module."""
        probe = self.token_table[:1].unsqueeze(0)  # only its dtype and device are read
        cos, sin = self._base.rotary_emb(probe, positions.reshape(1, -1))
        return cos[0], sin[0]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_cos_sin(positions)  # (T, Dh)
        return x * cos + rotate_half(x) * sin

    def rope_pairs(self) -> list[tuple[int, int]]:
        half = self.head_dim // 2
        return [(j, j + half) for j in range(half)]

    # --- decoding through an external KV store -----------------------------------------------------
    @torch.no_grad()
    def forward_through(self, store, ids: list[int]) -> torch.Tensor:
        """h = embed[ids]; per layer: RMSNorm → q/k/v → rotate q, k → attend over the store's K/V → o_proj → + MLP."""
        m = self._base
        T, start = len(ids), store.length
        self.check_room(start, T)
        store.begin(T)
        pos = torch.arange(start, start + T)  # (T,)
        h = m.embed_tokens(torch.tensor([ids]))  # (1, T, D)
        cos, sin = m.rotary_emb(h, pos[None])  # (1, T, Dh) each
        windows = [w for w in (store.window, self.model_window) if w]
        window = min(windows) if windows else None
        observe, prerope = getattr(store, "observe", None), getattr(store, "prerope_k", None)
        for i, layer in enumerate(m.layers):
            at = layer.self_attn
            x = layer.input_layernorm(h)
            q, k = at.q_proj(x), at.k_proj(x)
            if self.qk_norm:
                B = x.shape[0]
                q = at.q_norm(q.view(B, T, self.n_head, self.head_dim))
                k = at.k_norm(k.view(B, T, self.n_kv_head, self.head_dim))
            q = apply_rope(self._heads(q, self.n_head), cos, sin)  # (1, H, T, Dh)
            k_pre = self._heads(k, self.n_kv_head)  # (1, H_kv, T, Dh) before rotation
            k = apply_rope(k_pre, cos, sin)  # (1, H_kv, T, Dh)
            v = self._heads(at.v_proj(x), self.n_kv_head)  # (1, H_kv, T, Dh)
            if prerope is not None:
                prerope(i, k_pre[0])
            keys, values, kpos = store.attend_kv(i, k[0], v[0])  # (H_kv, Tk, Dh), (H_kv, Tk, Dh), (Tk,)
            weights, out = attend(q[0], keys, values, q_pos=pos, k_pos=kpos, kv_map=self.kv_map,
                                  scale=self.attn_scale(i), window=window)  # (H, T, Tk), (H, T, Dh)
            if observe is not None:
                observe(i, weights)
            merged = out.transpose(0, 1).reshape(1, T, self.n_head * self.head_dim)
            h = h + at.o_proj(merged)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(m.norm(h))[0]  # (T, V)
        store.end(T)
        return logits

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self._base.norm(h)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(h)

    def output_projection(self, layer: int) -> nn.Module:
        return self._base.layers[layer].self_attn.o_proj
