"""The KV-store contract, and the two plain stores: contiguous (``FloatKVStore``) and paged (``PagedSeqStore``).

``ModelAdapter.forward_through(store, ids)`` runs the model's own modules and does the attention itself, so
the K/V a layer reads come from the store and nowhere else. Every store in ``app/cache`` (plain, paged,
windowed, quantized, the eviction policies of ``app/cache/policies``) satisfies ``KVStore``. One step::

    begin(T)                  reserve room for T new tokens (the prompt, or 1 per decode step); raises
                              before changing anything if it cannot (a paged store: ``PoolExhausted``)
    attend_kv(layer, k, v)    k, v: (H_kv, T, Dh), the new tokens' K/V (RoPE models: already rotated);
                              returns (keys, values, key positions): (H_kv, Tk, Dh) ×2 and (Tk,)
    end(T)                    the step is over (an evicting store drops tokens here)

``length`` counts the tokens fed so far, ``window`` is None or the W of a sliding window, ``nbytes`` the bytes
of K/V (and scales) the store holds now. Optional hooks, found by their own protocols:

    KeepsPositions.kept_positions(layer) -> (H_kv, n)   which positions each KV head holds (default: all)
    observe(layer, weights)                            softmax weights after attention (H2O, SnapKV)
    prerope_k(layer, k)                                keys before rotation (StreamingLLM re-rotates)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from app.cache.paged import PagedKVCache


@runtime_checkable
class KVStore(Protocol):
    """What ``forward_through`` reads and writes K/V through."""

    @property
    def window(self) -> int | None: ...

    @property
    def length(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def begin(self, n_new: int) -> None: ...

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]: ...

    def end(self, n_new: int) -> None: ...


@runtime_checkable
class KeepsPositions(Protocol):
    """A store that may hold different positions per head, or fewer than it was fed."""

    def kept_positions(self, layer: int) -> torch.Tensor: ...


def kept_positions(store: KVStore, layer: int, n_kv_head: int) -> torch.Tensor:
    """(H_kv, n) positions each KV head of ``layer`` holds: the store's answer, or every position fed."""
    if isinstance(store, KeepsPositions):
        return store.kept_positions(layer)
    return torch.arange(store.length).expand(n_kv_head, -1)


class FloatKVStore:
    """A plain contiguous float32 cache: one growing (H, T, Dh) tensor per layer."""

    window: int | None = None

    def __init__(self, n_layer: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.length = 0

    def begin(self, n_new: int) -> None:
        pass

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k = k if old_k is None else torch.cat((old_k, k), dim=1)
        self.v[layer] = v = v if old_v is None else torch.cat((old_v, v), dim=1)
        return k, v, torch.arange(k.shape[1])

    def end(self, n_new: int) -> None:
        self.length += n_new

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for k in self.k if k is not None)


class PagedSeqStore:
    """One sequence's view of a ``PagedKVCache``: new K/V go into its tail block, reads go through its block table.

    The sequence may already hold blocks: a prefix hit ``attach``ed before the first step (only the tokens
    after the hit are fed), or a running sequence decoding one token per step. A sliding-window layer reads only
    the blocks its group still holds (``first_kept`` on); at the end of each step its group gives back the blocks
    the next query will not read.
    """

    window: int | None = None

    def __init__(self, cache: PagedKVCache, seq_id: int, *, free_skipped: bool = True) -> None:
        self.cache = cache
        self.seq_id = seq_id
        self._start = 0
        self.free_skipped = free_skipped  # off: the caller gives back the window's outside itself (prefix caching)

    @property
    def length(self) -> int:
        return self.cache.num_tokens.get(self.seq_id, 0)

    @property
    def nbytes(self) -> int:
        """Whole blocks of the sequence's block tables, every group (tail waste included; a shared block counts for
        each holder; a block a window freed not at all)."""
        if self.seq_id not in self.cache.block_tables:
            return 0
        return len(self.cache.held_blocks(self.seq_id)) * self.cache.bytes_per_block

    def begin(self, n_new: int) -> None:
        self._start = self.length
        if self.seq_id not in self.cache.block_tables:
            self.cache.allocate(self.seq_id, n_new)  # prefill: all the prompt's blocks at once
        else:  # decode (one slot, maybe a new block or a copy-on-write), or the rest of a prompt after a prefix hit
            self.cache.append_slots(self.seq_id, n_new)

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.cache.write_kv(self.seq_id, layer, self._start, k, v)
        keys, values = self.cache.gather_kv(self.seq_id, layer)
        first = self.cache.first_kept(self.seq_id, layer)
        return keys, values, torch.arange(first, first + keys.shape[1])

    def end(self, n_new: int) -> None:
        if self.free_skipped:
            self.cache.remove_skipped_blocks(self.seq_id)
