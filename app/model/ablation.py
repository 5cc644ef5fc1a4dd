"""Head ablation: the model's last-position logits with some heads' outputs zeroed (``ModelAdapter.ablate``)."""

from __future__ import annotations

import torch

from app.model.loading import LoadedModel


@torch.no_grad()
def ablated_last_logits(lm: LoadedModel, ids: list[int], heads: dict[int, list[int]]) -> torch.Tensor:
    """(V,) logits at the last position with ``heads`` ({layer: [head, ...]}) zeroed for this forward only."""
    with lm.adapter.ablate(heads):
        return lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
