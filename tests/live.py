"""The real app under uvicorn in a background thread on a free loopback port (browser tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


def in_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run on a new thread, its result or its exception returned here. For a run compared with one on a
    worker thread (tests/numerics.py), and for ``asyncio.run``: on a test worker that has opened a browser,
    Playwright's sync API keeps an event loop running on the main thread, inside which ``asyncio.run`` refuses to
    start."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(state, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``create_app(state=state)`` on ``host`` (``::1``: IPv6) and yield its base URL; the server stops on
    exit."""
    import uvicorn

    from app.web.main import create_app

    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(create_app(state=state), host=host, port=port,
                                           log_level="warning", h11_max_incomplete_event_size=512 * 1024))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("uvicorn did not start")
    try:
        yield f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def browser_page(browser, **context_options):
    """A page in a fresh context (CSP bypassed, see conftest's ``page``) whose uncaught JS errors are collected
    in ``page.js_errors``; the context is closed afterwards."""
    context = browser.new_context(bypass_csp=True, **context_options)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.js_errors = errors  # type: ignore[attr-defined]
    try:
        yield pg
    finally:
        context.close()


# Chromium for page tests, benches and screenshots. Debian's headless build first: the full browser opens, for every
# new context, a window whose top-chrome WebUI renderer (omnibox popup, chrome:// modules) costs ~0.6-1.0 CPU s
# beside the page under test (measured in a trace of one cold navigation); the headless build (same Blink and V8)
# opens one renderer per context. KVSCOPE_CHROMIUM names another binary.
CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium-headless-shell", "/usr/bin/chromium")
CHROMIUM_ARGS = (
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
)


def chromium_path() -> str | None:
    """The Chromium binary to drive: $KVSCOPE_CHROMIUM, else the first of CHROMIUM_CANDIDATES installed."""
    import os
    from pathlib import Path

    named = os.environ.get("KVSCOPE_CHROMIUM")
    if named:
        return named if Path(named).exists() else None
    return next((c for c in CHROMIUM_CANDIDATES if Path(c).exists()), None)


def launch_chromium(playwright, path: str | None = None, **options):
    """Launch headless Chromium through Playwright with the project's flags; a clear error when none is installed."""
    import os

    path = path or chromium_path()
    if path is None:
        named = os.environ.get("KVSCOPE_CHROMIUM")
        where = f"$KVSCOPE_CHROMIUM ({named})" if named else " or ".join(CHROMIUM_CANDIDATES)
        raise RuntimeError(f"no Chromium at {where}: run `make chromium`")
    return playwright.chromium.launch(executable_path=path, headless=True, args=list(CHROMIUM_ARGS), **options)
