"""The deep-zoom heatmap of one head: a pyramid of pooled tiles over its (T, Tk) attention map.

Modelled on the contact-map viewers of genomics (HiGlass): the map is cut into square tiles of ``TILE`` cells,
and each level of the pyramid pools ``f × f`` exact weights into one cell, ``f`` halving from level to level
until the deepest level shows the exact weights themselves::

    level 0        f = 2^max_level   one tile: the whole map (the overview)
    level 1        f = 2^(max−1)     2 × 2 tiles (fewer where T is short of a power of two)
    …
    level max      f = 1             ceil(T / TILE) tiles per side, every cell one exact weight

    max_level = ceil(log2(ceil(T / TILE)))  (0 when T ≤ TILE: the overview is already exact)
    tiles per side at level L = ceil(T / (TILE · 2^(max_level − L)))

Tile (row, col) of level L covers queries [row · TILE · f, (row + 1) · TILE · f) and keys likewise, clipped to the
map; a tile on the right or bottom edge is smaller (its real cells only, never padded).

Two ways to pool, both offered: **max** (a cell shows the strongest weight among the ones it covers: a single
sharp weight stays visible in the overview) and **mean** (the average of every covered cell, the masked
zeros above the diagonal included: the mean of a block that straddles the diagonal is the share of its area's
attention, not the average over allowed pairs only). An edge cell that covers fewer than f × f weights pools only
those it covers.

A max cell needs one exp, not f²: a weight is exp(score − lse) with lse its row's log-sum-exp, and exp is
increasing, so the largest weight of a cell's row segment is exp(largest score − lse). With a score reader
(``Trace.score_block``) the max pool takes the largest score of each row's f keys, one exp per (row, cell), then
the largest over f rows: the same weights as pooling ``attention_block``'s, at a fraction of the work (the exps were
most of it).

Weights are read only through ``Trace.attention_block`` (exact, 0 where not allowed), one band of query rows at
a time (``band_rows``), so the whole T × Tk map is never held. Keys after the band's last query are future
positions, 0 by the causal mask, and are not read. A ``HeadPyramid`` keeps one pooled base per head (the
coarsest level that still has at least ``base_cells`` cells per side), made in one streaming pass; every
coarser level is pooled from it (max of maxes, sums of sums: exactly the same numbers), finer levels stream
their own tile's block.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.errors import BadInput

TILE = 256  # cells per tile side
POOLS = ("max", "mean")
Reader = Callable[[slice, slice], torch.Tensor]  # (rows, cols) -> exact weights (r, c) float32
# (rows, cols) -> (scores (r, c) float32, -inf where not allowed; each row's log-sum-exp (r,)): ``Trace.score_block``
ScoreReader = Callable[[slice, slice], tuple[torch.Tensor, torch.Tensor]]


def max_level(n: int) -> int:
    """The deepest level for a map of ``n`` positions per side: there one cell is one weight."""
    tiles = math.ceil(n / TILE)
    return max(0, math.ceil(math.log2(tiles))) if tiles > 1 else 0


def factor(n: int, level: int) -> int:
    """Positions per cell side at ``level``."""
    return 2 ** (max_level(n) - level)


def tiles_per_side(n: int, level: int) -> int:
    return math.ceil(n / (TILE * factor(n, level)))


def _pool(block: torch.Tensor, f: int, how: str) -> torch.Tensor:
    """``block`` (r, c) pooled in f × f cells: max, or sum (divided by the counts later; float64). Edge cells cover
    what is there (zero padding changes neither a max of weights ≥ 0 nor a sum). Reduced along the rows' own
    memory first (contiguous), then across rows."""
    if f == 1:
        return block.clone() if how == "max" else block.double()
    r, c = block.shape
    rr, cc = math.ceil(r / f), math.ceil(c / f)
    if (r, c) != (rr * f, cc * f):
        padded = torch.zeros(rr * f, cc * f, dtype=block.dtype)
        padded[:r, :c] = block
        block = padded
    block = block.contiguous()
    if how == "max":
        return block.view(rr * f, cc, f).amax(dim=2).view(rr, f, cc).amax(dim=1)
    # f values of one row summed in the block's own precision (float32: ~1e-7 relative), then in float64
    return block.view(rr * f, cc, f).sum(dim=2).double().view(rr, f, cc).sum(dim=1)


def _pool_max_scores(s: torch.Tensor, lse: torch.Tensor, f: int) -> torch.Tensor:
    """The max pool of the weights exp(s − lse) of a block of scores ``s`` (r, c; -inf where not allowed) whose rows'
    log-sum-exp is ``lse`` (r,): the largest score of each row's f keys, its one exp, then the largest over f rows.
    Edge cells cover what is there (padded with -inf scores: weight 0)."""
    r, c = s.shape
    rr, cc = math.ceil(r / f), math.ceil(c / f)
    if c != cc * f:
        padded = torch.full((r, cc * f), -math.inf, dtype=s.dtype)
        padded[:, :c] = s
        s = padded
    top = torch.exp(s.contiguous().view(r, cc, f).amax(dim=2) - lse[:, None])  # (r, cc): each row's largest weight
    if r != rr * f:
        top = torch.cat([top, top.new_zeros(rr * f - r, cc)])
    return top.view(rr, f, cc).amax(dim=1)


def _counts(start: int, stop: int, f: int) -> torch.Tensor:
    """How many positions each cell of [start, stop) in steps of f covers (f, the last one possibly fewer)."""
    edges = torch.arange(start, stop, f)
    return (torch.clamp(edges + f, max=stop) - edges).to(torch.float64)


def pooled(read: Reader, rows: tuple[int, int], cols: tuple[int, int], f: int, how: str, *,
           past: int = 0, band_rows: int = 512, scores: ScoreReader | None = None) -> torch.Tensor:
    """Queries ``rows`` × keys ``cols`` (half-open ranges, starts multiples of f) pooled in f × f cells, read one
    band of query rows at a time; ``past``: keys before the first query (a decode step), so query i's last
    allowed key is past + i. Mean cells are divided by the positions they cover. A max pool reads ``scores``
    when given (one exp per row and cell: the module docstring), else the weights."""
    r0, r1 = rows
    c0, c1 = cols
    band = max(f, band_rows // f * f)
    out = torch.zeros(math.ceil((r1 - r0) / f), math.ceil((c1 - c0) / f), dtype=torch.float64)
    for b0 in range(r0, r1, band):
        b1 = min(b0 + band, r1)
        last_key = min(c1, past + b1)  # keys from here on are in every query's future: weight 0
        if last_key <= c0:
            continue
        last_key = c0 + math.ceil((last_key - c0) / f) * f  # whole cells (clipped to the map below)
        last_key = min(last_key, c1)
        if how == "max" and scores is not None:
            part = _pool_max_scores(*scores(slice(b0, b1), slice(c0, last_key)), f).double()
        else:
            block = read(slice(b0, b1), slice(c0, last_key))  # (b1 - b0, last_key - c0)
            part = _pool(block, f, how).double()
        i = (b0 - r0) // f
        out[i : i + part.shape[0], : part.shape[1]] = part
    if how == "mean":
        out /= _counts(r0, r1, f).unsqueeze(1) * _counts(c0, c1, f).unsqueeze(0)
    return out.float()


@dataclass(frozen=True)
class TileSpec:
    level: int
    row: int
    col: int
    f: int
    rows: tuple[int, int]  # query positions covered
    cols: tuple[int, int]  # key positions covered


def tile_spec(n_rows: int, n_cols: int, level: int, row: int, col: int) -> TileSpec:
    """Where tile (row, col) of ``level`` lies; a level, row or column outside the pyramid is a ``BadInput``."""
    n = max(n_rows, n_cols)
    top = max_level(n)
    if not 0 <= level <= top:
        raise BadInput("err.zoom.level", level=level, last=top)
    f = factor(n, level)
    span = TILE * f
    last_row, last_col = math.ceil(n_rows / span) - 1, math.ceil(n_cols / span) - 1
    if not 0 <= row <= last_row:
        raise BadInput("err.zoom.tile_row", row=row, level=level, last=last_row)
    if not 0 <= col <= last_col:
        raise BadInput("err.zoom.tile_col", col=col, level=level, last=last_col)
    return TileSpec(level, row, col, f, (row * span, min(n_rows, (row + 1) * span)),
                    (col * span, min(n_cols, (col + 1) * span)))


def check_pool(pool: str) -> None:
    if pool not in POOLS:
        raise BadInput("err.zoom.pool", pool=repr(pool), pools=", ".join(POOLS))


class HeadPyramid:
    """One head's pyramid: ``tile`` gives any tile of any level, pooled by max or mean.

    The base (levels with f ≥ ``base_f``) is made once per pool, on the first tile asked for at those levels, in one
    streaming pass over the map, and kept; ``nbytes`` says what it holds (per pool an array of at most
    ``base_cells``² cells, float32 maxes or float64 sums for the mean), and each coarse level pooled from it once
    (float32; all of them together a third of the base's cells).
    """

    def __init__(self, n_rows: int, n_cols: int, *, past: int = 0, base_cells: int = 1024,
                 band_rows: int = 512) -> None:
        self.n_rows, self.n_cols, self.past, self.band_rows = n_rows, n_cols, past, band_rows
        self.n = max(n_rows, n_cols)
        self.levels = max_level(self.n) + 1
        # The finest f whose pooled map fits base_cells per side; at least 1 (small maps: the base is exact).
        self.base_f = 1
        while math.ceil(self.n / self.base_f) > base_cells:
            self.base_f *= 2
        self._base: dict[str, torch.Tensor] = {}  # pool -> max cells, or sums of cells (float64)
        self._levels: dict[tuple[str, int], torch.Tensor] = {}  # (pool, level) -> that level's cells (float32)

    def _base_for(self, read: Reader, pool: str, scores: ScoreReader | None = None) -> torch.Tensor:
        if pool not in self._base:
            cells = pooled(read, (0, self.n_rows), (0, self.n_cols), self.base_f, pool, past=self.past,
                           band_rows=self.band_rows, scores=scores)
            if pool == "mean":  # back to sums, so coarser levels can add them up exactly
                cells = cells.double() * (_counts(0, self.n_rows, self.base_f).unsqueeze(1)
                                          * _counts(0, self.n_cols, self.base_f).unsqueeze(0))
            self._base[pool] = cells
        return self._base[pool]

    def bases(self) -> dict[str, torch.Tensor]:
        """The bases made so far, by pool (what a pinned trace keeps of its zoom: ``app/labs/kit.py``)."""
        return dict(self._base)

    def keep_base(self, pool: str, cells: torch.Tensor) -> None:
        """A base made before (``bases``), so no pass over the map is needed for it."""
        check_pool(pool)
        self._base[pool] = cells

    @property
    def nbytes(self) -> int:
        kept = [*self._base.values(), *self._levels.values()]
        return sum(t.numel() * t.element_size() for t in kept)

    def tile(self, read: Reader, level: int, row: int, col: int, pool: str = "max",
             scores: ScoreReader | None = None) -> torch.Tensor:
        """Tile (row, col) of ``level``, its weights read with ``read`` (a max pool with ``scores`` when given):
        (r, c) float32, r and c ≤ TILE (smaller on the edges). The pyramid keeps no reader (so no trace) between
        calls."""
        check_pool(pool)
        spec = tile_spec(self.n_rows, self.n_cols, level, row, col)
        if spec.f < self.base_f:
            return pooled(read, spec.rows, spec.cols, spec.f, pool, past=self.past, band_rows=self.band_rows,
                          scores=scores)
        cells = self._level(read, pool, level, spec.f, scores)
        return cells[row * TILE : (row + 1) * TILE, col * TILE : (col + 1) * TILE].clone()

    def keep_level(self, pool: str, level: int, cells: torch.Tensor) -> None:
        """A whole coarse level made before (a long capture's overview of each layer as it was computed,
        ``overview``), so its tiles need no pass over the map."""
        check_pool(pool)
        if factor(self.n, level) < self.base_f:
            raise ValueError("only a coarse level (f ≥ base_f) is kept whole")
        self._levels[(pool, level)] = cells.float()

    def _level(self, read: Reader, pool: str, level: int, f: int, scores: ScoreReader | None = None) -> torch.Tensor:
        """A whole coarse level (f ≥ base_f: at most base_cells per side), pooled from the base once and kept."""
        if (pool, level) not in self._levels:
            base, k = self._base_for(read, pool, scores), f // self.base_f
            cells = _pool(base.double(), k, pool) if k > 1 else base.double().clone()
            if pool == "mean":
                cells /= _counts(0, self.n_rows, f).unsqueeze(1) * _counts(0, self.n_cols, f).unsqueeze(0)
            self._levels[(pool, level)] = cells.float()
        return self._levels[(pool, level)]


def overview(scores: ScoreReader, n_rows: int, n_cols: int, *, past: int = 0, band_rows: int = 128) -> torch.Tensor:
    """A head's level-0 max tile (the zoom page's overview, ``HeadPyramid.tile(…, 0, 0, 0, "max")``'s cells)
    straight from its scores, with no base kept: one streaming pass. A long capture makes one per layer as the
    layer is computed (``app.viz.long_climb``). Bands of 128 rows: a band's scores (128 × T float32, 4 MB at 8K)
    stay in the CPU's cache between the matmul, the mask and the max; measured at 8 192 tokens, 2 cores: 0.077 s
    a head against 0.154 s with 512-row bands."""
    n = max(n_rows, n_cols)
    return pooled(lambda rows, cols: torch.empty(0), (0, n_rows), (0, n_cols), factor(n, 0), "max", past=past,
                  band_rows=band_rows, scores=scores)
