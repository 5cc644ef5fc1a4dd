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


# --- prompt lookup ------------------------------------------------------------------------------------------------

def brute_force_lookup(ids: list[int], gamma: int, max_ngram: int) -> tuple[list[int], int, int]:
    """Every (n, start) with ids[start:start+n] equal to the last n tokens and a token after it, the longest n
    first, then the earliest start: the rule ``lookup`` states (transformers' and vLLM's)."""
    found = [(n, start) for n in range(1, max_ngram + 1) for start in range(len(ids))
             if start + n < len(ids) and n < len(ids) and ids[start:start + n] == ids[len(ids) - n:]]
    if not found:
        return [], 0, -1
    n, start = min(found, key=lambda f: (-f[0], f[1]))
    return ids[start + n:start + n + gamma], n, start


@pytest.mark.parametrize(("ids", "gamma", "max_ngram", "expected"), [
    ([1, 2, 3, 4], 3, 3, ([], 0, -1)),  # no token repeats: nothing to propose
    ([5], 3, 3, ([], 0, -1)),  # one token: no earlier context at all
    ([5, 1, 2, 9, 1, 2, 7, 1, 2], 2, 2, ([9, 1], 2, 1)),  # "1 2" at 1 and 4: the earliest wins
    ([3, 1, 2, 8, 4, 1, 2, 9, 4, 1, 2], 2, 3, ([9, 4], 3, 4)),  # the 3-gram "4 1 2" beats the earlier 2-gram
    ([3, 1, 2, 8, 4, 1, 2, 9, 4, 1, 2], 2, 2, ([8, 4], 2, 1)),  # capped at n = 2: "1 2" first occurs at 1
    ([1, 2, 1, 2], 5, 2, ([1, 2], 2, 0)),  # the context ends: fewer than γ tokens
    ([7, 8, 9, 7, 8, 9], 4, 1, ([7, 8, 9], 1, 2)),  # n = 1 only: "9" at 2
    ([4, 4, 4], 3, 3, ([4], 2, 0)),  # overlapping matches: "4 4" at 0 is followed by the last 4
])
def test_lookup_proposals_by_hand_and_by_brute_force(ids, gamma, max_ngram, expected):
    assert spec.lookup(ids, gamma, max_ngram) == expected
    assert brute_force_lookup(ids, gamma, max_ngram) == expected


def test_lookup_matches_brute_force_and_transformers_prompt_lookup_on_random_contexts():
    """Random contexts over 3-5 token ids (many repeats): ``lookup`` = the brute-force search, and its tokens =
    transformers' own ``PromptLookupCandidateGenerator`` (the generator ``generate(prompt_lookup_num_tokens=γ)``
    uses), whose candidates are the context with the proposal appended."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    g = torch.Generator().manual_seed(0)
    matched = 0
    for _ in range(400):
        length = int(torch.randint(1, 30, (), generator=g))
        vocab = int(torch.randint(3, 6, (), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        gamma, max_ngram = int(torch.randint(1, 6, (), generator=g)), int(torch.randint(1, 4, (), generator=g))
        got = spec.lookup(ids, gamma, max_ngram)
        assert got == brute_force_lookup(ids, gamma, max_ngram), (ids, gamma, max_ngram)
        hf = PromptLookupCandidateGenerator(num_output_tokens=gamma, max_matching_ngram_size=max_ngram,
                                            max_length=10_000)
        candidates, _ = hf.get_candidates(torch.tensor([ids]))
        assert candidates[0, length:].tolist() == got[0], (ids, gamma, max_ngram)
        matched += bool(got[0])
    assert 100 < matched < 400  # both kinds of context were tried


REPEATING = ["The cache holds the keys. The cache holds the", "KV cache, KV cache, KV cache, KV", "Once upon a time"]


def test_greedy_speculative_with_prompt_lookup_equals_target_greedy(any_model):
    for prompt in REPEATING:
        ids = any_model.encode(prompt)
        result = speculate(Runner(any_model), make_draft(any_model, kind="lookup", max_ngram=3), ids, gamma=4,
                           max_new_tokens=10)
        plain, _ = plain_decode(Runner(any_model), ids, max_new_tokens=10)
        assert result.output == plain, prompt
        assert result.draft_forwards == 0 and result.target_forwards == len(result.rounds)
    assert result.rounds[0].ngram is not None


def test_prompt_lookup_rounds_say_what_matched_and_a_round_without_a_match_is_a_plain_step(tiny):
    """Each round's proposal is ``lookup`` of the context as the round began; a round with no match drafts nothing,
    its verify forward feeds one token and the target's token is neither a bonus nor a correction."""
    ids = tiny.encode(REPEATING[0])
    target = Runner(tiny)
    result = speculate(target, make_draft(tiny, kind="lookup", max_ngram=2), ids, gamma=3, max_new_tokens=16)
    context = list(ids)
    kinds = set()
    for r in result.rounds:
        room = 16 - (len(context) - len(ids)) - 1  # transformers' rule: no drafts past the budget's last token
        proposal, n, at = spec.lookup(context, max(0, min(3, room)), 2)
        assert (r.drafted, r.ngram, r.match_at) == (proposal, n, at)
        assert r.q == [1.0] * len(r.drafted)  # one-hot: the draft is certain of its token
        if not r.drafted:
            assert r.accepted == 0 and not r.bonus and r.target_before == r.target_after
            kinds.add("plain")
        else:
            kinds.add("bonus" if r.bonus else "correction")
        context += r.drafted[:r.accepted] + [r.token]
    assert context[len(ids):][:16] == result.output
    assert result.acceptance_rate == sum(r.accepted for r in result.rounds) / sum(len(r.drafted) for r in result.rounds)
    assert result.drafts == sum(bool(r.drafted) for r in result.rounds)


