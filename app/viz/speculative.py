"""Speculative runs turned into view data: rounds of coloured tokens, p and q, cache lengths, the run's figures."""

from __future__ import annotations

from app.model.spec_lab import SpecRun
from app.viz.tokens import honest_texts


def spec_view(run: SpecRun) -> dict:
    lm, r = run.lm, run.result
    rounds = []
    for rd in r.rounds:
        texts = honest_texts(lm, rd.drafted + [rd.token])
        tokens = []
        for i, (tid, q, p) in enumerate(zip(rd.drafted, rd.q, rd.p, strict=True)):
            status = "accepted" if i < rd.accepted else ("rejected" if i == rd.accepted else "discarded")
            ratio = rd.ratios[i] if i < len(rd.ratios) else None
            tokens.append({"id": tid, "text": texts[i], "q": q, "p": p, "ratio": ratio, "status": status})
        rounds.append({
            "index": rd.index, "tokens": tokens, "accepted": rd.accepted,
            "final": {"id": rd.token, "text": texts[-1], "p": rd.token_p,
                      "kind": "bonus" if rd.bonus else "correction"},
            "target_before": rd.target_before, "target_after": rd.target_after,
            "draft_before": rd.draft_before, "draft_after": rd.draft_after, "ms": rd.ms,
        })
    return {
        "model": lm.name, "draft": r.draft_label, "draft_name": run.draft_name, "exit_layer": run.exit_layer,
        "n_layer": lm.adapter.n_layer, "gamma": r.gamma, "mode": r.mode,
        "prompt_tokens": len(r.prompt_ids), "tokens": r.tokens, "rounds": rounds,
        "output_text": lm.tokenizer.decode(r.output, clean_up_tokenization_spaces=False),
        "plain_text": (lm.tokenizer.decode(r.plain_output, clean_up_tokenization_spaces=False)
                       if r.plain_output is not None else None),
        "num_accepted_tokens_per_pos": r.accepted_per_pos(),
        "acceptance_per_pos": r.acceptance_rate_per_pos(),
        "acceptance": r.acceptance_rate, "mean_accepted": r.mean_accepted,
        "forwards_per_token": r.forwards_per_token, "target_forwards": r.target_forwards,
        "draft_forwards": r.draft_forwards,
        "spec_ms": r.spec_ms, "plain_ms": r.plain_ms, "speedup": r.speedup, "same_as_plain": r.same_as_plain,
        "candidates": run.candidates,
    }
