"""Speculative runs turned into view data: rounds of coloured tokens, p and q, cache lengths and the paged blocks
each round wrote and freed, the run's figures. ``run`` is an ``app.labs.speculative.SpecRun``."""

from __future__ import annotations

from app.cache.spec_blocks import slots
from app.kv_bytes import dtype_name, page_bytes
from app.viz.tokens import honest_texts


def block_bytes(lm, block_size: int, n_layer: int | None = None) -> int:
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


def spec_view(run) -> dict:
    lm, r = run.lm, run.result
    t_bytes = block_bytes(lm, run.block_size)
    d_bytes = block_bytes(run.draft_lm, run.block_size, run.exit_layer)
    rounds = []
    for n, rd in enumerate(r.rounds):
        texts = honest_texts(lm, rd.drafted + [rd.token])
        tokens = []
        for i, (tid, q, p) in enumerate(zip(rd.drafted, rd.q, rd.p, strict=True)):
            status = "accepted" if i < rd.accepted else ("rejected" if i == rd.accepted else "discarded")
            ratio = rd.ratios[i] if i < len(rd.ratios) else None
            tokens.append({"id": tid, "text": texts[i], "q": q, "p": p, "ratio": ratio, "status": status})
        snaps = run.blocks[n]
        rounds.append({
            "index": rd.index, "tokens": tokens, "accepted": rd.accepted,
            "final": {"id": rd.token, "text": texts[-1], "p": rd.token_p,
                      "kind": "bonus" if rd.bonus else "correction"},
            "target_start": rd.target_start, "draft_start": rd.draft_start,
            "target_before": rd.target_before, "target_after": rd.target_after,
            "draft_before": rd.draft_before, "draft_after": rd.draft_after, "ms": rd.ms,
            "blocks": {"target": block_view(snaps["target"], t_bytes), "draft": block_view(snaps["draft"], d_bytes)},
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
        "block_size": run.block_size, "block_bytes": {"target": t_bytes, "draft": d_bytes},
    }
