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

LOCALES = Path(__file__).with_name("locales")
DEFAULT_LANG = "en"
# BCP 47 tags for <html lang>, where a catalog's file name is not one already.
HTML_LANG = {"zh": "zh-Hans"}


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


def translate(key: str, lang: str = DEFAULT_LANG, **values: object) -> str:
    text = catalog(lang).get(key) or catalog(DEFAULT_LANG).get(key) or key
    return text.format(**values) if values else text


def translator(lang: str = DEFAULT_LANG) -> Callable[..., str]:
    def _(key: str, **values: object) -> str:
        return translate(key, lang, **values)

    return _
