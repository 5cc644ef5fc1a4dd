"""A lab's limits and the checks it makes against them.

    Limits.of(settings)          a lab's limits: a frozen dataclass whose fields are its group's settings
                                 (``Settings.GROUPS[GROUP]``), under the settings' own names, read from that group
                                 and nothing else (``tests/test_settings.py``: the fields are the group)
    in_range(name, value, lo, hi)   one message for a number out of its range
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

from app.errors import BadInput
from app.settings import Settings

_L = TypeVar("_L", bound="Limits")  # typing.Self is 3.11+; the project runs on 3.10


@dataclass(frozen=True)
class Limits:
    """Base of every lab's limits (``InspectLimits``, ``PagedLimits`` …): a lab holds its limits, never the whole
    ``Settings``, so its group in ``Settings.GROUPS`` is exactly what it reads. A frozen dataclass with no fields of
    its own, as each lab's limits are with theirs."""

    GROUP: ClassVar[str]
    # A prefix every name of the group has and the fields drop (``spec_max_gamma`` read as ``max_gamma``).
    PREFIX: ClassVar[str] = ""

    @classmethod
    def of(cls: type[_L], settings: Settings) -> _L:
        group = {name.removeprefix(cls.PREFIX): value for name, value in settings.group(cls.GROUP).items()}
        return cls(**{f.name: group[f.name] for f in fields(cls)})

    def block_sizes(self, largest: int) -> tuple[int, ...]:
        """1, 2, 4 … up to ``largest``: the block sizes a lab offers (``Settings.block_sizes``)."""
        return tuple(1 << k for k in range(largest.bit_length()) if 1 << k <= largest)


def in_range(name: str, value: float, low: float, high: float) -> None:
    """``low <= value <= high``, else a ``BadInput`` naming the field, both bounds and what was given."""
    if isinstance(value, bool) or not low <= value <= high:
        raise BadInput("err.range", name=name, low=f"{low:g}", high=f"{high:g}", value=f"{value:g}")
