"""The fair race of "What the cache saves" (``app/model/timing.py``) as the page shows it: one row per prefix length
(the learner's prompt, and a text long enough for the saving to show), and one sentence per row saying what the
measured numbers show, in particular why when they go against the claim (a cached step is cheaper).

A row's verdict, from its own numbers only::

    holds   recompute median >= 1.5 × cached median, and the spreads do not overlap (cached max < recompute min)
    short   otherwise, on a prefix of fewer than SHORT_TOKENS: both are one forward of a few tokens, whose time is the
            fixed cost of running every layer; there is little prefix work for the cache to save
    noisy   otherwise: the spreads overlap or the order is reversed on a prefix long enough to show the saving, so
            the machine was busy while it was measured (other requests share it) and this run cannot tell them apart
"""

from __future__ import annotations

SHORT_TOKENS = 64
CLEAR_RATIO = 1.5


def verdict(m: dict) -> str:
    c, f = m["cached"], m["recompute"]
    if f["median"] >= CLEAR_RATIO * c["median"] and c["max"] < f["min"]:
        return "holds"
    return "short" if m["tokens"] < SHORT_TOKENS else "noisy"


def _ms(x: float) -> str:
    return f"{x:,.1f}"


def saving_row(m: dict, *, layers: int, which: str) -> dict:
    """One measurement as a table row and its sentence (a catalog key and its parameters); ``which``: "prompt" or
    "long"."""
    c, f = m["cached"], m["recompute"]
    ratio = f["median"] / c["median"] if c["median"] > 0 else float("inf")
    kind = verdict(m)
    params = {"n": f"{m['tokens']:,}", "k": m["repeats"], "c": _ms(c["median"]), "f": _ms(f["median"]),
              "cmin": _ms(c["min"]), "cmax": _ms(c["max"]), "fmin": _ms(f["min"]), "fmax": _ms(f["max"]),
              "ratio": f"{ratio:.1f}", "layers": layers}
    return {"which": which, "tokens": m["tokens"], "repeats": m["repeats"], "cached": c, "recompute": f,
            "ratio": ratio, "verdict": kind, "why": (f"decode.saves.{kind}", params),
            "max_abs_diff": m["max_abs_diff"]}


def saving_view(prompt: dict, long: dict | None, *, layers: int) -> dict:
    rows = [saving_row(prompt, layers=layers, which="prompt")]
    if long is not None:
        rows.append(saving_row(long, layers=layers, which="long"))
    return {"rows": rows, "layers": layers}
