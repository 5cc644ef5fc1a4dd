"""Speculative decoding: the acceptance rule by hand, lossless output, and the KV-cache rollback."""

from __future__ import annotations

import math

import pytest
import torch

from app.errors import BadInput
from app.model import speculative as spec
from app.model.speculative import GREEDY, SAMPLE, Runner, accept, make_draft, plain_decode, speculate

PROMPTS = ["The cache holds", "Attention reads every key", "Once upon a time", "KV"]


# --- the rule, worked by hand ----------------------------------------------------------------------------------

def test_greedy_rule_keeps_the_longest_agreeing_prefix_then_the_targets_token():
    # argmax of p per row: 2, 1, 2, 0. The draft agrees twice, then says 0 where the target says 2.
    p = torch.tensor([[0.1, 0.2, 0.7], [0.1, 0.8, 0.1], [0.3, 0.1, 0.6], [0.5, 0.3, 0.2]])
    q = torch.full((3, 3), 1 / 3)
    v = accept([2, 1, 0], q, p, mode=GREEDY)
    assert (v.accepted, v.token, v.bonus, v.ratios) == (2, 2, False, [1.0, 1.0, 0.0])
    v = accept([2, 1, 2], q, p, mode=GREEDY)  # every draft agrees: the bonus token is argmax of p[γ]
    assert (v.accepted, v.token, v.bonus) == (3, 0, True)


def test_sampling_rule_matches_a_hand_worked_example():
    # Position 1: draft token 1 with q = 0.3, p = 0.6 -> min(1, 0.6/0.3) = 1, kept whatever r is.
    # Position 2: draft token 0 with q = 0.5, p = 0.2 -> kept with probability 0.4; on rejection the next token
    # is drawn from normalize(max(0, p − q)) = normalize([0, 0.2, 0.1]) = [0, 2/3, 1/3].
    q = torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.3, 0.2]])
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.5, 0.3], [0.6, 0.2, 0.2]])
    kept = rejected = 0
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        replay = torch.Generator().manual_seed(seed)
        r1, r2 = float(torch.rand((), generator=replay)), float(torch.rand((), generator=replay))
        v = accept([1, 0], q, p, mode=SAMPLE, generator=g)
        assert v.ratios[0] == 1.0 and r1 < 1.0
        assert v.ratios[1] == pytest.approx(0.4)
        if r2 < 0.4:
            kept += 1
            assert v.accepted == 2 and v.bonus and v.residual is None
        else:
            rejected += 1
            assert v.accepted == 1 and not v.bonus
            assert torch.allclose(v.residual, torch.tensor([0.0, 2 / 3, 1 / 3]))
            assert v.token in (1, 2)  # never the rejected token 0: its residual mass is 0
    assert kept and rejected


def test_a_draft_the_target_gives_zero_probability_is_always_rejected():
    q = torch.tensor([[0.9, 0.1, 0.0]])
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    for seed in range(50):
        v = accept([0], q, p, mode=SAMPLE, generator=torch.Generator().manual_seed(seed))
        assert v.accepted == 0 and v.ratios == [0.0] and v.token in (1, 2)


# --- lossless --------------------------------------------------------------------------------------------------

def chi_square_threshold(df: int, z: float = 3.0902) -> float:
    """Upper α = 0.001 point of χ²(df) by the Wilson–Hilferty approximation (z = Φ⁻¹(0.999))."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs``; bins expected below 5 are pooled into one."""
    n = float(counts.sum())
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def test_sampled_speculative_first_token_has_the_targets_distribution(tiny):
    """20 000 seeded rounds of the rule on the built-in model's real p (all blocks) and q (first block only),
    γ = 1: the first output token is the draft's if kept, else a residual draw. Its histogram must pass
    Pearson's χ² test against p at α = 0.001 — and the draft's own tokens, without the rule, must fail it."""
    ids = tiny.encode("The cache holds")
    p_row = spec.distribution(Runner(tiny).forward(ids)[-1], mode=SAMPLE, temperature=1.0)
    q_row = spec.distribution(Runner(tiny, exit_layer=1).forward(ids)[-1], mode=SAMPLE, temperature=1.0)
    p = torch.stack([p_row, p_row])  # the bonus row is never reached by the first token's path when rejected
    g = torch.Generator().manual_seed(1234)
    n = 20_000
    out = torch.zeros_like(p_row)
    raw = torch.zeros_like(p_row)
    for _ in range(n):
        d = int(torch.multinomial(q_row, 1, generator=g))
        raw[d] += 1
        v = accept([d], q_row[None], p, mode=SAMPLE, generator=g)
        out[d if v.accepted else v.token] += 1
    stat, df = chi_square(out, p_row)
    assert stat < chi_square_threshold(df), (stat, df, chi_square_threshold(df))
    stat_raw, df_raw = chi_square(raw, p_row)
    assert stat_raw > chi_square_threshold(df_raw), (stat_raw, df_raw)  # the test can tell the two apart


