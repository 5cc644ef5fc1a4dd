"""A run in a lab's line as its browser reads it (app/labs/lines.py over app/viz/labs.py): the view knows the line's
event names without importing the line, and a stopped run says why in the reader's language."""

from __future__ import annotations

from app.i18n import translate
from app.labs import queue
from app.labs.lines import line_view
from app.viz import labs as view


def test_the_view_names_the_lines_events():
    assert (view.QUEUED, view.RUNNING, view.DONE, view.FAILED) == (queue.QUEUED, queue.RUNNING, queue.DONE,
                                                                   queue.FAILED)


def test_a_stopped_or_replaced_run_says_why_with_the_lines_limits():
    line = queue.LabQueue(name="t", gate=None, max_queued=4, per_owner=1, per_address=4, max_wait_s=30.0,
                          max_run_s=12.0)
    try:
        no_progress = lambda progress, lang: ""  # noqa: E731
        timed = line_view(line, {"event": queue.STOPPED, "reason": queue.TIME_LIMIT}, "en", no_progress)
        assert timed["text"] == translate("line.time_limit", "en", seconds="12")
        replaced = line_view(line, {"event": queue.REPLACED}, "zh", no_progress)
        assert replaced["text"] == translate("line.replaced", "zh")
        queued = line_view(line, {"event": queue.QUEUED, "place": 2}, "en", no_progress)
        assert queued["text"] == translate("line.place", "en", nth=view.nth(2, "en")) and queued["place"] == 2
    finally:
        line.close()
