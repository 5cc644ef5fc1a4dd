"""Jinja2 templates, with the translation function and a few formatting filters."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.templating import Jinja2Templates
from markupsafe import Markup
from starlette.concurrency import run_in_threadpool

from app.admission import Withdrawn
from app.errors import UserError
from app.i18n import (
    DEFAULT_LANG,
    LANG_COOKIE,
    LANG_HEADER,
    available_languages,
    catalog,
    html_lang,
    pick_lang,
    translator,
)
from app.viz.shapes import fmt_shape

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = Jinja2Templates(directory=str(ROOT / "templates"))
TEMPLATES.env.filters["shape"] = fmt_shape
TEMPLATES.env.filters["num"] = lambda x, d=4: f"{x:.{d}f}"
TEMPLATES.env.filters["bytes"] = lambda n: human_bytes(n)
TEMPLATES.env.globals["localize"] = lambda text, lang: localize(text, lang)
TEMPLATES.env.globals["asset"] = lambda url: _asset(url)
TEMPLATES.env.globals["scripts"] = lambda *urls: Markup(f'<script src="{_bundle(*urls)}" defer></script>')
# A script the parser runs where it stands, while the rest of a streamed page is still coming (static/climb.js).
TEMPLATES.env.globals["scripts_now"] = lambda *urls: Markup(f'<script src="{_bundle(*urls)}"></script>')
TEMPLATES.env.globals["styles"] = lambda *urls: Markup(f'<link rel="stylesheet" href="{_bundle(*urls)}">')


class MatrixJSON(JSONResponse):
    """JSON carrying base64 float32 tensors, sent uncompressed: float mantissas hardly compress (gzip saves the
    base64 overhead only, 26% of a T=512 head's 700 KB) and compressing them took 45 ms per head on the server,
    the class's shared CPU. The media type is what the GZip middleware skips (``NO_GZIP``)."""

    media_type = "application/x-kvscope-matrix+json"


NO_GZIP = ("text/event-stream", "application/x-ndjson", MatrixJSON.media_type)


def _asset(url: str) -> str:
    from app.web.assets import asset

    return asset(url)


def _bundle(*urls: str) -> str:
    from app.web.assets import bundle

    return bundle(*urls)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def js_strings(lang: str) -> dict[str, str]:
    """The catalog's "js." strings, for the page scripts (English where a language lacks one)."""
    merged = {k: v for k, v in catalog(DEFAULT_LANG).items() if k.startswith("js.")}
    merged.update({k: v for k, v in catalog(lang).items() if k.startswith("js.")})
    return merged


def request_lang(request: Request) -> str:
    """The language of a page or an API answer: ``?lang=`` if it names a catalog, else the page's own language
    (the ``X-KVScope-Lang`` header that kv.js and htmx requests carry, so a page opened with ``?lang=zh`` gets
    Chinese answers), else the ``kvscope_lang`` cookie, else the first catalog language in Accept-Language
    (by q-value; ``zh-CN`` counts as ``zh``), else English (``app.i18n.pick_lang``)."""
    return pick_lang(request.query_params.get("lang"), request.headers.get(LANG_HEADER),
                     request.cookies.get(LANG_COOKIE), request.headers.get("accept-language", ""))


def localize(text: str, lang: str) -> str:
    """A message that may be a catalog key or the English text of a catalog entry, in ``lang``.

    For messages made outside the catalog's reach (a model loader's reason, say): when the English text is
    exactly one catalog entry without placeholders, its translation is shown; otherwise the text as it is.
    """
    if text in catalog(DEFAULT_LANG):
        return translator(lang)(text)
    key = _english_index().get(text)
    return translator(lang)(key) if key else text


@lru_cache
def _english_index() -> dict[str, str]:
    return {v: k for k, v in catalog(DEFAULT_LANG).items() if "{" not in v}


def render(request: Request, template: str, status_code: int = 200, headers: dict | None = None,
           script_keys: tuple[str, ...] = (), **context):
    """A page or fragment in the request's language. Page scripts read strings with ``kv.t(key)``: every
    "js." key, plus ``script_keys`` (a page's own keys its script fills in)."""
    _page_context(request, context, script_keys)
    return TEMPLATES.TemplateResponse(request, template, context, status_code=status_code, headers=headers)


# Where a page sent in two parts is cut: the template writes ``slot`` once, where the second part goes.
SLOT = Markup("<!--kv:slot-->")
POLL_S = 0.25  # while a part is computed, how often the client is checked (a stop reaches the capture within it)


def render_in_parts(request: Request, template: str, fragment: str, fill: Callable[[Callable[[dict], None],
                    threading.Event], dict], *, part: str | None = None, **context) -> StreamingResponse:
    """A page sent while its content is computed: ``template`` at once, up to where it writes ``slot`` (the browser
    fetches the styles and scripts, and paints the frame, meanwhile), then ``fill(emit, cancel)``'s view (run in a
    worker thread) rendered by ``fragment`` as ``view``, then the rest. Each dict ``fill`` hands ``emit`` on the
    way (a layer the capture has computed) is sent at once, rendered by ``part`` as ``part``. ``cancel`` is set
    once the client has gone (``fill`` stops; nothing more is sent). The inputs were checked before (a bad one is
    answered with its status); an error ``fill`` still meets (the model busy, a store too full) is the page's
    error box in place of the fragment, its message from the catalog."""
    _page_context(request, context, ())
    context.setdefault("request", request)
    first, rest = TEMPLATES.get_template(template).render({**context, "slot": SLOT}).split(SLOT)
    lang = context["lang"]

    async def parts() -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        sent: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        work: asyncio.Future | None = None

        def emit(item: dict) -> None:  # from the worker thread: into this loop's queue
            loop.call_soon_threadsafe(sent.put_nowait, item)

        def fragment_of(item: dict) -> str:
            return TEMPLATES.get_template(part).render({**context, "part": item}) if part else ""

        try:
            yield first
            work = asyncio.ensure_future(run_in_threadpool(fill, emit, cancel))
            while not work.done():
                getting = asyncio.ensure_future(sent.get())
                await asyncio.wait({work, getting}, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if getting.done():
                    yield fragment_of(getting.result())
                else:
                    getting.cancel()
                    if await request.is_disconnected():
                        cancel.set()
            while not sent.empty():
                yield fragment_of(sent.get_nowait())
            try:
                view = work.result()
                middle = TEMPLATES.get_template(fragment).render({**context, "view": view})
            except Withdrawn:  # the client has gone: nobody to tell
                return
            except UserError as exc:
                middle = TEMPLATES.get_template("partials/_error.html").render({**context, "message": exc.text(lang)})
            except Exception:  # never a stack trace in the page: the server's log has it
                log.exception("unexpected error while filling %s", request.url.path)
                middle = TEMPLATES.get_template("partials/_error.html").render(
                    {**context, "message": translator(lang)("err.server")})
            yield middle
            yield rest
        finally:  # a client gone or the server stopping: the worker's capture ends at its next layer
            cancel.set()
            if work is not None and not work.done():  # its end (``Withdrawn``) is nobody's to read
                work.add_done_callback(lambda done: done.cancelled() or done.exception())

    return StreamingResponse(parts(), media_type="text/html; charset=utf-8")


def _page_context(request: Request, context: dict, script_keys: tuple[str, ...]) -> None:
    """What every page's template reads, filled into ``context`` where the caller gave none."""
    lang = request_lang(request)
    context.setdefault("_", translator(lang))
    context.setdefault("lang", lang)
    context.setdefault("html_lang", html_lang(lang))
    context.setdefault("languages", [(code, catalog(code).get("lang.name", code)) for code in available_languages()])
    context.setdefault("js_strings", {**js_strings(lang), **{k: translator(lang)(k) for k in script_keys}})
    # Templates get views, never the state or the settings: ``site`` (the served models, the notice), and what the
    # route passed (a page's ``limits`` come from its lab: one bound, one place).
    from app.viz.models import model_card, site_view

    registry = request.app.state.kv.registry
    context.setdefault("site", site_view(registry, lang))
    if "card" not in context:
        name = request.query_params.get("model")
        context["card"] = model_card(registry.models.get(name) or registry.get(None))
