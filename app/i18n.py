"""The one translation layer: every string a page shows is looked up here by key.

Catalogs are JSON files in ``app/locales``: ``en.json`` plus one file per page (``en.decode.json``,
``en.prefix.json`` ...), merged; a key may be defined only once. Other languages may be partial and
fall back to English key by key. ``{name}`` placeholders are filled with ``str.format``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from urllib.parse import parse_qs

LOCALES = Path(__file__).with_name("locales")
DEFAULT_LANG = "en"
# BCP 47 tags for <html lang>, where a catalog's file name is not one already.
HTML_LANG = {"zh": "zh-Hans"}
# Where a request names its language (app/web/render.py's request_lang, app/web/boot.py's start-up page).
LANG_COOKIE = "kvscope_lang"
LANG_HEADER = "x-kvscope-lang"


@lru_cache
def catalog(lang: str) -> dict[str, str]:
    merged: dict[str, str] = {}
    for path in sorted(LOCALES.glob(f"{lang}.json")) + sorted(LOCALES.glob(f"{lang}.*.json")):
        part = json.loads(path.read_text(encoding="utf-8"))
        clash = merged.keys() & part.keys()
        if clash:
            raise ValueError(f"{path.name} redefines keys: {sorted(clash)}")
        merged.update(part)
    return merged


@lru_cache
def _languages() -> tuple[str, ...]:
    return tuple(sorted({p.name.split(".")[0] for p in LOCALES.glob("*.json")}))


def available_languages() -> list[str]:
    return list(_languages())


def html_lang(lang: str) -> str:
    return HTML_LANG.get(lang, lang)


def pick_lang(query: str | None, header: str | None, cookie: str | None, accept: str = "") -> str:
    """A request's language from what it carries, first match wins: ``?lang=``, the page's own language
    (``X-KVScope-Lang``), the ``kvscope_lang`` cookie, Accept-Language, else English. Values that name no
    catalog are skipped."""
    languages = available_languages()
    for candidate in (query, header, cookie):
        if candidate in languages:
            return candidate
    return accept_language(accept, languages) or DEFAULT_LANG


def scope_lang(scope: dict) -> str:
    """``pick_lang`` for a raw ASGI request scope, for code that runs outside FastAPI (middleware, the start-up
    app of ``app/web/boot.py``): no Starlette import."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
    query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("lang", [None])[0]
    cookie = None
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == LANG_COOKIE:
            cookie = value
    return pick_lang(query, headers.get(LANG_HEADER), cookie, headers.get("accept-language", ""))


def accept_language(header: str, languages: list[str]) -> str | None:
    """The best of ``languages`` in an Accept-Language header (``"zh-CN,zh;q=0.9,en;q=0.8"`` → ``"zh"``)."""
    ranked = []
    for i, part in enumerate(header.split(",")):
        tag, _, params = part.strip().partition(";")
        q = 1.0
        if params.strip().startswith("q="):
            try:
                q = float(params.strip()[2:])
            except ValueError:
                q = 0.0
        base = tag.strip().lower().split("-")[0]
        if base in languages and q > 0:
            ranked.append((-q, i, base))
    return min(ranked)[2] if ranked else None


class Term(str):
    """A parameter that is itself a catalog key (a status such as ``status.running``): translated when filled in."""


def _value(value: object, lang: str) -> object:
    if isinstance(value, Term):
        return translate(str(value), lang)
    if isinstance(value, (list, tuple)):
        return ", ".join(str(_value(v, lang)) for v in value)
    return value


def translate(key: str, lang: str = DEFAULT_LANG, **values: object) -> str:
    """The catalog text of ``key`` in ``lang`` (English, then the key itself, when missing), placeholders filled.

    Lists are joined with ", "; ``Term`` values are translated first. When ``n`` is 1 and the catalog has
    ``<key>.one`` ("1 token" next to "{n} tokens"), that form is used.
    """
    if values.get("n") == 1 and f"{key}.one" in catalog(lang):
        key = f"{key}.one"
    text = catalog(lang).get(key) or catalog(DEFAULT_LANG).get(key) or key
    return text.format(**{k: _value(v, lang) for k, v in values.items()}) if values else text


def translator(lang: str = DEFAULT_LANG) -> Callable[..., str]:
    def _(key: str, **values: object) -> str:
        return translate(key, lang, **values)

    return _
