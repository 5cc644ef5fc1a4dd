"""Long work for one request, run in a worker thread and told to stop when nobody is waiting for it any more.

The work gets a ``threading.Event`` and checks it in its loop (``Simulator.run``'s stop hook does). It is set
when the client disconnects (``request.is_disconnected()`` polled while the thread runs), and when this
request's task is cancelled (the server stopping): a worker thread cannot be interrupted, so without the flag
it would run on, holding the GIL and its memory, with nobody to read its answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread
from starlette.requests import Request

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
