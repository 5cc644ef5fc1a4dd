"""The FastAPI application: state loaded once in ``lifespan``, routers included, errors made friendly."""

from __future__ import annotations

import logging
import secrets
from contextlib import asynccontextmanager

import anyio.to_thread
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import __version__
from app.errors import UserError
from app.i18n import translate
from app.model.trained import load_saved_trained
from app.settings import Settings, get_settings, resolve_device
from app.state import AppState, load_models, place_models
from app.web import assets
from app.web.deps import is_htmx
from app.web.middleware import BodyLimit
from app.web.openapi import install as install_openapi
from app.web.render import NO_GZIP, ROOT, localize, render, request_lang
from app.web.routes import all_routers
from app.web.routes.zoom import LONG_CAPTURE_PATH
from app.web.security import HostAndOrigin, OwnerCookie, SecurityHeaders, allowed_hosts, security_headers

log = logging.getLogger("kvscope")


def load_state(settings: Settings) -> AppState:
    """The models (``settings.models``, then the Training lab's saved ones) and the state built on them: the
    slow part of start-up (seconds to minutes), blocking. ``kvscope serve`` runs it in a worker thread and
    hands the result to ``create_app`` (``app/web/boot.py``); without a state, the lifespan calls it."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    resolve_device(settings)  # a GPU asked for where there is none: said before minutes of loading
    registry = load_models(settings)
    load_saved_trained(registry, settings.home, keep=settings.max_trained_models)
    place_models(registry, settings)
    return AppState.create(settings, registry)


def create_app(settings: Settings | None = None, state: AppState | None = None) -> FastAPI:
    settings = settings or (state.settings if state else get_settings())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        if getattr(app.state, "kv", None) is None:
            app.state.kv = load_state(settings)
        for spec, why in app.state.kv.registry.failures.items():
            log.warning("%s: %s", spec, why)
        # Requests waiting for the model sit in worker threads; keep enough threads beyond the model queue's
        # bound that pages, static files and /healthz are always served.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, settings.queue_max_waiting + 32)
        app.state.kv.prepare_memory()  # glibc's allocator settings, the weights paged in (app/memory.py)
        app.state.kv.start_janitor()
        try:
            yield
        finally:
            app.state.kv.stop_labs()
            app.state.kv.stop_janitor()

    app = FastAPI(title="KVScope", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)  # assets.py
    app.state.kv = state
    # The last added runs first: headers go on every answer, foreign hosts and origins are refused before
    # anything else runs, then the owner cookie, the body limit and compression.
    app.add_middleware(GZipMiddleware, minimum_size=1024, exclude_content_types=NO_GZIP)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,  # a long prompt's text: its own, larger limit
                       wider={LONG_CAPTURE_PATH: settings.long_upload_bytes + settings.max_body_bytes})
    app.add_middleware(OwnerCookie, secret=settings.secret.encode() if settings.secret else secrets.token_bytes(32))
    app.add_middleware(HostAndOrigin, hosts=allowed_hosts(settings.host, settings.allowed_hosts),
                       any_ip=settings.host in ("0.0.0.0", "::"))
    app.add_middleware(SecurityHeaders)
    app.mount("/static", assets.CachedStatic(directory=ROOT / "static"), name="static")
    app.include_router(assets.router)
    for router in all_routers():
        app.include_router(router)
    _install_error_handlers(app)
    install_openapi(app)
    return app


def _error_response(request: Request, status: int, message: str, headers: dict[str, str] | None = None):
    """Every error answer: ``{"detail": message}`` (app/web/openapi.py documents it), or the same message as
    a page or an htmx fragment. ``headers`` (Allow on a 405, say) go on whichever it is."""
    if is_htmx(request):
        # Show the message in the page's error area and leave the current view as it was.
        return render(request, "partials/_error.html", status_code=status, message=message,
                      headers={**(headers or {}), "HX-Retarget": "#error", "HX-Reswap": "innerHTML"})
    if not request.url.path.startswith("/api/") and "text/html" in request.headers.get("accept", ""):
        # A person followed a link or typed a URL: a page with the message, not raw JSON.
        try:
            return render(request, "error.html", status_code=status, message=message, page=None, headers=headers)
        except Exception:  # the error page itself must never turn a clear message into a 500
            log.exception("error page failed")
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError, lang: str) -> str:
    """Which field is wrong, with pydantic's own reason (its wording stays English: it names a rule)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x not in ("query", "path", "body"))
        why = err.get("msg", "invalid")
        if isinstance(err.get("input"), bool):  # a number field sent true/false: say what was sent
            why += f" (got {str(err['input']).lower()})"
        parts.append(f"{where}: {why}" if where else why)
    return translate("err.invalid", lang, details="; ".join(parts))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(UserError)
    async def on_user_error(request: Request, exc: UserError):
        response = _error_response(request, exc.status, exc.text(request_lang(request)))
        retry_after = getattr(exc, "retry_after", None)  # a busy gate's errors say when to come back
        if retry_after:
            response.headers["Retry-After"] = str(retry_after)
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        return _error_response(request, 422, _validation_message(exc, request_lang(request)))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        lang = request_lang(request)
        message = localize(exc.detail, lang) if isinstance(exc.detail, str) else translate("err.request_failed", lang)
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = translate("err.not_found", lang, path=request.url.path)
        elif exc.status_code == 405:
            message = translate("err.method", lang, method=request.method, allowed=(exc.headers or {}).get("Allow", ""))
        elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's words
            message = translate("err.body_unreadable", lang)
        headers = None if exc.headers is None else dict(exc.headers)
        return _error_response(request, exc.status_code, message, headers=headers)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        response = _error_response(request, 500, translate("err.server", request_lang(request)))
        for name, value in security_headers():  # this answer leaves outside SecurityHeaders
            response.headers[name.decode()] = value.decode()
        return response
