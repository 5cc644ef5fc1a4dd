"""The deep-zoom heatmap as the server runs it: a trace found by key, one head's pyramid kept, tiles and cells read.

``ZoomLab`` reads the traces the Inspect lab keeps (``InspectLab.trace_by_key``: 410 once the key is unknown,
recomputed if only evicted) and holds its limits (``Settings.zoom_*``).

    meta(key)                                  T, levels, tile size, the layers and heads, every token's text
    tile(key, layer, head, level, row, col, pool)   one pooled tile (float32, row-major) and its shape
    cell(key, layer, head, q, k)               one exact weight and the two tokens
    head_grid(key, layer)                      that layer's heads summarised (the grid of heads, one row)
    top(key, layer, head, q)                   the keys query q reads most, with their tokens

It keeps each head's pooled base (``app/viz/zoom.py``), least recently used dropped first within
``Settings.zoom_cache_bytes``; a base holds numbers only, never the trace, so the trace store's budget and
time-to-live still decide how long a trace lives. It also keeps each layer's head summaries
(``app/viz/summaries.py``: 3 numbers a head) once computed: a layer is O(heads · T²) exact weights streamed (seconds
at 8 192 tokens), so the page asks for the grid one layer at a time, showing which layer it is at, and asks again
for nothing it has.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from app.errors import BadInput
from app.labs.inspect import InspectLab
from app.labs.limits import Limits
from app.model.trace import Trace
from app.quota import Requester
from app.viz import summaries
from app.viz.attention import check_indexes
from app.viz.inspect import opening_head
from app.viz.models import model_card
from app.viz.tokens import visible
from app.viz.zoom import POOLS, TILE, HeadPyramid, check_pool, tiles_per_side

GridRow = dict[str, list[float | None]]  # one layer's grid of heads: per measure, per head (None: the measure is NaN)


@dataclass(frozen=True)
class ZoomPin:
    """What the zoom lab holds of a pinned trace: its grid of heads' rows (by layer) and its heads' pooled bases."""

    rows: dict[int, GridRow]
    trace: Trace | None
    bases: dict[str, torch.Tensor]


PREVIEW_TOKENS = 40  # the prompt's opening, shown on the long-prompt page
GRID_ROWS = 4096  # layers' summaries kept (a few hundred bytes each: far inside zoom_cache_bytes)
TOP_KEYS = 8  # the keys a query reads most, listed under the map


@dataclass(frozen=True)
class ZoomLimits(Limits):
    GROUP = "zoom"
    zoom_cache_bytes: int  # the pooled bases and coarse levels of every head kept


class ZoomLab:
    """Pyramids by (trace key, layer, head); one lock per pyramid so concurrent tiles of one head make its base
    once."""

    def __init__(self, *, inspect: InspectLab, limits: ZoomLimits) -> None:
        self.inspect = inspect
        self.limits = limits
        self.max_bytes = limits.zoom_cache_bytes
        self._items: OrderedDict[tuple[str, int, int], tuple[HeadPyramid, threading.Lock]] = OrderedDict()
        self._lock = threading.Lock()
        self._grid: OrderedDict[tuple[str, int], GridRow] = OrderedDict()  # (key, layer) -> measures
        # A pinned trace's rows and pooled bases (app/labs/kit.py): read first, never dropped
        self.pinned_grid: dict[tuple[str, int], GridRow] = {}
        self.pinned_pyramids: dict[tuple[str, int, int], tuple[HeadPyramid, threading.Lock]] = {}

    def grid_row(self, key: str, layer: int, make) -> GridRow:
        """One layer's head summaries, made by ``make()`` once (outside the lock: other heads' tiles go on)."""
        with self._lock:
            row = self.pinned_grid.get((key, layer)) or self._grid.get((key, layer))
        if row is None:
            row = make()
            with self._lock:
                self._grid[(key, layer)] = row
                while len(self._grid) > GRID_ROWS:
                    self._grid.popitem(last=False)
        return row

    def grid_rows(self, key: str) -> dict[int, GridRow]:
        """The layers' head summaries of one trace made so far (what its grid of heads shows), by layer."""
        with self._lock:
            return {layer: row for (k, layer), row in (self._grid | self.pinned_grid).items() if k == key}

    # --- pins (``app/labs/pins.py``'s PinTarget) -----------------------------------------------------------------
    def pin(self, key: str, pinned: ZoomPin) -> None:
        """Hold a pinned trace's grid rows and pooled bases under ``key`` (read first, never dropped)."""
        self.pin_grid(key, pinned.rows)
        if pinned.bases:
            if pinned.trace is None:
                raise ValueError("pooled bases are pinned with the trace they pool")
            self.pin_pyramids(key, pinned.trace, pinned.bases)

    def unpin(self, key: str) -> None:
        self.unpin_grid(key)

    def pinned_item(self, key: str) -> ZoomPin | None:
        with self._lock:
            rows = {layer: row for (k, layer), row in self.pinned_grid.items() if k == key}
            held = any(k[0] == key for k in self.pinned_pyramids)
        return ZoomPin(rows=rows, trace=None, bases={}) if rows or held else None

    def pin_grid(self, key: str, rows: dict[int, GridRow]) -> None:
        """A pinned trace's rows, kept until ``unpin_grid``."""
        with self._lock:
            self.pinned_grid.update({(key, layer): row for layer, row in rows.items()})

    def unpin_grid(self, key: str) -> None:
        with self._lock:
            for grid_key in [k for k in self.pinned_grid if k[0] == key]:
                del self.pinned_grid[grid_key]
            for pyramid_key in [k for k in self.pinned_pyramids if k[0] == key]:
                del self.pinned_pyramids[pyramid_key]

    def pyramid_bases(self, key: str) -> dict[str, torch.Tensor]:
        """Every pooled base made so far of one trace's heads, as ``"layer.head.pool"`` -> cells."""
        with self._lock:
            items = [(k, p) for k, (p, _) in (self._items | self.pinned_pyramids).items() if k[0] == key]
        return {f"{layer}.{head}.{pool}": cells for (_, layer, head), p in items for pool, cells in p.bases().items()}

    def pin_pyramids(self, key: str, trace: Trace, bases: dict[str, torch.Tensor]) -> None:
        """A pinned trace's bases (``pyramid_bases``), kept until ``unpin_grid``: its first tiles need no pass."""
        with self._lock:
            for name, cells in bases.items():
                layer, head, pool = name.split(".")
                item = self.pinned_pyramids.setdefault(
                    (key, int(layer), int(head)),
                    (HeadPyramid(trace.n_tokens, trace.total_length, past=trace.past_length), threading.Lock()))
                item[0].keep_base(pool, cells)

    def pyramid(self, key: str, trace: Trace, layer: int, head: int) -> tuple[HeadPyramid, threading.Lock]:
        with self._lock:
            pinned = self.pinned_pyramids.get((key, layer, head))
            if pinned is not None:
                return pinned
            item = self._items.get((key, layer, head))
            if item is None:
                item = (HeadPyramid(trace.n_tokens, trace.total_length, past=trace.past_length), threading.Lock())
                self._items[(key, layer, head)] = item
            self._items.move_to_end((key, layer, head))
            return item

    def seed_overview(self, key: str, trace: Trace, layer: int, head: int, cells: torch.Tensor) -> None:
        """One head's level-0 max cells made while its layer was computed (a long capture's climb,
        ``app/labs/long.py``): kept in its pyramid, so the page's first tile of that head needs no pass."""
        pyr, lock = self.pyramid(key, trace, layer, head)
        with lock:
            pyr.keep_level("max", 0, cells)
        self.trim()

    def trim(self) -> None:
        """Drop the least recently used pyramids until the bases fit ``max_bytes`` (the newest always stays)."""
        with self._lock:
            while len(self._items) > 1 and self.nbytes() > self.max_bytes:
                self._items.popitem(last=False)

    def nbytes(self) -> int:
        return sum(p.nbytes for p, _ in self._items.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._grid.clear()

    # --- what the routes call ----------------------------------------------------------------------------
    def meta(self, key: str, *, who: Requester) -> dict:
        """What the canvas needs first: T, the pyramid's levels and tiles per side, the layers, heads and tokens."""
        lm, trace = self.inspect.trace_by_key(key, who=who)
        n = max(trace.n_tokens, trace.total_length)
        pyr = HeadPyramid(trace.n_tokens, trace.total_length)
        return {"key": key, "model": lm.name, "rows": trace.n_tokens, "cols": trace.total_length,
                "past": trace.past_length, "tile": TILE, "levels": pyr.levels, "pools": list(POOLS),
                "tiles": [tiles_per_side(n, level) for level in range(pyr.levels)],
                "layers": trace.adapter.n_layer, "heads": trace.adapter.n_head,
                "tokens": [visible(t) for t in trace.token_texts],
                "preview": " ".join("".join(trace.token_texts[:PREVIEW_TOKENS]).split())}

    def page(self, key: str, *, who: Requester) -> dict:
        """The long prompt's page: its metadata, its model's card, the head it opens on (Inspect's choice for the
        last query, ``opening_head``: a telling head, not layer 0 head 0; the URL's layer and head win) and the
        rows of its grid of heads made so far (a pinned trace's: all it was pinned with), drawn at once."""
        from app.labs.long import essay_cut

        meta = self.meta(key, who=who)
        lm, trace = self.inspect.trace_by_key(key, who=who)
        choice = opening_head(trace, trace.n_tokens - 1)
        if trace.past_length == 0 and trace.n_tokens > 1:  # the built-in essay cut to a limit: say so, with both counts
            meta["cut_from"] = essay_cut(lm, trace.token_ids)
        return {"meta": meta, "card": model_card(self.inspect.registry.get(meta["model"])), "key": key,
                "choice": choice, "q": trace.n_tokens - 1,
                "grid_rows": {str(layer): row for layer, row in sorted(self.grid_rows(key).items())}}

    def tile(self, key: str, *, layer: int, head: int, level: int, row: int, col: int, pool: str,
             who: Requester) -> torch.Tensor:
        """Tile (row, col) of ``level`` of one head's map, pooled by ``pool``: (r, c) float32."""
        check_pool(pool)
        _, trace = self.inspect.trace_by_key(key, who=who)
        check_indexes(trace, layer=layer, head=head)
        pyr, lock = self.pyramid(key, trace, layer, head)
        with lock:
            out = pyr.tile(lambda rows, cols: trace.attention_block(layer, head, rows, cols), level, row, col, pool,
                           scores=lambda rows, cols: trace.score_block(layer, head, rows, cols))
        self.trim()
        return out

    def cell(self, key: str, *, layer: int, head: int, q: int, k: int, who: Requester) -> dict:
        """One exact weight (query position ``q`` among the new tokens, key position ``k`` among all) and its tokens."""
        _, trace = self.inspect.trace_by_key(key, who=who)
        check_indexes(trace, layer=layer, head=head, pos=q)
        if not 0 <= k < trace.total_length:
            raise BadInput("err.zoom.key", k=k, last=trace.total_length - 1)
        w = trace.attention_block(layer, head, slice(q, q + 1), slice(k, k + 1))[0, 0].item()
        texts = trace.token_texts  # a decode step's trace holds its new tokens' texts only
        key_text = texts[k - trace.past_length] if k >= trace.past_length else None
        return {"layer": layer, "head": head, "q": q, "k": k, "weight": w,
                "allowed": k <= trace.past_length + q,
                "query_token": visible(texts[q]), "key_token": visible(key_text) if key_text is not None else None}

    def head_grid(self, key: str, *, layer: int, who: Requester) -> dict:
        """Layer ``layer``'s row of the grid of heads: each head's share on the first token, mean attention distance
        (tokens) and entropy (nats), from every exact weight (``summaries.head_summary``, float64 sums)."""
        _, trace = self.inspect.trace_by_key(key, who=who)
        check_indexes(trace, layer=layer)

        def make() -> GridRow:
            rows = [summaries.head_summary(trace, layer, h) for h in range(trace.adapter.n_head)]
            return {m: [None if math.isnan(r[m]) else r[m] for r in rows] for m in summaries.MEASURES}

        return {"layer": layer, "layers": trace.adapter.n_layer} | self.grid_row(key, layer, make)

    def top(self, key: str, *, layer: int, head: int, q: int, who: Requester) -> dict:
        """The ``TOP_KEYS`` keys query ``q`` reads most in one head: position, token text, exact weight."""
        _, trace = self.inspect.trace_by_key(key, who=who)
        check_indexes(trace, layer=layer, head=head, pos=q)
        return {"layer": layer, "head": head, "q": q, "query_token": visible(trace.token_texts[q]),
                "keys": summaries.top_keys(trace, layer, head, q, TOP_KEYS)}