def test_prompt_lookup_rollback_leaves_the_target_cache_equal_to_the_committed_tokens(llama):
    """Sampled, so drafts are rejected: the target's cache must equal one built by one forward over the committed
    tokens (all but the newest); the lookup keeps no cache to roll back."""
    ids = llama.encode(REPEATING[1])
    target, draft = Runner(llama), make_draft(llama, kind="lookup", max_ngram=3)
    result = speculate(target, draft, ids, gamma=4, max_new_tokens=12, mode=SAMPLE, temperature=1.5, seed=2)
    assert any(r.drafted and r.accepted < len(r.drafted) for r in result.rounds), "no rejection: nothing checked"
    for r in result.rounds:
        assert r.target_before - r.target_after == len(r.drafted) - r.accepted
        assert r.draft_before == r.draft_after == 0
    committed = ids + [t for r in result.rounds for t in r.drafted[: r.accepted] + [r.token]]
    fresh = Runner(llama)
    fresh.forward(committed[:-1])
    assert target.length == len(committed) - 1 and draft.length == 0
    n = llama.adapter.n_layer
    for (k, v), (k2, v2) in zip(_layers(target.cache, n), _layers(fresh.cache, n), strict=True):
        # One forward over all tokens vs the same tokens fed in rounds: different shapes, so fp32 tolerance.
        assert k.shape == k2.shape and torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)


def test_sampled_prompt_lookup_first_token_has_the_targets_distribution(tiny):
    """A one-hot q: the rule keeps the proposed token with probability p(d) and otherwise draws from p without d,
    so the first output token must follow p. 20 000 seeded rounds against the built-in model's real p, the
    proposal fixed to a token p finds likely; Pearson's χ² at α = 0.001."""
    ids = tiny.encode("The cache holds")
    p_row = spec.distribution(Runner(tiny).forward(ids)[-1], mode=SAMPLE, temperature=1.0)
    d = int(torch.argsort(p_row, descending=True)[1])  # the runner-up: kept often, rejected often
    q = torch.nn.functional.one_hot(torch.tensor([d]), p_row.shape[0]).float()
    p = torch.stack([p_row, p_row])
    g = torch.Generator().manual_seed(7)
    out = torch.zeros_like(p_row)
    for _ in range(20_000):
        v = accept([d], q, p, mode=SAMPLE, generator=g)
        out[d if v.accepted else v.token] += 1
    stat, df = chi_square(out, p_row)
    assert stat < chi_square_threshold(df), (stat, df)
    assert 0 < out[d] < 20_000


def test_greedy_prompt_lookup_on_smollm2_copies_the_sentence_as_plain_greedy_does(smol):
    """The copy preset through the chat template on the real model: the output equals plain greedy token for
    token, and the lookup keeps drafts (the answer repeats the prompt)."""
    from app.labs.speculative import PRESETS

    ids = smol.encode_chat(PRESETS["copy"].prompt)
    result = speculate(Runner(smol), make_draft(smol, kind="lookup", max_ngram=3), ids, gamma=8,
                       max_new_tokens=48, stop=smol.end_ids)
    plain, _ = plain_decode(Runner(smol), ids, max_new_tokens=48, stop=smol.end_ids)
    assert result.output == plain and result.ended and plain[-1] == 2  # the answer ends at <|im_end|>
    assert result.mean_accepted > 1 and result.tokens_per_forward > 2
    # Greedy up to the end token, derived a second way: transformers' own generate, stopping at the same eos.
    x = torch.tensor([ids])
    with torch.no_grad():
        hf = smol.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=48,
                                 eos_token_id=2, pad_token_id=2)
    assert hf[0, len(ids):].tolist() == result.output


def test_prompt_lookup_drafts_nothing_from_a_stop_token_on_and_still_decodes_greedily(tiny):
    """As transformers' prompt lookup: a draft is cut before the first stop token it would copy (a chat prompt
    holds the end of turn), so the verify forward never feeds tokens past it; the output is plain greedy's."""
    ids = tiny.encode(REPEATING[0])
    plain, _ = plain_decode(Runner(tiny), ids, max_new_tokens=16)
    stop = {plain[5]}  # a token greedy decoding reaches, which the repeating text holds for the lookup to copy
    want, _ = plain_decode(Runner(tiny), ids, max_new_tokens=16, stop=stop)
    result = speculate(Runner(tiny), make_draft(tiny, kind="lookup", max_ngram=2), ids, gamma=3, max_new_tokens=16,
                       stop=stop)
    assert result.output == want and result.output[-1] in stop
    assert not any(t in stop for r in result.rounds for t in r.drafted)
    assert any(plain[5] in spec.lookup(list(ids) + plain[:k], 3, 2)[0] for k in range(6))  # the cut was needed
