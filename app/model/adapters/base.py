"""The model boundary: what every page, cache and view may know about a model.

Outside ``app/model/adapters/`` nothing knows a checkpoint's module names. Everything else speaks the
adapter's words:

  sizes        n_layer, n_head (query heads), n_kv_head (key/value heads), head_dim, d_model, d_mlp,
               max_positions, vocab_size, dtype
  kv_map       query head -> the KV head it reads (grouped-query attention; identity for plain MHA)
  embeddings   token_table (V, D); position_table (P, D) or None when positions are rotary (nothing added)
  hook points  named tensors in execution order (``blocks.3.attn.lse``), each with its module
  derive       per-head q / k / v as attention uses them (after rotation for RoPE models, with the
               pre-rotation q / k beside them), per-head outputs
  cache        ``layer_cache(cache, i)`` -> K, V of transformers' cache, (B, H_kv, T, Dh) each
  layers       ``attention(i)``: how layer i attends (``LayerAttention``: window, scale, soft-cap, rotary base)
  parameters   ``qkv_parameters(config, i)``, ``fused_qkv(config, name)``, ``default_parameter(config)``: which
               parameters are layer i's q/k/v projections and how to cut q, k, v out of a fused one (class
               methods: the training lab reads models it builds itself, without eager attention)
  parts        ``capabilities``: the known parts it is built from (norm kind, MLP kind, rotary or a position
               table, fused or separate q/k/v, q/k norm, norms after attention and MLP ...), what pages explain
               it by instead of its family name
  block parts  ``embed``, ``attn_in``, ``qkv`` (before rotation), ``rotate_qk``, ``attn_out``, ``mlp_branch``:
               the pieces of one block, read off the model's own modules
  forward      ``forward_through(store, ids)``, written once here from the block parts, with attention done
               by ``app.model.attention.attend`` over K/V read from and written to an external store
               (paged, quantized, windowed, compressed ...)
  lens         ``final_norm(h)`` and ``unembed(h)`` (logit lens)
  ablation     ``ablate({layer: [heads]})``: a scoped hook that zeroes those heads' outputs
  patching     ``patch_point(kind, layer)``: the hook point of a block's output (``resid``), its attention's
               output (``attn``), its MLP's (``mlp``) or its heads before the output projection (``head``);
               ``intervene([(point, fn), ...])``: scoped hooks that read or replace those tensors

Hook names shared by every family (B batch, T new tokens, D width, H heads, H_kv KV heads, Dh head
width, Tk keys attended to = past + T, V vocabulary)::

    embed.wte                 # (B, T, D)       token-table row of each token
    embed.h0                  # (B, T, D)       the residual stream entering block 0
    blocks.{i}.ln_1           # (B, T, D)       norm before attention
    blocks.{i}.attn.q         # (B, H, T, Dh)   queries as attention uses them
    blocks.{i}.attn.k         # (B, H_kv, T, Dh) keys as cached
    blocks.{i}.attn.v         # (B, H_kv, T, Dh)
    blocks.{i}.attn.lse       # (B, H, T)       each query row's log-sum-exp of its scores (the attention
                              #                 module's second output under capture: ``app/model/capture.py``)
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

Each family adds its own (``embed.wpe`` and ``attn.qkv`` for GPT-2; ``attn.q_proj``, ``rope.cos``, ``mlp.gate`` ...
for Llama): its ``hook_points`` declares every tensor it captures, once, with its shape beside it in TransformerLens's
axis names (``[batch, pos, head, d_head]``); its module docstring lists the ones derived from them.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn
from transformers import PreTrainedModel

from app.model.attention import attend, kv_map_for

Take = Literal["output", "output0", "output1", "input0"]

# What activation patching can replace in block i, as the shared hook names above call it: the residual stream
# the block hands on, what attention and the MLP add to it, and the heads concatenated before the output projection
# (a head's output is its Dh-wide slice there).
PATCH_POINTS: dict[str, str] = {
    "resid": "blocks.{i}.resid_out",  # (B, T, D)
    "attn": "blocks.{i}.attn.out",  # (B, T, D)
    "mlp": "blocks.{i}.mlp.out",  # (B, T, D)
    "head": "blocks.{i}.attn.merged",  # (B, T, H·Dh)
}


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: what ``attend`` needs besides q, k, v (vLLM builds each layer's Attention with the same).

    Most models give every layer the same; Gemma 3 alternates sliding-window layers (a short window,
    rotary base 10 000) with full-attention ones (base 1 000 000), so the window and the rotary base are per
    layer, never per model.
    """

    scale: float  # factor the scores q·kᵀ are multiplied by
    window: int | None = None  # a query reads only the last ``window`` positions (None: full causal attention)
    softcap: float | None = None  # scores -> softcap · tanh(scores / softcap) before the mask (None: no cap)
    rope_base: float | None = None  # rotary base θ of this layer (None: positions are not a rotation)

    @property
    def local(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class Capabilities:
    """The known parts a model is built from, model-wide: what the pages explain a model by, never its family
    name (TransformerLens's config flags: normalization type, positional embedding type ...). A new family made
    of parts listed here needs no new words; ``facets`` names each part's value for the catalog's keys.
    """

    norm: str  # "layernorm" | "rmsnorm"
    mlp: str  # "gelu" (fc -> act -> proj) | "swiglu" / "geglu" (act(gate) * up -> down)
    positions: str  # "table" (a learned row added per position) | "rotary" (q and k turned by the position)
    qkv: str  # "fused" (one projection, sliced into q, k, v) | "separate" (three projections)
    qk_norm: bool  # a norm on each head's q and k before rotation (Qwen3, Gemma 3)
    post_norms: bool  # a norm after attention and after the MLP too (Gemma's "sandwich")
    embed_scaled: bool  # the token row is multiplied by a constant on the way in (Gemma: √d_model)
    tied: bool  # the unembedding reads the token table itself
    attention: str  # "MHA" | "GQA" | "MQA"

    def facets(self) -> dict[str, str]:
        """Each part as one word, for catalog keys (``step.ln_1.rmsnorm``)."""
        return {
            "norm": self.norm, "mlp": self.mlp, "positions": self.positions, "qkv": self.qkv,
            "qk_norm": "qk_norm" if self.qk_norm else "no_qk_norm",
            "post_norms": "post_norm" if self.post_norms else "no_post_norm",
            "embedding": "scaled" if self.embed_scaled else "unscaled",
            "unembedding": "tied" if self.tied else "untied",
            "attention": self.attention.lower(),
        }


@dataclass(frozen=True)
class FusedQKV:
    """One parameter holding a layer's query, key and value projections side by side (GPT-2's fused projection):
    along ``axis`` of the parameter as stored, q's block, then k's, then v's."""

    axis: int  # -1 for GPT-2's Conv1D weight, stored (in, out), and for its bias
    widths: tuple[int, int, int]  # of the q, k and v blocks along it (H·Dh, H_kv·Dh, H_kv·Dh)

    def bounds(self, part: str) -> tuple[int, int]:
        """[lo, hi) of ``part`` ("q", "k" or "v") along ``axis``."""
        i = "qkv".index(part)
        lo = sum(self.widths[:i])
        return lo, lo + self.widths[i]

    def index(self, part: str) -> tuple:
        """The index that selects ``part`` from the parameter: ``p[fused.index("k")]``."""
        lo, hi = self.bounds(part)
        return (..., slice(lo, hi)) if self.axis == -1 else (*(slice(None),) * self.axis, slice(lo, hi))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension (transformers' RoPE layout: j pairs with j + Dh/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, T, Dh), cos/sin (B, T, Dh): the rotation transformers applies (same ops, same floats)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def for_this_thread(hook: Callable) -> Callable:
    """``hook`` made to fire only for forwards run by the thread that made it (called here, at registration):
    in any other thread it does nothing (returns None: no change). A long capture lets the model gate go between
    its layers (``app/admission.py``, ``pause_point``) and a short forward of another browser runs meanwhile on the
    same modules: it must not be recorded, ablated or patched by the capture's hooks."""
    me = threading.get_ident()

    def guarded(*args, **kwargs):
        if threading.get_ident() != me:
            return None
        return hook(*args, **kwargs)

    return guarded


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
    mlp_kind: ClassVar[str] = "gelu"  # "gelu" (fc -> act -> proj) | "swiglu" / "geglu" (act(gate) * up -> down)
    post_norms: ClassVar[bool] = False  # a norm after attention and after the MLP too (Gemma's "sandwich")
    qk_norm: bool = False  # a norm on each head's q and k before rotation (set by read_sizes where a config says so)
    embed_scale: float = 1.0  # the token row is multiplied by this on the way in (Gemma: √d_model)

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        if getattr(config, "model_type", None) not in self.model_types:
            raise ValueError(f"{type(self).__name__} does not read model_type={config.model_type!r}")
        self.model = model
        self.config = config
        self._parts: dict[str, nn.Module] = {}  # ``part``'s lookups, one per path
        self.dtype = next(model.parameters()).dtype
        self.read_sizes(config)
        self.kv_map: tuple[int, ...] = kv_map_for(self.n_head, self.n_kv_head)
        self.layers: tuple[LayerAttention, ...] = tuple(self.read_attention(i) for i in range(self.n_layer))

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

    @property
    def capabilities(self) -> Capabilities:
        """The parts this model is built from (the class variables above, the sizes, the tied unembedding)."""
        out = self.model.get_output_embeddings()
        return Capabilities(
            norm=self.norm_kind, mlp=self.mlp_kind, positions="rotary" if self.rotary else "table",
            qkv="fused" if "qkv" in self.qkv_parameters(self.config, 0) else "separate",
            qk_norm=self.qk_norm, post_norms=self.post_norms,
            embed_scaled=self.embed_scale != 1.0,
            tied=out is not None and out.weight.data_ptr() == self.token_table.data_ptr(),
            attention=self.attention_kind,
        )

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # --- the model's own modules, by the dotted path its parameters are named by (``transformer.h.3.attn``) ------
    # ``get_submodule`` raises AttributeError on a path that names no module; reading the tree as attributes
    # (``model.transformer.h[3].attn``) would type each step ``Tensor | Module``. Each path is looked up once: no
    # module of a loaded model is replaced (``place`` moves weights in place), and the block parts ask per layer.
    def part(self, path: str) -> nn.Module:
        module = self._parts.get(path)
        if module is None:
            module = self._parts[path] = self.model.get_submodule(path)
        return module

    def params(self, path: str) -> tuple[tuple[str, nn.Parameter], ...]:
        """The parameters of the module at ``path``, named as the checkpoint names them."""
        return params_of(self.part(path), path)

    # --- parameters by role (class methods of the config: no adapter instance, no eager attention needed) ----
    @classmethod
    @abstractmethod
    def qkv_parameters(cls, config, layer: int) -> dict[str, str]:
        """Names of ``layer``'s query/key/value projection weights, as a causal LM of this family's
        ``named_parameters()`` gives them: ``{"qkv": name}`` where one parameter makes all three, else
        ``{"q": .., "k": .., "v": ..}``."""

    @classmethod
    def fused_qkv(cls, config, name: str) -> FusedQKV | None:
        """How q, k and v sit in parameter ``name`` when it is a fused projection's weight or bias; None otherwise."""
        return None

    @classmethod
    def default_parameter(cls, config) -> str:
        """The parameter a page shows first: layer 0's query projection (the fused one where q, k, v share one)."""
        names = cls.qkv_parameters(config, 0)
        return names.get("qkv") or names["q"]

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
    def derive(self, captured: dict[str, torch.Tensor], positions: torch.Tensor,
               known: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Captured tensors (in hook order) of tokens at ``positions`` (T,) -> every named tensor in execution
        order, per-head ones added. ``known``: per-head tensors this derive already made from the same captured
        ones (a layer's part during the forward, ``app.model.capture.layer_part``), taken as they are where a
        family's derive would compute them again (the rotated q and k)."""

    def split_heads(self, x: torch.Tensor, n_heads: int | None = None) -> torch.Tensor:
        """(B, T, n·Dh) -> (B, n, T, Dh)."""
        B, T, _ = x.shape
        return x.view(B, T, n_heads or self.n_head, self.head_dim).transpose(1, 2)

    # --- attention, per layer ---------------------------------------------------------------------------
    def read_attention(self, layer: int) -> LayerAttention:
        """How ``layer`` attends, read from the config once (at construction); ``attention(i)`` returns it after."""
        return LayerAttention(scale=self.head_dim**-0.5)

    def attention(self, layer: int) -> LayerAttention:
        return self.layers[layer]

    def attn_scale(self, layer: int) -> float:
        """The factor scores are multiplied by."""
        return self.layers[layer].scale

    def window(self, layer: int) -> int | None:
        """The sliding window ``layer`` was trained with (None: full causal attention)."""
        return self.layers[layer].window

    @property
    def model_window(self) -> int | None:
        """A sliding window every layer shares (None when at least one layer attends to everything)."""
        windows = {s.window for s in self.layers}
        return windows.pop() if len(windows) == 1 else None

    def layer_cache(self, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached K and V of one layer as transformers keeps them: (B, H_kv, T_cached, Dh) each."""
        entry = cache.layers[layer]
        return entry.keys, entry.values

    # --- the parts of a block, for ``forward_through`` ------------------------------------------------------
    #   h = embed(ids, pos)                                                   (1, T, D)
    #   per layer i:  x = attn_in(i, h)                                       (1, T, D)
    #                 q, k, v = qkv(i, x)           before rotation           (1, H | H_kv, T, Dh)
    #                 q, k = rotate_qk(i, q, k, pos)                          (RoPE families only)
    #                 h = h + attn_out(i, attend(q, store K/V) merged)         (1, T, D)
    #                 h = h + mlp_branch(i, h)                                 (1, T, D)
    #   logits = unembed(final_norm(h))                                       (1, T, V)
    @abstractmethod
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids (1, T), positions (T,) -> the residual stream entering block 0, (1, T, D)."""

    @abstractmethod
    def attn_in(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The norm before attention: (1, T, D) -> (1, T, D)."""

    @abstractmethod
    def qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (1, T, D) -> q (1, H, T, Dh), k and v (1, H_kv, T, Dh), before any rotation."""

    def rotate_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as attention uses them: rotated to ``positions`` for RoPE families, unchanged otherwise."""
        if not self.rotary:
            return q, k
        cos, sin = cos_sin if cos_sin is not None else self.rope_cos_sin(positions, layer)
        return apply_rope(q, cos[None], sin[None]), apply_rope(k, cos[None], sin[None])

    @abstractmethod
    def attn_out(self, layer: int, merged: torch.Tensor) -> torch.Tensor:
        """The heads concatenated (1, T, H·Dh) -> what attention adds to the residual stream (1, T, D)."""

    @abstractmethod
    def mlp_branch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention (1, T, D) -> what the MLP adds to it (norms included)."""

    # --- decoding through an external KV store -----------------------------------------------------------
    @torch.no_grad()
    def forward_through(self, store, ids: list[int]) -> torch.Tensor:
        """Run ``ids`` (the next T tokens) through the model reading and writing K/V via ``store``: logits (T, V).

        Written once for every family, from the block parts above and each layer's ``LayerAttention``; a store's
        window and the layer's own window both apply (the smaller one wins).

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
        T, start = len(ids), store.length
        self.check_room(start, T)
        store.begin(T)
        pos = torch.arange(start, start + T)  # (T,)
        h = self.embed(torch.tensor([ids]), pos)  # (1, T, D)
        observe = getattr(store, "observe", None)
        prerope = getattr(store, "prerope_k", None) if self.rotary else None
        rope: dict[float | None, tuple[torch.Tensor, torch.Tensor]] = {}  # cos/sin per rotary base, made once
        for i, att in enumerate(self.layers):
            q, k_pre, v = self.qkv(i, self.attn_in(i, h))  # (1, H, T, Dh), (1, H_kv, T, Dh) x2
            if self.rotary and att.rope_base not in rope:
                rope[att.rope_base] = self.rope_cos_sin(pos, i)  # (T, Dh) each
            q, k = self.rotate_qk(i, q, k_pre, pos, rope.get(att.rope_base))
            if prerope is not None:
                prerope(i, k_pre[0])
            keys, values, kpos = store.attend_kv(i, k[0], v[0])  # (H_kv, Tk, Dh), (H_kv, Tk, Dh), (Tk,)
            windows = [w for w in (store.window, att.window) if w]
            weights, out = attend(q[0], keys, values, q_pos=pos, k_pos=kpos, kv_map=self.kv_map, scale=att.scale,
                                  window=min(windows) if windows else None,
                                  softcap=att.softcap)  # (H, T, Tk), (H, T, Dh)
            if observe is not None:
                observe(i, weights)
            merged = out.transpose(0, 1).reshape(1, T, self.n_head * self.head_dim)  # (1, T, H·Dh)
            h = h + self.attn_out(i, merged)
            h = h + self.mlp_branch(i, h)
        logits = self.unembed(self.final_norm(h))[0]  # (T, V)
        store.end(T)
        return logits

    def check_room(self, start: int, n_new: int) -> None:
        from app.errors import BadInput

        if start + n_new > self.max_positions:
            raise BadInput("err.model.positions", positions=self.max_positions, needed=start + n_new)

    # --- rotary positions (RoPE families only) ---------------------------------------------------------
    def rope_cos_sin(self, positions: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of every position's angles in ``layer`` (its rotary base), (T, Dh) each."""
        raise ValueError(f"{self.family} models have no rotary positions")

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Rotate (..., T, Dh) vectors as if they sat at ``positions`` (T,) in ``layer``."""
        cos, sin = self.rope_cos_sin(positions, layer)  # (T, Dh)
        return x * cos + rotate_half(x) * sin

    def rope_frequencies(self, layer: int = 0) -> torch.Tensor:
        """θ of each rotary pair in ``layer`` (radians per position), (Dh/2,), in ``rope_pairs`` order: read back
        from the angles the model's own rotary module gives position 1 (so a scaled or per-layer base is the one
        the model used; a uniform attention factor on cos and sin cancels in atan2)."""
        cos, sin = self.rope_cos_sin(torch.tensor([1]), layer)  # (1, Dh)
        lo = torch.tensor([p[0] for p in self.rope_pairs()])
        return torch.atan2(sin[0, lo].float(), cos[0, lo].float())

    def rope_pairs(self) -> list[tuple[int, int]]:
        """Which dimensions rotate together, one pair per frequency (dimension j with j + Dh/2)."""
        if not self.rotary:
            raise ValueError(f"{self.family} models have no rotary positions")
        half = self.head_dim // 2
        return [(j, j + half) for j in range(half)]

    # --- the residual stream read out (logit lens) -------------------------------------------------------
    @abstractmethod
    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """(abstract)"""

    @abstractmethod
    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream after the final norm -> logits (a final soft-cap included, where a model has one)."""

    # --- head ablation -----------------------------------------------------------------------------------
    @abstractmethod
    def output_projection(self, layer: int) -> nn.Module:
        """The module that takes the concatenated heads (B, T, H·Dh) first; ``ablate`` hooks its input."""

    @contextmanager
    def ablate(self, heads: dict[int, list[int]]) -> Iterator[None]:
        """Zero the outputs of ``heads`` ({layer: [head, ...]}) for the forwards this thread runs inside the block."""
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
                    handles.append(self.output_projection(layer).register_forward_pre_hook(
                        for_this_thread(make(list(hs)))))
            yield
        finally:
            for handle in handles:
                handle.remove()

    # --- interventions (activation patching) ----------------------------------------------------------------
    def patch_point(self, kind: str, layer: int) -> HookPoint:
        """The hook point activation patching of ``kind`` (``PATCH_POINTS``) reads and replaces in ``layer``;
        KeyError when this model has no such part."""
        points = self.__dict__.get("_points_by_name")
        if points is None:
            points = self.__dict__["_points_by_name"] = {p.name: p for p in self.hook_points()}
        return points[PATCH_POINTS[kind].format(i=layer)]

    @contextmanager
    def intervene(self, edits: list[tuple[HookPoint, Callable[[torch.Tensor], torch.Tensor | None]]]
                  ) -> Iterator[None]:
        """For the forwards this thread runs inside the block, each point's tensor is handed to its function: a tensor
        it returns replaces the original in the forward (patching), None leaves it as it was (reading). Hooks are
        removed in ``finally:``, also when the forward raises."""
        handles = []

        def pre(fn):
            def hook(_module, args):
                new = fn(args[0])
                return None if new is None else (new, *args[1:])

            return hook

        def post(fn, take):
            def hook(_module, _args, output):
                if take == "output0":
                    new = fn(output[0])
                    return None if new is None else (new, *output[1:])
                return fn(output)

            return hook

        try:
            for point, fn in edits:
                if point.take == "input0":
                    handles.append(point.module.register_forward_pre_hook(for_this_thread(pre(fn))))
                elif point.take in ("output", "output0"):
                    handles.append(point.module.register_forward_hook(for_this_thread(post(fn, point.take))))
                else:
                    raise ValueError(f"{point.name}: a {point.take} tensor cannot be replaced")
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
            "windows": [s.window for s in self.layers], "embed_scale": self.embed_scale, "post_norms": self.post_norms,
        }
