"""Head-role scores: each derived again on hand-built attention patterns, against TransformerLens's own
definition (from token ids, not positions), and on the real model against transformers' eager attentions."""

from __future__ import annotations

import pytest
import torch

from app.viz.head_roles import LOCAL_FAR, LOCAL_NEAR, ROLES, head_roles_view, role_scores, score_table

N = 40  # tokens per copy
T = 2 * N


def one_hot_pattern(target) -> torch.Tensor:
    """(1, T, T) attention where query i puts all its weight on key ``target(i)``."""
    w = torch.zeros(1, T, T)
    for i in range(T):
        w[0, i, target(i)] = 1.0
    return w


# Each role's pure pattern. Induction and duplicate keys exist only in the second copy; in the first, such a
# head parks its weight on token 0 (what real induction heads do).
PURE = {
    "previous": lambda i: max(i - 1, 0),
    "induction": lambda i: i - N + 1 if i >= N else 0,
    "duplicate": lambda i: i - N if i >= N else 0,
    "first": lambda i: 0,
    "self": lambda i: i,
    "local": lambda i: i - 4 if i >= 5 else 0,
}


def expected_scores(w: torch.Tensor, n: int) -> dict[str, float]:
    """The scores of one head (T, T), written out query by query from the definitions in the module docstring."""
    size = w.shape[0]

    def mean(pairs):
        pairs = list(pairs)
        return sum(float(w[i, j]) for i, j in pairs) / len(pairs)

    local = [sum(float(w[i, i - d]) for d in range(LOCAL_NEAR, LOCAL_FAR + 1)) for i in range(LOCAL_FAR + 1, size)]
    return {
        "previous": mean((i, i - 1) for i in range(1, size)),
        "induction": mean((i, i - n + 1) for i in range(n, size)),
        "duplicate": mean((i, i - n) for i in range(n, size)),
        "first": mean((i, 0) for i in range(1, size)),
        "self": mean((i, i) for i in range(1, size)),
        "local": sum(local) / len(local),
    }


@pytest.mark.parametrize("role", ROLES)
def test_a_pure_pattern_scores_one_on_its_role_and_near_zero_elsewhere(role):
    w = one_hot_pattern(PURE[role])
    got = {r: float(s[0]) for r, s in role_scores(w, period=N).items()}
    assert got[role] == pytest.approx(1.0)
    assert got == pytest.approx(expected_scores(w[0], N))
    for other in ROLES:
        if other == role:
            continue
        if other == "first" and role in ("induction", "duplicate", "local"):
            # Their queries with no key of their own (first copy; the start, for local) read token 0.
            parked = sum(PURE[role](i) == 0 for i in range(1, T))
            assert got["first"] == pytest.approx(parked / (T - 1))
        else:
            # At most one query where two roles share a key: query 1 (key 0 = key i - 1), query n (key 0 = key i - n).
            assert got[other] <= 1 / N + 1e-9, (other, got[other])


def test_scores_of_random_attention_match_a_query_by_query_recomputation():
    torch.manual_seed(0)
    raw = torch.randn(3, T, T) * 3
    w = torch.softmax(raw.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")), dim=-1)
    got = role_scores(w, period=N)
    for h in range(3):
        want = expected_scores(w[h], N)
        for role in ROLES:
            assert float(got[role][h]) == pytest.approx(want[role], abs=1e-6)


def transformerlens_mul(w: torch.Tensor, detection: torch.Tensor) -> float:
    """TransformerLens's head_detector score ("mul"): Σ(attention · detection pattern) / Σ attention."""
    return float((w * detection).sum() / w.sum())


def test_previous_duplicate_and_induction_agree_with_transformerlens_definitions_from_token_ids():
    """TransformerLens builds its patterns from token equality; ours from positions. On a sequence whose first copy
    has no repeated token they select the same keys, and TL divides by all T queries where we divide by the
    queries the role exists for (T - 1 for previous, n for the second copy)."""
    torch.manual_seed(1)
    tokens = torch.randperm(1000)[:N].repeat(2)  # N distinct ids, twice
    eq = (tokens[:, None] == tokens[None, :]).float()
    eq.fill_diagonal_(0)
    duplicate = torch.tril(eq)
    induction = torch.tril(torch.cat([torch.zeros(T, 1), torch.roll(duplicate, 1, dims=1)[:, 1:]], dim=1))
    previous = torch.tril(torch.diag(torch.ones(T - 1), -1))
    w = torch.softmax(torch.randn(1, T, T).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")), -1)
    ours = role_scores(w, period=N)
    assert float(ours["previous"][0]) * (T - 1) / T == pytest.approx(transformerlens_mul(w[0], previous), rel=1e-6)
    assert float(ours["duplicate"][0]) * N / T == pytest.approx(transformerlens_mul(w[0], duplicate), rel=1e-6)
    assert float(ours["induction"][0]) * N / T == pytest.approx(transformerlens_mul(w[0], induction), rel=1e-6)


def test_the_view_ranks_each_column_and_names_the_strongest_role():
    layers = [torch.cat([one_hot_pattern(PURE[r]) for r in ("previous", "self")]),
              torch.cat([one_hot_pattern(PURE[r]) for r in ("induction", "first")])]
    scores = score_table(layers, period=N)
    texts = [f"t{i}" for i in range(T)]
    view = head_roles_view(scores, kv_map=(0, 0), model="m", text="x", ids=list(range(T)), token_texts=texts, period=N)
    best = {(r["layer"], r["head"]): r["best"] for r in view["rows"]}
    assert best == {(0, 0): "previous", (0, 1): "self", (1, 0): "induction", (1, 1): "first"}
    top = {s["role"]: (s["top"][0]["layer"], s["top"][0]["head"]) for s in view["summary"]}
    assert top["previous"] == (0, 0) and top["induction"] == (1, 0) and top["self"] == (0, 1)
    assert {s["role"]: s["strong"] for s in view["summary"]}["first"] == 1  # only the sink itself reaches 0.5
    assert view["grouped"] and view["query"] == T - 1
    href = view["rows"][2]["href"]  # layer 1, head 0
    assert "layer=1" in href and "head=0" in href and f"q={T - 1}" in href


def test_a_sequence_too_short_for_the_local_window_leaves_that_role_empty_not_wrong():
    n = 3  # 6 tokens: no query has 8 tokens (and token 0) before it
    w = torch.softmax(torch.randn(2, 2 * n, 2 * n).masked_fill(torch.ones(2 * n, 2 * n).triu(1).bool(), -1e9), -1)
    scores = score_table([w], period=n)
    assert torch.isnan(scores["local"]).all() and not torch.isnan(scores["induction"]).any()
    view = head_roles_view(scores, kv_map=(0, 1), model="m", text="x", ids=[0] * 6, token_texts=["a"] * 6, period=n)
    assert all(r["scores"]["local"] is None for r in view["rows"])
    assert next(s for s in view["summary"] if s["role"] == "local")["top"] == []
