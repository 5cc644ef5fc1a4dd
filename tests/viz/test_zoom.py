"""The zoom pyramid equals pooling the exact matrix, tile by tile, level by level (max and mean), edges included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from app.errors import BadInput
from app.model.capture import run_traced
from app.viz.zoom import TILE, HeadPyramid, factor, max_level, overview, pooled, tiles_per_side


def causal_weights(n: int, seed: int = 0, past: int = 0) -> torch.Tensor:
    """A softmax over allowed keys (j ≤ past + i), exact zeros elsewhere: (n, past + n)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, past + n, generator=g) * 3
    allowed = torch.arange(past + n)[None, :] <= torch.arange(n)[:, None] + past
    return torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)


def reference_cells(m: np.ndarray, f: int, how: str) -> np.ndarray:
    """Pooling by numpy's segment reductions on the whole matrix (float64): max of each block, or its sum over its
    own number of cells."""
    m = m.astype(np.float64)
    r_idx, c_idx = np.arange(0, m.shape[0], f), np.arange(0, m.shape[1], f)
    if how == "max":
        return np.maximum.reduceat(np.maximum.reduceat(m, r_idx, axis=0), c_idx, axis=1)
    sums = np.add.reduceat(np.add.reduceat(m, r_idx, axis=0), c_idx, axis=1)
    rows = np.minimum(r_idx + f, m.shape[0]) - r_idx
    cols = np.minimum(c_idx + f, m.shape[1]) - c_idx
    return sums / np.outer(rows, cols)


class Reads:
    """A reader over a stored matrix that records the blocks asked for."""

    def __init__(self, m: torch.Tensor) -> None:
        self.m, self.asked = m, []

    def __call__(self, rows: slice, cols: slice) -> torch.Tensor:
        self.asked.append((rows.stop - rows.start, cols.stop - cols.start))
        return self.m[rows, cols].clone()


def test_levels_and_tile_counts():
    assert max_level(1) == 0 and max_level(TILE) == 0
    assert max_level(TILE + 1) == 1 and max_level(2 * TILE) == 1
    assert max_level(3 * TILE) == 2 and max_level(8192) == 5
    # 8192 tokens: 1, 2, 4, 8, 16, 32 tiles per side; 700 tokens: 1, 2, 3
    assert [tiles_per_side(8192, L) for L in range(6)] == [1, 2, 4, 8, 16, 32]
    assert [tiles_per_side(700, L) for L in range(3)] == [1, 2, 3]


@pytest.mark.parametrize("n", [200, 256, 700, 1100])
@pytest.mark.parametrize("how", ["max", "mean"])
@pytest.mark.parametrize("base_cells", [64, 4096])  # coarse levels from a pooled base, or every tile streamed
def test_every_tile_of_every_level_is_the_pooled_exact_matrix(n, how, base_cells):
    m = causal_weights(n, seed=n)
    read = Reads(m)
    pyr = HeadPyramid(n, n, base_cells=base_cells, band_rows=96)
    exact = m.numpy()
    assert pyr.levels == max_level(n) + 1
    for level in range(pyr.levels):
        f = 2 ** (pyr.levels - 1 - level)
        ref = reference_cells(exact, f, how)
        k = tiles_per_side(n, level)
        assert k == math.ceil(ref.shape[0] / TILE)
        for row in range(k):
            for col in range(k):
                tile = pyr.tile(read, level, row, col, how).numpy()
                want = ref[row * TILE : (row + 1) * TILE, col * TILE : (col + 1) * TILE]
                assert tile.shape == want.shape
                np.testing.assert_allclose(tile, want, rtol=1e-5, atol=1e-7)


def test_deepest_level_is_exact_and_edge_tiles_are_short():
    n = 700  # 3 tiles per side at the deepest level: 256, 256, 188
    m = causal_weights(n, seed=1)
    pyr, read = HeadPyramid(n, n), Reads(m)
    deepest = pyr.levels - 1
    assert torch.equal(pyr.tile(read, deepest, 2, 1, "max"), m[512:700, 256:512])
    assert torch.equal(pyr.tile(read, deepest, 2, 1, "mean"), m[512:700, 256:512])
    assert pyr.tile(read, deepest, 0, 2).shape == (256, 188)
    assert not pyr.tile(read, deepest, 0, 2).any()  # every key after every query of the first tile: masked, 0


def test_mean_counts_masked_zeros_and_max_keeps_a_sharp_weight():
    n = 512
    m = causal_weights(n, seed=2)
    overview, read = HeadPyramid(n, n), Reads(m)
    mean, top = overview.tile(read, 0, 0, 0, "mean"), overview.tile(read, 0, 0, 0, "max")
    # cell (0, 0) covers queries 0-1 and keys 0-1: weights 1, 0 (masked), w10, w11 → (1 + w10 + w11) / 4 = 2 / 4
    assert mean[0, 0].item() == pytest.approx(0.5, abs=1e-6)
    assert top[0, 0].item() == pytest.approx(1.0)
    # every row sums to 1, so the mean of the whole map is 1 / n; the mean of the cells' means too
    assert mean.double().mean().item() == pytest.approx(1 / n, rel=1e-5)
    # a cell above the diagonal is 0 in both
    assert mean[0, 200].item() == 0 and top[0, 200].item() == 0


