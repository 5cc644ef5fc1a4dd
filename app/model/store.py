"""Traces kept in memory while a user clicks around, bounded by a byte budget (LRU)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

from app.model.trace import Trace


class TraceStore:
    """Least-recently-used cache of traces; the total of ``Trace.nbytes()`` stays under ``max_bytes``.

    A trace larger than the whole budget is returned to the caller but not kept.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[Trace, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get_or_compute(self, key: Hashable, compute: Callable[[], Trace]) -> Trace:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key][0]
        trace = compute()
        size = trace.nbytes()
        with self._lock:
            self.misses += 1
            if size <= self.max_bytes and key not in self._items:
                while self._items and self.bytes + size > self.max_bytes:
                    _, (_, old) = self._items.popitem(last=False)
                    self.bytes -= old
                self._items[key] = (trace, size)
                self.bytes += size
        return trace

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0
