"""Arena numbers recomputed a second way: transformers' own forward over the whole prefix for full attention
(logits and attention weights), torch's kl_div / cross_entropy, and a policy store re-run by hand."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from app.cache.arena import budget_tokens, run_arena
from app.cache.paged_decode import forward_through
from app.cache.policies import kept_positions, make_store


def test_kl_agreement_perplexity_and_attention_mass_recomputed(tiny):
    lm, a = tiny, tiny.adapter
    prompt = lm.encode("the cat sat on the mat. the dog sat on the")
    steps, budget = 4, 12
    run = run_arena(lm, prompt, steps=steps, budget=budget, policies=["h2o", "kivi"])
    ref = run["reference"]
    # The full row and the reference are two runs of the same ops through two stores: equal logits but for MKL's
    # run-to-run freedom (MKL_DYNAMIC may pick another thread count, and with it another order of its sums), which
    # moves fp32 logits by ~1e-6 relative and the KL by ~1e-12 nats. Seen once in a whole suite, never alone.
    assert run["runs"][0]["name"] == "full" and all(abs(k) < 1e-9 for k in run["runs"][0]["kl"])
    for r in run["runs"][1:]:
        store = make_store(r["name"], a, budget=budget, reserve=steps - 1, sinks=3)
        logits, kept = [forward_through(lm, store, prompt)[-1]], []
        for s in range(1, steps):
            kept.append([kept_positions(store, layer, a.n_kv_head) for layer in range(a.n_layer)])
            logits.append(forward_through(lm, store, [ref[s - 1]])[-1])
        masses = []
        for s in range(steps):
            prefix = prompt + ref[:s]
            out = lm.model(input_ids=torch.tensor([prefix]), output_attentions=True)
            full = out.logits[0, -1]
            la, lb = F.log_softmax(logits[s].double(), -1), F.log_softmax(full.double(), -1)
            kl = F.kl_div(la, lb, log_target=True, reduction="sum")
            # Two forward paths (the arena's and this one) give fp32 logits that differ by up to eps, ~30 fp32 ulps of
            # their scale (sums in other orders through every layer). Each log-softmax then moves by <= 2 eps, and
            # KL = sum p (la - lb) by <= 4 eps + 2 eps E_p|la - lb| to first order (the log-ratios' change, then p's
            # own); the bound is twice that, for the terms the first order drops.
            eps = 2e-6 * float(full.abs().max())
            bound = 4 * eps * (2 + float((la.exp() * (la - lb).abs()).sum()))
            assert abs(float(kl) - r["kl"][s]) < bound, (s, float(kl), r["kl"][s], bound)
            assert r["agree"][s] == (int(full.argmax()) == int(logits[s].argmax()))
            if s:  # decode steps: full attention's weight on the kept positions + the new token's own
                per_layer = []
                for layer in range(a.n_layer):
                    w = out.attentions[layer][0, :, -1]  # (H, T)
                    pos = torch.cat((kept[s - 1][layer], torch.full((a.n_kv_head, 1), len(prefix) - 1)), 1)
                    per_layer.append(torch.stack([w[h, pos[a.kv_map[h]]].sum() for h in range(a.n_head)]))
                masses.append(torch.stack(per_layer))
        assert torch.allclose(torch.stack(masses).mean(0), torch.tensor(r["mass"]), atol=1e-5)
        nll = F.cross_entropy(torch.stack(logits), torch.tensor(ref), reduction="mean")
        assert math.isclose(r["ppl"], math.exp(float(nll)), rel_tol=1e-5)
    h2o = run["runs"][1]
    assert h2o["tokens_held"] == budget and h2o["bytes_held"] == budget * run["bytes_per_token"]
    assert h2o["mass_mean"] < 1.0 and run["runs"][2]["mass_mean"] == 1.0  # KIVI keeps every token
    kivi = run["runs"][2]
    assert kivi["settings"]["group"] == 32 and kivi["settings"]["residual"] == 32 and kivi["settings"]["bits"] == 2
    assert a.head_dim % kivi["settings"]["v_group"] == 0  # value groups split a head's channels evenly
    assert h2o["settings"] is None  # the budget is its only parameter, shown in the summary


def test_full_attention_margins_and_the_margin_at_each_first_divergence(distil):
    """The margin of full attention's greedy choice (top-1 minus top-2 logit) at every step, recomputed from
    transformers' own forward over the whole prefix; a policy's first divergence carries the margin there."""
    lm = distil
    prompt = lm.encode("The cat sat on the mat because it was")
    steps = 3
    run = run_arena(lm, prompt, steps=steps, budget=3, policies=["window"])
    greedy = run["full_greedy"]
    for s in range(steps):
        with torch.no_grad():
            top = lm.model(input_ids=torch.tensor([prompt + greedy[:s]])).logits[0, -1].double().topk(2).values
        assert abs(run["full_margins"][s] - float(top[0] - top[1])) < 1e-4  # fp32 noise of two forward paths
    window = run["runs"][1]
    d = window["first_divergence"]
    assert d is not None  # three tokens of a random model's context: it diverges
    assert window["divergence_margin"] == run["full_margins"][d]
    assert run["runs"][0]["divergence_margin"] is None  # full attention never diverges from itself


def test_every_evicting_policy_ends_holding_the_whole_budget(tiny):
    """SnapKV leaves room after the prefill for the steps - 1 tokens fed later, no more: it ends at the budget, as the
    others do, so no policy is compared with one token less."""
    prompt = tiny.encode("the cat sat on the mat. the dog sat on the")
    run = run_arena(tiny, prompt, steps=4, budget=12, policies=["window", "streaming", "h2o", "snapkv"])
    assert {r["name"]: r["tokens_held"] for r in run["runs"][1:]} == dict.fromkeys(
        ("window", "streaming", "h2o", "snapkv"), 12)
    snap = next(r for r in run["runs"] if r["name"] == "snapkv")
    assert all(row["bits"].count("1") == 12 for row in snap["keep_map"])  # every layer and KV head


def test_budget_in_bytes_or_percent():
    assert budget_tokens(kind="percent", value=25, total_tokens=100, bytes_per_token=8) == 25
    assert budget_tokens(kind="bytes", value=800, total_tokens=100, bytes_per_token=8) == 100
    assert budget_tokens(kind="bytes", value=100_000, total_tokens=100, bytes_per_token=8) == 100
    assert budget_tokens(kind="bytes", value=3, total_tokens=100, bytes_per_token=8) == 2


def test_a_run_takes_the_model_one_forward_per_piece_and_says_where_it_is(tiny, monkeypatch):
    """What a lab's line relies on: every forward happens inside one ``pace.piece()`` (the lab's holds the model
    gate just that long), each followed by a ``pace.step`` saying where the run is; the numbers are those of a run
    straight through."""
    from contextlib import contextmanager

    from app.cache.arena import forwards

    lm = tiny
    adapter_type = type(lm.adapter)
    original = adapter_type.forward_through
    inside, calls = [False], []

    def counted(self, *args, **kwargs):
        calls.append(inside[0])
        return original(self, *args, **kwargs)

    class Recorder:
        def __init__(self) -> None:
            self.pieces, self.steps = 0, []

        @contextmanager
        def piece(self):
            self.pieces += 1
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

        def step(self, units: float = 1.0, **progress) -> None:
            self.steps.append(progress)

    prompt = lm.encode("the cat sat on the mat. the dog sat on the")
    straight = run_arena(lm, prompt, steps=3, budget=6, policies=["window", "h2o"])
    monkeypatch.setattr(adapter_type, "forward_through", counted)
    pace = Recorder()
    run = run_arena(lm, prompt, steps=3, budget=6, policies=["window", "h2o"], pace=pace)
    # by hand: full attention's greedy reference (3), then full, window and h2o teacher-forced (3) and free (2)
    assert len(calls) == pace.pieces == len(pace.steps) == 3 + 3 * (3 + 2) == forwards(steps=3, policies=2,
                                                                                       reference=False)
    assert all(calls)  # no forward outside a piece
    assert pace.steps[0] == {"phase": "reference", "steps": 3, "step": 1}
    assert [(s["policy"], s["name"]) for s in pace.steps if s["phase"] == "policy" and s["step"] == 1
            and not s.get("free")] == [(1, "full"), (2, "window"), (3, "h2o")]
    assert pace.steps[-1] == {"phase": "policy", "policy": 3, "policies": 3, "name": "h2o", "steps": 3, "step": 3,
                              "free": True}
    for a, b in zip(straight["runs"], run["runs"], strict=True):
        assert a["kl"] == b["kl"] and a["greedy"] == b["greedy"] and a["mass"] == b["mass"]
