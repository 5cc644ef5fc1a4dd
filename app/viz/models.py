"""Model cards: what the page says about the model in use."""

from __future__ import annotations

from app.model.loading import LoadedModel


def model_card(lm: LoadedModel) -> dict:
    a = lm.adapter
    return {
        "name": lm.name,
        "source": lm.source,
        "builtin": lm.is_builtin,
        "family": a.family,
        "n_layer": a.n_layer,
        "n_head": a.n_head,
        "n_kv_head": a.n_kv_head,
        "d_model": a.d_model,
        "head_dim": a.head_dim,
        "max_positions": a.max_positions,
        "vocab_size": a.vocab_size,
        "parameters": a.parameter_count(),
    }
