"""A run in a lab's line as its browser reads it: the line's snapshot made into view data in one language.

    line_view(line, snap, lang, progress_text)   ``app.viz.labs.event_view`` with the message of a stopped or
                                                 replaced run (its limits are the line's)
"""

from __future__ import annotations

from collections.abc import Callable

from app.labs.queue import REPLACED, STOPPED, LabQueue, stopped_error
from app.viz.labs import event_view


def line_view(line: LabQueue, snap: dict, lang: str, progress_text: Callable[[dict, str], str]) -> dict:
    event = snap["event"]
    stopped = None
    if event in (STOPPED, REPLACED):
        stopped = stopped_error(REPLACED if event == REPLACED else snap.get("reason", STOPPED), line)
    return event_view(snap, lang, progress_text, stopped)
