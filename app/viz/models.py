"""Model cards: what the page says about the model in use."""

from __future__ import annotations

from app.cache.spec import sizes
from app.catalog import from_adapter
from app.kv_bytes import dtype_name
from app.model.loading import LoadedModel, ModelRegistry


def is_char_level(lm: LoadedModel) -> bool:
    """One character per token (the built-in model): no merges, so spaces are tokens of their own."""
    if len(lm.tokenizer) > 1024:  # the size alone: ``get_vocab`` builds a dict of every piece (~0.1 s for GPT-2's)
        return False
    vocab = lm.tokenizer.get_vocab()
    return len(vocab) <= 1024 and all(len(piece) == 1 for piece in vocab if not piece.startswith("<"))


def model_card(lm: LoadedModel) -> dict:
    """What the pages say about the model. Its KV sizes come from ``app.cache.spec.sizes`` on the adapter's config
    (each layer's KV-cache spec), the function the capacity lab uses for catalog entries: bytes per token, per layer
    kind (full attention, each sliding window), and against plain multi-head attention."""
    a = lm.adapter
    size = sizes(from_adapter(lm.name, a), dtype=dtype_name(a.dtype), scales="tensor")
    return {
        **a.describe(),
        "dtype_bytes": a.dtype.itemsize,
        "kv_bytes_per_token": size["bytes_per_token"],
        "kv_layer_bytes": size["layer_bytes"],  # one token in one layer
        "kv_kinds": size["kinds"],  # [{kind, window, layers, n_layers, bytes_per_token}], full attention first
        "mha_bytes_per_token": size["mha_bytes_per_token"],
        "gqa_saving": round(size["kv_saving"]),  # query heads per KV head
        "name": lm.name,
        "source": lm.source,
        "builtin": lm.is_builtin,
        "random_weights": lm.random_weights,
        "family": a.family,
        "n_layer": a.n_layer,
        "n_head": a.n_head,
        "n_kv_head": a.n_kv_head,
        "d_model": a.d_model,
        "head_dim": a.head_dim,
        "max_positions": a.max_positions,
        "model_window": a.model_window,  # a sliding window the model was trained with (None: full attention)
        "vocab_size": a.vocab_size,
        "parameters": a.parameter_count(),
        "char_level": is_char_level(lm),
        "chat_template": lm.has_chat_template,  # Inspect and Decode offer "apply the chat template"
        # Set for weights read from a GGUF file ("Q4_1"): the badge says they were dequantized to fp32.
        "quantization": lm.meta.get("quantization", ""),
    }


def site_view(registry: ModelRegistry, lang: str) -> dict:
    """What every page's frame shows: the served models (each form's model menu) and, when the model the notice
    offers to fetch could not be loaded, why (``notice``: the reason in ``lang``, the model served instead)."""
    missing = registry.download_notice
    notice = None
    if missing:
        notice = {"builtin": registry.get(None).is_builtin, "reason": registry.reason(missing, lang),
                  "model": registry.default}
    return {"models": registry.names, "notice": notice}
