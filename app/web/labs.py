"""How a request follows a run in a lab's line (``app/labs/queue.py``): streamed, or waited for.

    follow_job(request, lab, job, owner, progress_text)   one JSON line per change: the place in line ("3rd in
                                                          line, about 40 s"), the progress ("policy 4 of 9,
                                                          step 7 of 16"), then how it ended; the run is let go
                                                          when the client goes
    wait_job(request, lab, job, owner)                    the result once it is done (the run's end as an error
                                                          otherwise); stopped when the client goes
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from app.labs.lines import line_view
from app.labs.queue import DONE, QUEUED, RUNNING, Job, LabQueue
from app.web.cancel import FollowResponse, run_until_disconnected
from app.web.render import request_lang


def follow_job(request: Request, lab: LabQueue, job: Job, owner: str,
               progress_text: Callable[[dict, str], str], *, with_result: bool = False) -> FollowResponse:
    """``with_result``: the ``done`` line carries the run's ``result`` (a small one: the long capture's key)."""
    lang = request_lang(request)

    def look() -> dict:
        event = line_view(lab, lab.snapshot(job, owner), lang, progress_text)
        return event | {"result": job.result} if with_result and event["event"] == DONE else event

    return FollowResponse(look, is_last=lambda line: line["event"] not in (QUEUED, RUNNING),
                          on_close=lambda: lab.release(job, owner))


async def wait_job(request: Request, lab: LabQueue, job: Job, owner: str) -> Any:
    """The job's result (None if the client went first)."""
    return await run_until_disconnected(request, lambda cancel: lab.wait(job, owner, cancel))
