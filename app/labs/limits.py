"""Checks the labs make against their limits (``Settings``): one message for a number out of its range."""

from __future__ import annotations

from app.errors import BadInput


def in_range(name: str, value: float, low: float, high: float) -> None:
    """``low <= value <= high``, else a ``BadInput`` naming the field, both bounds and what was given."""
    if isinstance(value, bool) or not low <= value <= high:
        raise BadInput("err.range", name=name, low=f"{low:g}", high=f"{high:g}", value=f"{value:g}")
