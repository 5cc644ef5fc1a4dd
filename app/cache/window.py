"""A sliding-window KV cache: each layer keeps the K/V of the last W tokens in a cyclic buffer of W slots.

Token at position p lives in slot p % W; when p >= W it overwrites the token at p - W, so memory stays at W
tokens however long the sequence grows::

    W = 4, after 6 tokens:  slot 0  slot 1  slot 2  slot 3
                            pos 4   pos 5   pos 2   pos 3      (pos 0 and 1 were overwritten)

Slots are read in slot order, not position order: attention is a softmax-weighted sum over keys, so the
order of the keys does not matter, and GPT-2 adds its (absolute, learned) position embedding before K/V
are computed, so every cached K/V already carries its position. The positions are kept beside the slots
for the mask, which allows a query at position q to read keys at q - W + 1 .. q.

GPT-2 was trained with full causal attention over up to 1024 positions. Dropping the K/V older than W is
therefore an approximation for this model, not a lossless saving: its outputs drift from full attention
once the sequence is longer than W (the verification bench measures by how much).
"""

from __future__ import annotations

import torch


class WindowKVStore:
    """Cyclic per-layer buffers of W slots (the decoder's KV store protocol)."""

    def __init__(self, window: int, *, n_layer: int, n_kv_head: int, head_dim: int) -> None:
        if window < 1:
            raise ValueError("the window must hold at least one token")
        self.window = window
        self.k = torch.zeros(n_layer, n_kv_head, window, head_dim)  # (L, H, W, Dh)
        self.v = torch.zeros(n_layer, n_kv_head, window, head_dim)
        self.slot_pos = torch.full((n_layer, window), -1, dtype=torch.long)  # position held by each slot, -1 empty
        self.length = 0

    def begin(self, n_new: int) -> None:
        pass

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Keys a query may read: the buffer's tokens plus the new ones; then the new ones go into their slots.

        A chunk of T new tokens (a prefill) transiently needs W + T entries so that its early queries still
        see the tokens the chunk's later tokens are about to overwrite; after the call only W remain.
        """
        T = k.shape[1]
        held = self.slot_pos[layer] >= 0
        new_pos = torch.arange(self.length, self.length + T)
        keys = torch.cat((self.k[layer][:, held], k), dim=1)  # (H, held + T, Dh)
        values = torch.cat((self.v[layer][:, held], v), dim=1)
        positions = torch.cat((self.slot_pos[layer][held], new_pos))
        keep = slice(max(0, T - self.window), T)  # only the last W of the new tokens survive
        slots = new_pos[keep] % self.window
        self.k[layer][:, slots] = k[:, keep]
        self.v[layer][:, slots] = v[:, keep]
        self.slot_pos[layer, slots] = new_pos[keep]
        return keys, values, positions

    def end(self, n_new: int) -> None:
        self.length += n_new

    def kept_positions(self, layer: int) -> torch.Tensor:
        """(H_kv, n) the positions the filled slots hold, oldest first (every head holds the same ones)."""
        held = self.slot_pos[layer][self.slot_pos[layer] >= 0].sort().values
        return held.expand(self.k.shape[1], -1)

    @property
    def nbytes(self) -> int:
        """K and V of the slots filled so far (the buffer of W slots once W tokens have been fed)."""
        L, H, _, Dh = self.k.shape
        return 2 * L * H * int((self.slot_pos[0] >= 0).sum()) * Dh * self.k.element_size()