def test_chi_square_threshold_matches_the_table():
    # Tabulated upper 0.001 points of χ²: df 10 -> 29.588, df 100 -> 149.449.
    assert chi_square_threshold(10) == pytest.approx(29.588, rel=0.01)
    assert chi_square_threshold(100) == pytest.approx(149.449, rel=0.005)


@pytest.mark.parametrize("exit_layer", [1, None])
def test_greedy_speculative_equals_target_greedy_with_an_early_exit_draft(tiny, exit_layer):
    k = exit_layer or tiny.adapter.n_layer
    for prompt in PROMPTS:
        ids = tiny.encode(prompt)
        result = speculate(Runner(tiny), Runner(tiny, exit_layer=k), ids, gamma=3, max_new_tokens=12)
        plain, _ = plain_decode(Runner(tiny), ids, max_new_tokens=12)
        assert result.output == plain, prompt


def test_greedy_speculative_equals_target_greedy_with_a_second_model_draft(family_models):
    target, draft = family_models["llama"], family_models["qwen2"]
    for prompt in PROMPTS[:2]:
        ids = target.encode(prompt)
        result = speculate(Runner(target), make_draft(target, kind="model", other=draft), ids, gamma=2,
                           max_new_tokens=8)
        plain, _ = plain_decode(Runner(target), ids, max_new_tokens=8)
        assert result.output == plain


def test_early_exit_at_every_layer_is_the_model_itself_and_accepts_every_token(llama):
    ids = llama.encode(PROMPTS[1])
    full = Runner(llama).forward(ids)
    exited = Runner(llama, exit_layer=llama.adapter.n_layer).forward(ids)
    assert torch.allclose(full, exited, atol=1e-5)
    result = speculate(Runner(llama), Runner(llama, exit_layer=llama.adapter.n_layer), ids, gamma=3, max_new_tokens=9)
    assert result.acceptance_rate == 1.0 and all(r.bonus for r in result.rounds)
    assert result.mean_accepted == 3 and result.forwards_per_token == pytest.approx(len(result.rounds) / 9)


# --- the rollback ------------------------------------------------------------------------------------------------

def _layers(cache, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(n)]


def test_rollback_leaves_each_cache_equal_to_one_built_from_the_accepted_tokens_only(llama):
    """A draft that is often wrong (one block of two), sampled so rejections happen: after the run both caches
    must equal caches built by one forward over the committed tokens (all but the newest)."""
    ids = llama.encode(PROMPTS[0])
    target, draft = Runner(llama), Runner(llama, exit_layer=1)
    result = speculate(target, draft, ids, gamma=4, max_new_tokens=10, mode=SAMPLE, temperature=1.5, seed=3)
    assert any(r.accepted < 4 for r in result.rounds), "no rejection: the test would check nothing"
    for r in result.rounds:
        assert r.target_before - r.target_after == 4 - r.accepted
    committed = ids + [t for r in result.rounds for t in r.drafted[: r.accepted] + [r.token]]
    fresh_t, fresh_d = Runner(llama), Runner(llama, exit_layer=1)
    fresh_t.forward(committed[:-1])
    fresh_d.forward(committed[: draft.length])
    assert target.length == len(committed) - 1
    assert draft.length <= len(committed) - 1
    n = llama.adapter.n_layer
    for (k, v), (k2, v2) in zip(_layers(target.cache, n), _layers(fresh_t.cache, n), strict=True):
        assert k.shape == k2.shape and torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)
    k, v = _layers(draft.cache, 1)[0]
    k2, v2 = _layers(fresh_d.cache, 1)[0]
    assert k.shape == k2.shape and torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)


def test_rollback_crops_only_the_tail(tiny):
    runner = Runner(tiny)
    keys = torch.arange(2 * 7 * 3, dtype=torch.float32).reshape(1, 2, 7, 3)
    runner.cache.update(keys, -keys, 0)
    assert runner.rollback(4) == 3 and runner.length == 4
    assert torch.equal(runner.cache.layers[0].keys, keys[:, :, :4])
    assert runner.rollback(4) == 0


# --- refusals ----------------------------------------------------------------------------------------------------

def test_a_draft_with_another_tokenizer_is_refused_with_the_reason(tiny, distil):
    with pytest.raises(BadInput) as err:
        make_draft(distil, kind="model", other=tiny)
    assert err.value.key == "err.spec.tokenizer" and "tokenizer" in err.value.message


@pytest.mark.parametrize("k", [0, 3, -1, None])
def test_an_exit_layer_out_of_range_is_refused(tiny, k):
    with pytest.raises(BadInput) as err:
        make_draft(tiny, kind="early", exit_layer=k)
    assert err.value.key == "err.spec.exit_layer"


def test_no_second_model_says_none_is_available(tiny):
    with pytest.raises(BadInput) as err:
        make_draft(tiny, kind="model", other=None)
    assert err.value.key == "err.spec.no_draft_model"