def test_long_maps_are_read_in_bands_never_whole():
    n = 2000
    m = causal_weights(n, seed=3)
    reads = Reads(m)
    HeadPyramid(n, n, band_rows=256).tile(reads, 0, 0, 0, "max")
    assert reads.asked and max(r for r, _ in reads.asked) <= 256
    # the future is not read: the first band stops at the band's last query (its keys, rounded to whole cells)
    assert reads.asked[0][1] < n
    assert sum(r * c for r, c in reads.asked) < 0.7 * n * n


def test_a_decode_steps_rectangular_map():
    past, n = 300, 200  # 200 new queries over 500 keys
    m = causal_weights(n, seed=4, past=past)
    pyr, read = HeadPyramid(n, past + n, past=past, base_cells=64), Reads(m)
    ref = reference_cells(m.numpy(), 2, "mean")
    np.testing.assert_allclose(pyr.tile(read, 0, 0, 0, "mean").numpy(), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(pyr.tile(read, 1, 0, 1, "max").numpy(), m[:, 256:].numpy())


@pytest.mark.parametrize("args", [(9, 0, 0), (-1, 0, 0), (1, 3, 0), (1, 0, 3), (0, 1, 0)])
def test_outside_the_pyramid_is_bad_input(args):
    pyr, read = HeadPyramid(700, 700), Reads(causal_weights(700))
    with pytest.raises(BadInput):
        pyr.tile(read, *args)
    with pytest.raises(BadInput):
        pyr.tile(read, 0, 0, 0, "median")


def test_on_a_real_trace_tiles_read_through_attention_block(tiny):
    ids = tiny.encode("the cat sat on the mat and the dog sat on the log " * 8)[:100]
    trace = run_traced(tiny.model, tiny.adapter, ids, [str(i) for i in ids], keep_cache=False)
    n = trace.n_tokens
    for layer, head in [(0, 0), (trace.adapter.n_layer - 1, trace.adapter.n_head - 1)]:
        pyr = HeadPyramid(n, n)
        full = trace.weights(layer)[0, head].float()
        tile = pyr.tile(lambda r, c, layer=layer, head=head: trace.attention_block(layer, head, r, c),
                        pyr.levels - 1, 0, 0, "max")
        assert torch.allclose(tile, full)


# --- the max pool from scores: one exp per (row, cell) ------------------------------------------------------

def causal_scores(n: int, seed: int = 0, past: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_weights``' scores (-inf where not allowed) and each row's log-sum-exp."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, past + n, generator=g) * 3
    allowed = torch.arange(past + n)[None, :] <= torch.arange(n)[:, None] + past
    s = scores.masked_fill(~allowed, -math.inf)
    return s, torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("n, past", [(700, 0), (1100, 0), (300, 37)])
def test_the_max_pool_from_scores_is_the_max_of_the_weights(n, past):
    """exp(max s − lse) against the max of exp(s − lse) over the same cells, edges and a decode's past included.
    Both are fp32 exps of the same fp32 differences; exp is increasing, but its vector lanes and scalar tail may
    round one input differently by an ulp (~1.2e-7 relative): rtol 1e-6."""
    s, lse = causal_scores(n, past=past)
    w = torch.exp(s - lse[:, None])  # 0 where s is -inf
    read = Reads(w)
    for f in (2, 4, 8):
        want = reference_cells(w.numpy(), f, "max")
        got = pooled(read, (0, n), (0, past + n), f, "max", past=past, band_rows=256,
                     scores=lambda r, c: (s[r, c].clone(), lse[r].clone()))
        assert read.asked == []  # the weights were never read
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=0)


def test_the_overview_is_the_level0_max_tile_and_a_kept_level_serves_it():
    n = 1100
    s, lse = causal_scores(n)
    w = torch.exp(s - lse[:, None])
    cells = overview(lambda r, c: (s[r, c].clone(), lse[r].clone()), n, n)
    pyr = HeadPyramid(n, n, base_cells=512)
    fresh = pyr.tile(Reads(w), 0, 0, 0, "max")
    assert cells.shape == fresh.shape == (math.ceil(n / factor(n, 0)),) * 2
    torch.testing.assert_close(cells, fresh, rtol=1e-6, atol=0)  # one ulp of exp, as above
    kept = HeadPyramid(n, n, base_cells=512)
    kept.keep_level("max", 0, cells)
    untouched = Reads(w)
    assert torch.equal(kept.tile(untouched, 0, 0, 0, "max"), cells) and untouched.asked == []
    with pytest.raises(ValueError):  # a level finer than the base is streamed, never kept whole
        kept.keep_level("max", kept.levels - 1, cells)
