"""The verdict under each fair race says what its own numbers show, and why when they go against the claim."""

from __future__ import annotations

from app.i18n import translate
from app.viz.cache_saving import SHORT_TOKENS, saving_row, verdict


def race(tokens: int, cached: list[float], recompute: list[float]) -> dict:
    side = lambda runs: {"median": sorted(runs)[len(runs) // 2], "min": min(runs), "max": max(runs), "runs": runs}  # noqa: E731
    return {"tokens": tokens, "repeats": len(cached), "cached": side(cached), "recompute": side(recompute),
            "max_abs_diff": 0.0}


def test_a_clear_saving_holds_and_a_close_one_is_explained_by_the_prefix_or_the_machine():
    assert verdict(race(512, [20, 21, 22], [300, 310, 320])) == "holds"
    # 4 tokens: a step and a recompute are both one small forward; the reason is the prefix, not a broken cache
    assert verdict(race(4, [140, 150, 160], [130, 150, 170])) == "short"
    assert verdict(race(4, [1975.9, 1257.6, 1300], [1281.4, 144.4, 150])) == "short"  # the numbers
    # a long prefix whose spreads overlap: the machine was busy, said as such
    assert verdict(race(512, [20, 200, 400], [300, 310, 320])) == "noisy"
    assert verdict(race(SHORT_TOKENS, [50, 51, 52], [60, 61, 62])) == "noisy"  # 1.2×: not a clear saving


def test_the_sentence_carries_the_measured_numbers_in_both_languages():
    row = saving_row(race(4, [140.0, 150.0, 160.0], [130.0, 150.0, 170.0]), layers=30, which="prompt")
    key, params = row["why"]
    assert key == "decode.saves.short" and params["c"] == "150.0" and params["f"] == "150.0" and params["layers"] == 30
    for lang in ("en", "zh"):
        text = translate(key, lang, **params)
        assert "150.0" in text and "30" in text and "{" not in text
    assert row["ratio"] == 1.0
