"""Jinja2 templates, with the translation function and a few formatting filters."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request
from fastapi.templating import Jinja2Templates

from app.i18n import DEFAULT_LANG, available_languages, catalog, html_lang, translator
from app.viz.shapes import fmt_shape

ROOT = Path(__file__).resolve().parents[2]
LANG_COOKIE = "kvscope_lang"
TEMPLATES = Jinja2Templates(directory=str(ROOT / "templates"))
TEMPLATES.env.filters["shape"] = fmt_shape
TEMPLATES.env.filters["num"] = lambda x, d=4: f"{x:.{d}f}"
TEMPLATES.env.filters["bytes"] = lambda n: human_bytes(n)


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
    """The page language: ``?lang=`` if it names a catalog, else the ``kvscope_lang`` cookie, else English."""
    languages = available_languages()
    for candidate in (request.query_params.get("lang"), request.cookies.get(LANG_COOKIE)):
        if candidate in languages:
            return candidate
    return DEFAULT_LANG


def render(request: Request, template: str, status_code: int = 200, headers: dict | None = None, **context):
    lang = request_lang(request)
    context.setdefault("_", translator(lang))
    context.setdefault("lang", lang)
    context.setdefault("html_lang", html_lang(lang))
    context.setdefault("languages", [(code, catalog(code).get("lang.name", code)) for code in available_languages()])
    context.setdefault("js_strings", js_strings(lang))
    state = request.app.state.kv
    context.setdefault("state", state)
    if "card" not in context:
        from app.viz.models import model_card

        name = request.query_params.get("model")
        context["card"] = model_card(state.registry.models.get(name) or state.registry.get(None))
    return TEMPLATES.TemplateResponse(request, template, context, status_code=status_code, headers=headers)
