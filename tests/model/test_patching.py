"""Activation patching (app/model/patching.py) on every family and on the real SmolLM2.

Each map is checked against what must hold by construction (every activation of a kind patched = the clean run;
none = the corrupted run; the last block's residual at the last position = the clean run) and against a second,
independent implementation: plain transformers forward hooks written here, one forward per cell.

Tolerances: the patched forwards run a batch of B rows where the reference runs one, so matrix products may be
blocked differently and sums reassociated. In fp32 (eps 1.2e-7) through a handful of tiny random layers the last
position's logits differ by a few 1e-6 at most; the metrics compared are logits (|x| < ~10) or probabilities, so
ATOL = 1e-4 leaves two orders of magnitude. SmolLM2's 30 layers and logits near 20 get 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from app.model.capture import hook_count
from app.model.patching import KINDS, Patch, Patcher, Setup, forwards_needed, metric_of, normalized, patch_map
from tests.conftest import ALL_FAMILIES

ATOL = 1e-4
REAL_ATOL = 1e-3


def family_setup(lm, *, metric: str = "logit_diff", direction: str = "denoise") -> Setup:
    """Six tokens from the middle of the vocabulary; the corrupted prompt differs at position 2."""
    v = min(len(lm.tokenizer), lm.adapter.vocab_size)
    clean = tuple(int(v * f) for f in (0.11, 0.23, 0.37, 0.41, 0.53, 0.67))
    corrupted = clean[:2] + (int(v * 0.79),) + clean[3:]
    return Setup(clean, corrupted, answer=int(v * 0.29), wrong=int(v * 0.61), metric=metric, direction=direction)


# --- the reference: plain forward hooks, one forward per cell -------------------------------------------------------
def _hook(module, take, fn):
    """fn(tensor) -> replacement or None, on the tensor ``take`` names."""
    if take == "input0":
        return module.register_forward_pre_hook(lambda _m, args: None if (r := fn(args[0])) is None else (r, *args[1:]))
    return module.register_forward_hook(lambda _m, _a, out: fn(out))


@torch.no_grad()
def reference_cell(lm, setup: Setup, patch: Patch) -> float:
    """Run the source prompt and keep the patched module's tensor; run the base prompt with that one slice replaced."""
    point = lm.adapter.patch_point(patch.kind, patch.layer)
    kept = {}
    handle = _hook(point.module, point.take, lambda t: kept.setdefault("t", t.clone()))
    try:
        lm.model(input_ids=torch.tensor([list(setup.source)]))
    finally:
        handle.remove()
    dh = lm.adapter.head_dim

    def replace(t):
        t = t.clone()
        pos = slice(None) if patch.position is None else patch.position
        if patch.kind == "head" and patch.head is not None:
            cols = slice(patch.head * dh, (patch.head + 1) * dh)
            t[:, pos, cols] = kept["t"][:, pos, cols]
        else:
            t[:, pos] = kept["t"][:, pos]
        return t

    handle = _hook(point.module, point.take, replace)
    try:
        logits = lm.model(input_ids=torch.tensor([list(setup.base)])).logits[:, -1]
    finally:
        handle.remove()
    return float(metric_of(setup, logits)[0])


def every_position(lm, kind: str, layer: int, T: int) -> tuple[Patch, ...]:
    return tuple(Patch(kind, layer, p) for p in range(T))


# --- every family ----------------------------------------------------------------------------------------------
@pytest.fixture(params=[*ALL_FAMILIES, "builtin"])
def family(request):
    """Every family fixture (``any_model``'s) and the built-in tiny model."""
    if request.param == "builtin":
        return request.getfixturevalue("tiny")
    if request.param == "distil":
        return request.getfixturevalue("distil")
    return request.getfixturevalue("family_models")[request.param]


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_patching_every_position_of_a_block_is_the_source_run(family, direction):
    """The whole residual stream after block i taken from the source run: the rest of the forward is the source's."""
    setup = family_setup(family, direction=direction)
    patcher = Patcher(family.model, family.adapter, setup)
    clean, corrupted = patcher.baselines()
    target = clean if direction == "denoise" else corrupted
    cells = [every_position(family, "resid", i, patcher.T) for i in range(family.adapter.n_layer)]
    got = patcher.run(cells)
    assert torch.allclose(got, torch.full_like(got, target), atol=ATOL), (got, target)


def test_patching_nothing_is_the_corrupted_run(family):
    patcher = Patcher(family.model, family.adapter, family_setup(family))
    clean, corrupted = patcher.baselines()
    assert float(patcher.run([()])[0]) == corrupted  # the same forward, batch 1, no hook changing anything: exact
    got = patcher.run([(), (Patch("resid", 0, 0),), ()])  # empty rows beside a patched one, in a batch of three
    assert abs(float(got[0]) - corrupted) < ATOL and abs(float(got[2]) - corrupted) < ATOL


def test_last_block_last_position_is_the_clean_run(family):
    """The logits read the last position of the last block's output only."""
    patcher = Patcher(family.model, family.adapter, family_setup(family))
    clean, _ = patcher.baselines()
    got = float(patcher.run([(Patch("resid", family.adapter.n_layer - 1, patcher.T - 1),)])[0])
    assert abs(got - clean) < ATOL


