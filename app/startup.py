"""What the server is doing while it starts, for the page a visitor gets meanwhile (``app/web/boot.py``).

One process-wide line of state: a catalog key and its parameters (``boot.status.training``, step 300 of
1000). The thread that prepares the models writes it (``report``), request handlers on the event loop read it
(``current``). Replacing a tuple is atomic, so neither side locks; with nobody reading, a report costs one
assignment. Stdlib only: the start-up page reads it before torch is imported.
"""

from __future__ import annotations

_status: tuple[str, dict[str, object]] = ("boot.status.importing", {})


def report(key: str, **params: object) -> None:
    """Say what start-up is doing now (a catalog key with its placeholders' values)."""
    global _status
    _status = (key, params)


def current() -> tuple[str, dict[str, object]]:
    """The last report: (catalog key, parameters)."""
    key, params = _status
    return key, dict(params)
