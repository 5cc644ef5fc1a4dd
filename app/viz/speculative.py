"""Speculative runs turned into view data: rounds of coloured tokens, p and q, cache lengths and the paged blocks
each round wrote and freed, the run's figures. ``run`` is an ``app.labs.speculative.SpecRun`` (``SpecRunState``:
what these views read of it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from app.cache.speculative_blocks import slots
from app.i18n import translate
from app.kv_bytes import dtype_name, page_bytes
from app.model.loading import LoadedModel
from app.model.speculative import Round, SpecResult
from app.viz.tokens import end_tokens, honest_texts, visible


class SpecRunState(Protocol):
    """What a view reads of one speculative run (``app.labs.speculative.SpecRun``)."""

    lm: LoadedModel
    draft_kind: str  # early | model | lookup
    draft_name: str
    exit_layer: int | None
    max_ngram: int | None
    result: SpecResult
    candidates: list[str]
    blocks: list[dict]  # per round: {"target": snapshot, "draft": snapshot or None}
    block_size: int
    draft_lm: LoadedModel | None


def block_bytes(lm: LoadedModel, block_size: int, n_layer: int | None = None) -> int:
    """Bytes of one paged block of ``lm``'s K/V (``n_layer`` layers: an early exit fills only its first k)."""
    a = lm.adapter
    return int(page_bytes(block_size=block_size, n_layer=n_layer or a.n_layer, n_kv_head=a.n_kv_head,
                          head_dim=a.head_dim, dtype=dtype_name(a.dtype)))


def block_view(snap: dict, nbytes: int) -> dict:
    """One cache's blocks in one round: the blocks the round touched (from the one holding its first new slot), the
    earlier ones only counted; ids taken from the pool and freed back to it; the pool's use before and after."""
    shown_from = snap["start"] // snap["block_size"]
    blocks = slots(snap)
    return {
        "blocks": blocks[shown_from:], "earlier": shown_from, "taken": snap["taken"], "freed": snap["freed"],
        "used_peak": snap["num_blocks"] - snap["free_at_peak"], "used": snap["num_blocks"] - snap["free"],
        "num_blocks": snap["num_blocks"], "start": snap["start"], "peak_length": snap["peak_length"],
        "length": snap["length"], "freed_bytes": len(snap["freed"]) * nbytes,
        "dropped_slots": snap["peak_length"] - snap["length"],
    }


def final_kind(rd: Round) -> str:
    """The target's own token of a round: a bonus (every draft kept), a correction, or a plain step (prompt lookup
    found nothing to draft)."""
    return "bonus" if rd.bonus else "correction" if rd.drafted else "plain"


def spec_view(run: SpecRunState) -> dict:
    lm, r = run.lm, run.result
    t_bytes = block_bytes(lm, run.block_size)
    d_bytes = block_bytes(run.draft_lm, run.block_size, run.exit_layer) if run.draft_lm is not None else 0
    rounds = []
    context = list(r.prompt_ids)  # the committed tokens as each round begins (what prompt lookup searches)
    for n, rd in enumerate(r.rounds):
        texts = honest_texts(lm, rd.drafted + [rd.token])
        lookup = None
        if rd.ngram is not None:
            at = rd.match_at if rd.ngram else None
            lookup = {"n": rd.ngram, "at": at, "context": len(context),
                      "gram": visible("".join(honest_texts(lm, context[len(context) - rd.ngram:]))) if rd.ngram else "",
                      "follow_at": at + rd.ngram if at is not None else None}
        context += rd.drafted[:rd.accepted] + [rd.token]
        tokens = []
        for i, (tid, q, p) in enumerate(zip(rd.drafted, rd.q, rd.p, strict=True)):
            status = "accepted" if i < rd.accepted else ("rejected" if i == rd.accepted else "discarded")
            ratio = rd.ratios[i] if i < len(rd.ratios) else None
            tokens.append({"id": tid, "text": texts[i], "q": q, "p": p, "ratio": ratio, "status": status})
        snaps = run.blocks[n]
        rounds.append({
            "index": rd.index, "tokens": tokens, "accepted": rd.accepted, "lookup": lookup,
            "final": {"id": rd.token, "text": texts[-1], "p": rd.token_p, "kind": final_kind(rd)},
            "target_start": rd.target_start, "draft_start": rd.draft_start,
            "target_before": rd.target_before, "target_after": rd.target_after,
            "draft_before": rd.draft_before, "draft_after": rd.draft_after, "ms": rd.ms,
            "draft_ms": rd.draft_ms, "verify_ms": rd.verify_ms,
            "blocks": {"target": block_view(snaps["target"], t_bytes),
                       "draft": block_view(snaps["draft"], d_bytes) if snaps["draft"] is not None else None},
        })
    return {
        "model": lm.name, "draft": r.draft_label, "draft_kind": run.draft_kind, "draft_name": run.draft_name,
        "exit_layer": run.exit_layer, "max_ngram": run.max_ngram,
        "n_layer": lm.adapter.n_layer, "gamma": r.gamma, "mode": r.mode,
        "prompt_tokens": len(r.prompt_ids), "tokens": r.tokens, "rounds": rounds,
        "output_text": lm.tokenizer.decode(r.output, clean_up_tokenization_spaces=False),
        "plain_text": (lm.tokenizer.decode(r.plain_output, clean_up_tokenization_spaces=False)
                       if r.plain_output is not None else None),
        "num_accepted_tokens_per_pos": r.accepted_per_pos(),
        "acceptance_per_pos": r.acceptance_rate_per_pos(),
        "acceptance": r.acceptance_rate, "mean_accepted": r.mean_accepted, "drafts": r.drafts,
        "drafted_tokens": r.drafted_tokens, "plain_rounds": len(r.rounds) - r.drafts,
        "tokens_per_forward": r.tokens_per_forward, "draft_ms": r.draft_ms, "verify_ms": r.verify_ms,
        "forwards_per_token": r.forwards_per_token, "target_forwards": r.target_forwards,
        "draft_forwards": r.draft_forwards,
        "ended": r.ended, "end_token": end_tokens(lm), "went_on": not r.stop,
        "spec_ms": r.spec_ms, "plain_ms": r.plain_ms, "speedup": r.speedup, "same_as_plain": r.same_as_plain,
        "candidates": run.candidates,
        "block_size": run.block_size, "block_bytes": {"target": t_bytes, "draft": d_bytes},
    }