def test_every_head_of_a_block_is_its_attention_output(family):
    """All heads' slices before the output projection patched = attention's output patched (same projection of the
    same concatenated heads; Gemma's norm after attention included)."""
    patcher = Patcher(family.model, family.adapter, family_setup(family))
    T = patcher.T
    for layer in range(family.adapter.n_layer):
        heads = (Patch("head", layer),)
        attn = every_position(family, "attn", layer, T)
        got = patcher.run([heads, attn])
        assert abs(float(got[0]) - float(got[1])) < ATOL


def checked_blocks(lm) -> list[int]:
    """Every block of the tiny checkpoints (2 or 3); the first and the last of the 6-block DistilGPT-2 shape."""
    L = lm.adapter.n_layer
    return list(range(L)) if L <= 3 else [0, L - 1]


@pytest.mark.parametrize("metric, kinds", [("logit_diff", KINDS), ("prob", ("resid", "head"))])
def test_every_cell_equals_plain_hooks_one_forward_per_cell(family, metric, kinds):
    setup = family_setup(family, metric=metric, direction="noise" if metric == "prob" else "denoise")
    patcher = Patcher(family.model, family.adapter, setup)
    T, L, H = patcher.T, family.adapter.n_layer, family.adapter.n_head
    for kind in kinds:
        got = patch_map(patcher, kind)
        assert got.shape == (L, H if kind == "head" else T)
        for i in checked_blocks(family):
            for j in range(got.shape[1]):
                cell = Patch(kind, i, None, j) if kind == "head" else Patch(kind, i, j)
                assert abs(float(got[i, j]) - reference_cell(family, setup, cell)) < ATOL, (kind, i, j)
    by_position = patch_map(patcher, "head", head=(L - 1, H - 1))
    assert by_position.shape == (T,)
    for p in range(T):
        assert abs(float(by_position[p]) - reference_cell(family, setup, Patch("head", L - 1, p, H - 1))) < ATOL


def test_batched_equals_one_at_a_time(family):
    patcher = Patcher(family.model, family.adapter, family_setup(family))
    patcher.baselines()  # its two forwards counted before the maps'
    for kind in KINDS:
        before = patcher.forwards
        batched = patch_map(patcher, kind)
        assert patcher.forwards - before == forwards_needed(kind, family.adapter, patcher.T) == family.adapter.n_layer
        packed = patch_map(patcher, kind, max_rows=2 * patcher.T)  # two or more blocks in one forward
        assert torch.allclose(batched, packed, atol=ATOL), kind
        if kind == "head" and family.adapter.n_head * family.adapter.n_layer > 48:
            # DistilGPT-2's shape: 6 × 12 heads × T positions one forward each (52 s of the suite). The head path is
            # the same code for every family (the small ones compare it here) and DistilGPT-2's head cells are
            # compared with plain hooks in test_every_cell_equals_plain_hooks_one_forward_per_cell.
            continue
        single = patch_map(patcher, kind, one_at_a_time=True)
        assert torch.allclose(batched, single, atol=ATOL), kind


def test_hooks_are_removed_also_when_the_forward_fails(family):
    patcher = Patcher(family.model, family.adapter, family_setup(family))
    before = hook_count(family.model)
    patch_map(patcher, "head")
    assert hook_count(family.model) == before
    patcher.setup = Setup(patcher.setup.clean, patcher.setup.corrupted, answer=10**9, wrong=0)  # no such token
    with pytest.raises(IndexError):
        patcher.run([(Patch("mlp", 0, 0),)])
    assert hook_count(family.model) == before


# --- the real SmolLM2 ----------------------------------------------------------------------------------------------
def test_real_capital_residual_map_is_the_rome_picture(smol):
    """REFERENCE.md, "Activation patching on the real SmolLM2": ≈ 1 at " France" in the early blocks and at the last
    position in the late ones, ≈ 0 elsewhere."""
    setup = Setup(tuple(smol.encode("The capital of France is")), tuple(smol.encode("The capital of Italy is")),
                  answer=smol.encode(" Paris")[0], wrong=smol.encode(" Rome")[0])
    patcher = Patcher(smol.model, smol.adapter, setup)
    clean, corrupted = patcher.baselines()
    assert abs(clean - 7.31) < 0.01 and abs(corrupted - (-6.02)) < 0.01  # REFERENCE.md's measured logit differences
    m = normalized(patch_map(patcher, "resid"), clean, corrupted)  # (30, 5)
    subject = list(setup.clean).index(4649)  # " France"
    last = len(setup.clean) - 1
    assert m[0, subject] >= 0.9 and m[-1, last] >= 0.9
    assert all(abs(float(m[0, p])) <= 0.1 for p in range(last + 1) if p != subject)
    assert all(abs(float(m[-1, p])) <= 0.1 for p in range(last))
    packed = normalized(patch_map(patcher, "resid", max_rows=64), clean, corrupted)  # as the lab runs it: 3 forwards
    assert torch.allclose(m, packed, atol=REAL_ATOL / (clean - corrupted))
