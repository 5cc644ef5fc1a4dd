"""View data for the compression arena: a run's numbers (``app.cache.arena.run_arena``) in, plain data out."""

from __future__ import annotations

import math

from app.cache.policies import EVICTING
from app.model.loading import LoadedModel
from app.viz.tokens import end_tokens

# Which paper each policy comes from, for its reference card (the claims themselves are catalog strings).
PAPERS = {
    "streaming": "streaming", "streaming-norerope": "streaming", "h2o": "h2o", "snapkv": "snapkv", "kivi": "kivi",
}


# A first divergence where full attention's top two logits were closer than this is a near-tie: log p1/p2 < 0.25,
# the runner-up at least e^-0.25 ≈ 78 % as likely as the top token, so the policy flipped an almost even choice.
NEAR_TIE = 0.25


def _kind(name: str) -> str:
    return "full" if name == "full" else ("evict" if name in EVICTING else "quant")


def _text(lm: LoadedModel, ids: list[int]) -> str:
    return "".join(lm.token_texts(ids))


def arena_view(lm: LoadedModel, run: dict) -> dict:
    """Table rows, per-step series, per-head matrices, kept maps and texts of one arena run."""
    a = lm.adapter
    full = run["runs"][0]
    full_bytes = full["bytes_held"]  # what the full cache holds: run["total_tokens"] tokens, the same count
    rows, charts = [], []
    for r in run["runs"]:
        greedy = r["greedy"]
        d = r["first_divergence"]
        same, rest = (greedy, []) if d is None else (greedy[:d], greedy[d:])
        rows.append({
            "name": r["name"], "kind": _kind(r["name"]), "bytes": r["bytes_held"],
            "bytes_pct": 100 * r["bytes_held"] / full["bytes_held"] if full["bytes_held"] else 0,
            "tokens": r["tokens_held"], "kl_mean": sum(r["kl"]) / len(r["kl"]), "kl_max": max(r["kl"]),
            "agreement": 100 * r["agreement"], "ppl": r["ppl"], "ppl_change": 100 * r["ppl_change"],
            "mass": r["mass_mean"], "first_divergence": d, "ms": r["decode_ms_per_step"], "slowdown": r["slowdown"],
            "divergence_margin": r["divergence_margin"],
            "near_tie": r["divergence_margin"] is not None and r["divergence_margin"] < NEAR_TIE,
            "settings": r["settings"],
            "same_text": _text(lm, same), "diverged_text": _text(lm, rest), "paper": PAPERS.get(r["name"]),
        })
        charts.append({"name": r["name"], "kl": r["kl"], "agree": r["agree"], "mass": r["mass"],
                       "keep": [m["bits"] for m in r["keep_map"]]})
    labels = lm.token_texts(run["prompt"] + run["reference"])
    return {
        "rows": rows,
        "steps": run["steps"], "budget": run["budget"], "budget_bytes": run["budget"] * run["bytes_per_token"],
        "full_bytes": full_bytes, "bytes_per_token": run["bytes_per_token"], "prompt_tokens": len(run["prompt"]),
        "total_tokens": run["total_tokens"], "full_ppl": run["full_ppl"],
        "teacher_forced_on": run["teacher_forced_on"],
        # full attention's own continuation stopped at the model's end token (its last, nowhere before)
        "ended": run["teacher_forced_on"] == "greedy" and bool(run["reference"]) and run["reference"][-1] in lm.end_ids
        and lm.end_ids.isdisjoint(run["reference"][:-1]),
        "end_token": end_tokens(lm),
        "partial": run.get("partial"),  # a run stopped at its time limit: {"reason", "done", "of", "seconds"}
        "prompt_text": _text(lm, run["prompt"]), "reference_text": _text(lm, run["reference"]),
        "full_text": _text(lm, run["full_greedy"]),
        "near_tie_limit": NEAR_TIE, "near_tie_pct": round(100 * math.exp(-NEAR_TIE)),
        # the settings of the policy behind each paper's card, where it has any (KIVI: group size, residual)
        "paper_settings": {r["paper"]: r["settings"] for r in rows if r["paper"] and r["settings"]},
        "papers": sorted({p for p in PAPERS.values() if any(r["paper"] == p for r in rows)},
                         key=["streaming", "h2o", "snapkv", "kivi"].index),
        "chart": {
            "policies": charts, "labels": labels, "n_layer": a.n_layer, "n_head": a.n_head, "n_kv_head": a.n_kv_head,
            "map_rows": [f"L{layer} KV{h}" for layer in range(a.n_layer) for h in range(a.n_kv_head)],
        },
    }
