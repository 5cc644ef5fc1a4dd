"""The first seconds of ``kvscope serve``: a small ASGI app that answers at once while the real one is prepared.

Importing torch, transformers and FastAPI takes seconds (7–8 s on a 2-core machine) and loading the models
more (a minute or two when the built-in model must be trained). Rather than refuse connections all that time,
``serve`` puts this app on the port first (Python, uvicorn and the catalogs only: ~0.2 s)::

    spawn ─> port open: BootApp answers ───────────────────────────────┬─> every request goes to the real app
               │ worker thread: import app.web.main, load the models,  │   (its lifespan entered on the event loop:
               │ build create_app(settings, state=...)                 │    thread limiter, janitor)
               │ meanwhile, at once, with Retry-After:                 │
               │   /healthz   503 {"status": "starting", ...}          │
               │   a page     503 "KVScope is starting" (reloads itself, keeps the URL and so the prompt)
               │   the rest   503 {"detail": "..."}
               └─ the loader fails: traceback on the console, the server stops, exit status 1

Invariants: the heavy work never runs on the event loop (only the real lifespan's cheap part does); requests
reach the real app only after its lifespan has started; lifespan shutdown ends the real app's lifespan too.
This module imports no torch, transformers, FastAPI or Starlette (a test checks it in a fresh interpreter):
``app.web.security`` (standard library only) gives the headers and the Host/Origin checks the real app applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any
from urllib.parse import parse_qs

import uvicorn

from app import startup
from app.i18n import DEFAULT_LANG, available_languages, html_lang, scope_lang, translate
from app.settings import Settings
from app.web.security import HostAndOrigin, SecurityHeaders, allowed_hosts

Message = MutableMapping[str, Any]  # an ASGI scope or message (starlette.types' Scope and Message)
ASGIApp = Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
Loader = Callable[[Settings], ASGIApp]
RETRY_AFTER_S = 2  # the starting page reloads itself this often, and API answers ask to retry after it


def load_real_app(settings: Settings) -> ASGIApp:
    """The real KVScope app with its models loaded (blocking: run in a worker thread)."""
    startup.report("boot.status.importing")
    from app.web.main import create_app, load_state

    state = load_state(settings)
    startup.report("boot.status.starting")
    return create_app(settings, state=state)


class BootApp:
    """Answers every request with "starting" until ``loader(settings)`` (run in a thread on lifespan startup)
    has returned the real app and its lifespan has started; then forwards everything to it.

    ``on_ready(seconds)`` is called once the real app serves; ``on_failure(exc)`` when the loader or the real
    app's lifespan startup raised (``serve`` stops the server then). ``started`` is when the boot app was made.
    """

    def __init__(self, settings: Settings, *, loader: Loader = load_real_app,
                 on_ready: Callable[[float], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.settings = settings
        self.loader = loader
        self.on_ready = on_ready
        self.on_failure = on_failure
        self.started = time.monotonic()
        self.real: ASGIApp | None = None  # set once the real app's lifespan has started
        self.failed: BaseException | None = None
        self._preparing: asyncio.Task | None = None
        self._lifespan: _Lifespan | None = None
        # As the real app: its headers on every answer (CSP, nosniff, no framing, referrer policy), foreign
        # Host names refused (DNS rebinding) and state-changing requests from other sites too.
        self._starting = SecurityHeaders(HostAndOrigin(
            self._answer_starting, hosts=allowed_hosts(settings.host, settings.allowed_hosts),
            any_ip=settings.host in ("0.0.0.0", "::")))

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._run_lifespan(scope, receive, send)
        if self.real is not None:
            return await self.real(scope, receive, send)
        await self._starting(scope, receive, send)

    # --- lifespan: start preparing, answer "started" at once; on shutdown end the real app's lifespan ------

    async def _run_lifespan(self, scope: dict, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._preparing = asyncio.create_task(self._prepare(scope))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _prepare(self, scope: dict) -> None:
        try:
            real = await _in_thread(self.loader, self.settings)
            # Uvicorn's lifespan scope (its "state" dict is copied into every request's scope).
            self._lifespan = _Lifespan(real, scope)
            await self._lifespan.startup()
        except Exception as exc:
            self.failed = exc
            traceback.print_exception(exc, file=sys.stderr)
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        self.real = real
        if self.on_ready is not None:
            self.on_ready(time.monotonic() - self.started)

    async def _shutdown(self) -> None:
        if self._preparing is not None and not self._preparing.done():
            # Stopped while preparing: the worker thread is a daemon and ends with the process.
            self._preparing.cancel()
        if self._lifespan is not None:
            await self._lifespan.shutdown()

    # --- the answers while starting ---------------------------------------------------------------------------

    async def _answer_starting(self, scope: dict, receive, send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013})  # "try again later"
            return
        if scope["type"] != "http":
            return
        request = _Request(scope)
        lang = request.lang()
        seconds = int(time.monotonic() - self.started)
        key, params = startup.current()
        doing = translate(key, lang, **params)
        if scope["path"] == "/healthz":
            health = {"status": "failed" if self.failed else "starting", "stage": key,
                      "detail": translate("boot.failed", lang) if self.failed else doing, "seconds": seconds}
            await _respond(send, scope, 503, json.dumps(health, ensure_ascii=False).encode(), b"application/json")
        elif request.wants_page():
            page = starting_page(lang, doing=doing, seconds=seconds, prompt=request.query("prompt"),
                                 failed=self.failed is not None)
            await _respond(send, scope, 503, page.encode(), b"text/html; charset=utf-8")
        else:
            detail = translate("boot.failed" if self.failed else "boot.api", lang)
            body = json.dumps({"detail": detail}, ensure_ascii=False).encode()
            await _respond(send, scope, 503, body, b"application/json")


def starting_page(lang: str, *, doing: str, seconds: int, prompt: str | None = None, failed: bool = False) -> str:
    """The page a person gets while KVScope starts: what is happening, and a reload every few seconds.

    No script (the CSP allows none inline) and no URL in the refresh: the browser reloads the URL it asked for,
    so ``/?prompt=...`` opens that prompt once the model is ready. Inline style is allowed by the CSP.
    """
    def _(key: str, **values: object) -> str:
        return html.escape(translate(key, lang, **values))

    kept = ""
    if prompt and not failed:
        kept = f'<p>{_("boot.prompt_kept")}</p>\n<blockquote>{html.escape(prompt)}</blockquote>\n'
    text = (f'<p class="now" role="status">{_("boot.failed")}</p>\n' if failed else
            f'<p>{_("boot.body")}</p>\n<p class="now" role="status">'
            f'{_("boot.now", doing=doing, seconds=seconds)}</p>\n')
    refresh = "" if failed else f'<meta http-equiv="refresh" content="{RETRY_AFTER_S}">\n'
    return (
        "<!doctype html>\n"
        f'<html lang="{html.escape(html_lang(lang))}">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"{refresh}<title>{_('boot.title')}</title>\n"
        "<style>\n"
        "body { font: 1.5rem/1.5 system-ui, sans-serif; color: #111; background: #fff; margin: 0; }\n"
        "main { max-width: 42rem; margin: 12vh auto; padding: 0 1.5rem; }\n"
        "h1 { font-size: 2.5rem; margin: 0 0 .5em; }\n"
        ".now { font-weight: 600; }\n"
        "blockquote { margin: .5em 0; padding: .5em 1em; border-left: .3em solid #555; background: #f2f2f2; "
        "white-space: pre-wrap; overflow-wrap: anywhere; max-height: 8em; overflow: hidden; }\n"
        "</style>\n</head>\n<body>\n<main>\n"
        f"<h1>{_('boot.title')}</h1>\n{text}{kept}</main>\n</body>\n</html>\n"
    )


class _Request:
    """What the starting answers need from a request: its language, query and whether a person asked for a page."""

    def __init__(self, scope: dict) -> None:
        self.scope = scope
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        self.params = parse_qs(scope.get("query_string", b"").decode("latin-1"), encoding="utf-8",
                               errors="replace")
        self.method = scope.get("method", "GET")

    def query(self, name: str) -> str | None:
        values = self.params.get(name)
        return values[0] if values else None

    def lang(self) -> str:
        """As the real app picks it (app/web/render.py): ?lang=, X-KVScope-Lang, the cookie, Accept-Language."""
        return scope_lang(self.scope)

    def wants_page(self) -> bool:
        """A person followed a link or typed a URL (not a page script's or htmx's request, nor the API)."""
        return (self.method in ("GET", "HEAD") and "text/html" in self.headers.get("accept", "")
                and "hx-request" not in self.headers)


async def _respond(send, scope: dict, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()), (b"cache-control", b"no-store"),
    ]})
    await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else body})


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of its own, awaited on the event loop. Not the loop's default executor:
    a server stopped while the models load (Ctrl-C) must not wait for the thread to finish."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():  # cancelled: the server is stopping
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting task, which reports it)
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is waiting any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=work, name="kvscope-prepare", daemon=True).start()
    return await future


class _Lifespan:
    """Drives an ASGI app's lifespan protocol from outside: ``startup()`` now, ``shutdown()`` later.

    An app that raises or returns on a lifespan scope without answering does not use lifespan (the ASGI spec;
    uvicorn's "auto" mode treats it the same): startup then succeeds and shutdown does nothing.
    """

    def __init__(self, app: ASGIApp, scope: dict) -> None:
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        # ensure_future takes any awaitable (ASGI's type); an app's coroutine becomes a task, as create_task's would
        self._task = asyncio.ensure_future(app(scope, self._to_app.get, self._from_app.put))
        # Its exception, if any, is reported through startup() (a "failed" message) or means "no lifespan".
        self._task.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _exchange(self, event: str) -> None:
        await self._to_app.put({"type": f"lifespan.{event}"})
        answer = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({answer, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if answer.done():
            message = answer.result()
            if message["type"] == f"lifespan.{event}.failed":
                raise RuntimeError(message.get("message") or f"lifespan {event} failed")
            return
        answer.cancel()  # the app ended without answering: it does not use lifespan

    async def startup(self) -> None:
        await self._exchange("startup")

    async def shutdown(self) -> None:
        if self._task.done():
            return
        await self._exchange("shutdown")
        await asyncio.wait({self._task})


# --- the command -----------------------------------------------------------------------------------------------

def console_lang(env: Mapping[str, str] | None = None) -> str:
    """The console's language from the locale (``LANG=zh_CN.UTF-8`` → zh), English otherwise."""
    env = os.environ if env is None else env
    for var in ("LC_ALL", "LC_MESSAGES", "LANG"):
        if env.get(var):
            base = env[var].split(".")[0].split("_")[0].lower()
            return base if base in available_languages() else DEFAULT_LANG
    return DEFAULT_LANG


def console(key: str, **params: object) -> None:
    print(translate(key, console_lang(), **params), file=sys.stderr, flush=True)


class _Server(uvicorn.Server):
    """Uvicorn's server, saying where it listens (with the real port) as soon as the socket is open."""

    url = ""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            host = self.config.host
            self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            console("boot.console.starting", url=self.url)


def serve(settings: Settings, *, loader: Loader = load_real_app) -> int:
    """Run KVScope on ``settings.host:settings.port``: answering at once, the real app once it is prepared.
    Returns the exit status: 0 after a normal stop, 1 when the models could not be prepared."""

    def ready(seconds: float) -> None:
        console("boot.console.ready", url=server.url, seconds=f"{seconds:.1f}")

    def failed(exc: BaseException) -> None:
        console("boot.console.failed")
        server.should_exit = True

    app = BootApp(settings, loader=loader, on_ready=ready, on_failure=failed)
    # Prompts travel in the URL (so a link reopens the same view): allow long request lines.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, h11_max_incomplete_event_size=512 * 1024)
    server = _Server(config)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn has already shut down cleanly
        server.run()
    return 1 if app.failed is not None else 0