# --- one prompt, every draft ---------------------------------------------------------------------------------

def draft_name(run: SpecRunState, lang: str) -> str:
    """The draft in words: prompt lookup (n ≤ N), the early exit (first k of n blocks), or the second model."""
    if run.draft_kind == "lookup":
        return translate("spec.name.lookup", lang, n=run.max_ngram)
    if run.draft_kind == "early":
        return translate("spec.name.early", lang, k=run.exit_layer, n=run.lm.adapter.n_layer)
    return translate("spec.name.model", lang, name=run.draft_name)


def compare_row(run: SpecRunState, lang: str) -> dict:
    """One draft's run on the prompt: its figures, and the speed-up rebuilt from its parts.

    A round costs its drafting plus one verify forward and commits ``tokens_per_forward`` tokens; plain decoding
    costs one step per token. So speed-up ≈ tokens per forward × plain step / (draft + verify per round):
    ``from_parts``, which the measured ``speedup`` (whole runs, rollbacks and bookkeeping included) should be near."""
    r = run.result
    if r.plain_ms is None:
        raise ValueError("a compared run times plain decoding too")
    rounds = len(r.rounds)
    plain_step = r.plain_ms / r.tokens
    draft_round, verify_round = r.draft_ms / rounds, r.verify_ms / rounds
    return {
        "kind": run.draft_kind, "name": draft_name(run, lang), "label": r.draft_label, "rounds": rounds,
        "drafts": r.drafts, "plain_rounds": rounds - r.drafts, "drafted_tokens": r.drafted_tokens,
        "acceptance": r.acceptance_rate, "mean_accepted": r.mean_accepted,
        "forwards_per_token": r.forwards_per_token, "tokens_per_forward": r.tokens_per_forward,
        "target_forwards": r.target_forwards, "draft_forwards": r.draft_forwards, "tokens": r.tokens,
        "draft_ms_per_round": draft_round, "verify_ms_per_round": verify_round, "plain_ms_per_token": plain_step,
        "spec_ms": r.spec_ms, "plain_ms": r.plain_ms, "speedup": r.speedup or 0.0,  # None only without a plain run
        "from_parts": r.tokens_per_forward * plain_step / (draft_round + verify_round),
        "same_as_plain": r.same_as_plain,
    }


def ms(value: float) -> str:
    """Milliseconds as the sentences show them: two decimals below 10 ms (a lookup costs a fraction of one)."""
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


CLEAR_WIN = 1.2  # a speed-up below this is too close to 1 to call a win: two timed runs on a shared CPU differ so much


def verdict_key(speedup: float) -> str:
    """The sentence for the fastest draft: a clear win, about as fast as plain decoding, or slower."""
    return "spec.verdict.wins" if speedup >= CLEAR_WIN else "spec.verdict.tie" if speedup >= 1 else "spec.verdict.none"


def verdict(rows: list[dict], lang: str) -> list[str]:
    """Which draft wins on this prompt and why, in sentences made from the rows' own numbers: the winner (or that
    none beats plain decoding), then each other draft."""

    def figures(row: dict) -> dict:
        return {"draft": row["name"], "speedup": f"{row['speedup']:.2f}", "tpf": f"{row['tokens_per_forward']:.2f}",
                "draft_ms": ms(row["draft_ms_per_round"]), "verify_ms": f"{row['verify_ms_per_round']:.0f}",
                "plain_ms": f"{row['plain_ms_per_token']:.0f}", "acceptance": f"{row['acceptance'] * 100:.0f}"}

    best = max(rows, key=lambda row: row["speedup"])
    key = verdict_key(best["speedup"])
    out = [translate(key, lang, **figures(best))]
    out += [translate("spec.verdict.other", lang, **figures(row)) for row in rows if row is not best]
    return out


def compare_view(runs: Sequence[SpecRunState], lang: str) -> dict:
    """The same prompt decoded greedily with each draft, each beside plain decoding timed in the same run."""
    rows = [compare_row(run, lang) for run in runs]
    first = runs[0]
    return {"model": first.lm.name, "gamma": first.result.gamma, "tokens": first.result.tokens,
            "prompt_tokens": len(first.result.prompt_ids), "rows": rows,
            "winner": max(rows, key=lambda row: row["speedup"])["kind"], "verdict": verdict(rows, lang)}
