"""Model cards: what the page says about the model in use."""

from __future__ import annotations

from app.model.decode import kv_bytes_formula
from app.model.loading import LoadedModel


def is_char_level(lm: LoadedModel) -> bool:
    """One character per token (the built-in model): no merges, so spaces are tokens of their own."""
    vocab = lm.tokenizer.get_vocab()
    return len(vocab) <= 1024 and all(len(piece) == 1 for piece in vocab if not piece.startswith("<"))


def model_card(lm: LoadedModel) -> dict:
    a = lm.adapter
    per_token = kv_bytes_formula(layers=a.n_layer, kv_heads=a.n_kv_head, tokens=1, head_dim=a.head_dim,
                                 dtype_bytes=a.dtype.itemsize)["per_token"]
    mha = kv_bytes_formula(layers=a.n_layer, kv_heads=a.n_head, tokens=1, head_dim=a.head_dim,
                           dtype_bytes=a.dtype.itemsize)["per_token"]
    return {
        **a.describe(),
        "dtype_bytes": a.dtype.itemsize,
        "kv_bytes_per_token": per_token,
        "mha_bytes_per_token": mha,
        "gqa_saving": a.n_head // a.n_kv_head,
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
