"""Long work for one request, run in a worker thread and told to stop when nobody is waiting for it any more.

Two shapes: ``run_until_disconnected`` answers once (the work's result); ``FollowResponse`` streams a run that
runs elsewhere (a lab's worker) as it goes, one JSON line per update (place in line, progress, the end), and lets
go of it when the client has gone.

The work gets a ``threading.Event`` and checks it in its loop (``Simulator.run``'s stop hook does). It is set
when the client disconnects (``request.is_disconnected()`` polled while the thread runs), and when this
request's task is cancelled (the server stopping): a worker thread cannot be interrupted, so without the flag
it would run on, holding the GIL and its memory, with nobody to read its answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import StreamingResponse

T = TypeVar("T")
POLL_S = 0.25  # how often the connection is checked: a cancelled run stops within about this long


async def run_until_disconnected(request: Request, work: Callable[[threading.Event], T], *,
                                 poll_s: float = POLL_S) -> T:
    """``work(cancel)`` in a worker thread; ``cancel`` is set once the client has gone or this task is cancelled."""
    cancel = threading.Event()

    async def watch() -> None:
        try:
            while not cancel.is_set():
                if await request.is_disconnected():
                    return
                await anyio.sleep(poll_s)
        finally:  # disconnected, or cancelled with the task group: either way the work should stop
            cancel.set()

    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            result = await anyio.to_thread.run_sync(work, cancel)
        except Exception as exc:  # raised below, outside the task group (which would wrap it in an ExceptionGroup)
            error = exc
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


class FollowResponse(StreamingResponse):
    """A run followed live, one JSON line (``application/x-ndjson``, never compressed) each time what ``look()``
    returns changes, at most every ``min_interval_s``, until ``is_last`` says a line was the last.

    ``look`` must be quick (it is called on the event loop every ``poll_s``: a lab's snapshot under its lock),
    so a hundred followers hold no worker thread. The response listens for the client's disconnect itself
    (whatever the server's ASGI version); ``on_close`` runs once at the end however it ended (the last line,
    the client gone, the server stopping): that is where a lab lets go of the run.
    """

    media_type = "application/x-ndjson"

    def __init__(self, look: Callable[[], dict], *, is_last: Callable[[dict], bool],
                 on_close: Callable[[], None] | None = None, poll_s: float = 0.1, min_interval_s: float = 0.2,
                 status_code: int = 200) -> None:
        super().__init__(iter(()), status_code=status_code, media_type=self.media_type,
                         headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.look, self.is_last, self.on_close = look, is_last, on_close
        self.poll_s, self.min_interval_s = poll_s, min_interval_s

    async def __call__(self, scope, receive, send) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                sent = None
                while True:
                    item = self.look()
                    if item == sent:
                        await anyio.sleep(self.poll_s)
                        continue
                    line = json.dumps(item, ensure_ascii=False, separators=(",", ":")) + "\n"
                    await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
                    if self.is_last(item):
                        break
                    sent = item
                    await anyio.sleep(self.min_interval_s)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            if self.on_close is not None:
                self.on_close()
