"""The one way a lab holds what the class kit pinned (``app/labs/kit.py``): a pinned result is handed to the lab that
shows it, which keeps it under its own lock, reads it before anything it computes, and never expires it.

    pin(key, pinned)    hold ``pinned`` (the lab's own kind of result) under ``key`` (``kit-CODE``)
    unpin(key)          let it go (the pin was deleted, or its files found damaged)
    pinned_item(key)    what is held under ``key``, read-only, or None

Implemented by ``InspectLab`` (a trace: ``(model, trace)``) and ``ZoomLab`` (a trace's grid rows and pooled bases:
``ZoomPin``). The kit itself is a store on disk and its routes; it mounts a pin into the labs only through this.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PinTarget(Protocol):
    def pin(self, key: str, pinned: Any) -> None: ...

    def unpin(self, key: str) -> None: ...

    def pinned_item(self, key: str) -> Any | None: ...
