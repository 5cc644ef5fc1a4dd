"""Every UI string goes through the translation layer, and every key used exists in English."""

from __future__ import annotations

import re
from pathlib import Path

from app.i18n import catalog, translate

ROOT = Path(__file__).resolve().parents[1]


def test_every_template_key_exists_in_english():
    keys = set()
    for path in (ROOT / "templates").rglob("*.html"):
        keys |= set(re.findall(r"""_\(\s*["']([a-z0-9_.]+)["']""", path.read_text()))
    keys = {k for k in keys if not k.endswith(".")}  # dynamic keys like "nav." ~ page are checked below
    missing = sorted(k for k in keys if k not in catalog("en"))
    assert not missing, missing


def test_every_shape_step_has_an_explanation(state, tiny):
    from app.model.capture import run_traced
    from app.viz.shapes import UNEXPLAINED, shape_groups

    ids = tiny.encode("the cat")
    trace = run_traced(tiny.model, tiny.adapter, ids, tiny.token_texts(ids))
    for group in shape_groups(trace.steps, tiny.adapter, len(ids)):
        for row in group["rows"]:
            assert row["explain_key"] != UNEXPLAINED and row["explain_key"] in catalog("en"), row["name"]


def test_placeholders_are_filled():
    assert translate("tokens.count", n=7) == "7 tokens"


def test_every_script_key_exists_in_english():
    """Page scripts read their strings through kv.t("js....") from the catalog the page embeds."""
    keys = set()
    for path in (ROOT / "static").glob("*.js"):
        keys |= set(re.findall(r"""kv\.t\(\s*["'](js\.[a-z0-9_.]+)["']""", path.read_text()))
    assert keys, "no kv.t() calls found"
    missing = sorted(k for k in keys if not k.endswith(".") and k not in catalog("en"))
    assert not missing, missing


def _placeholders(text: str) -> list[str]:
    return sorted(re.findall(r"\{(\w*)\}", text))


def test_every_english_key_is_translated_to_chinese_with_the_same_placeholders():
    """Each en*.json file has a zh*.json twin with every key, each keeping exactly the same {placeholders}."""
    import json

    locales = ROOT / "app" / "locales"
    english_files = sorted(locales.glob("en*.json"))
    assert len(english_files) >= 7
    for en_path in english_files:
        zh_path = locales / ("zh" + en_path.name[2:])
        assert zh_path.exists(), zh_path.name
        en, zh = (json.loads(p.read_text(encoding="utf-8")) for p in (en_path, zh_path))
        assert sorted(zh) == sorted(en), (zh_path.name, sorted(en.keys() ^ zh.keys()))
        for key, text in en.items():
            assert zh[key].strip(), (zh_path.name, key)
            assert _placeholders(zh[key]) == _placeholders(text), (zh_path.name, key, zh[key])


def test_chinese_is_offered_and_falls_back_to_english_key_by_key():
    from app.i18n import available_languages, html_lang

    assert available_languages() == ["en", "zh"]
    assert html_lang("zh") == "zh-Hans" and html_lang("en") == "en"
    assert translate("tokens.count", "zh", n=7) == "7 个 token"
    assert translate("no.such.key", "zh") == "no.such.key"


def test_chinese_names_a_head_tou_outside_brackets_and_translates_the_prefill_button():
    """ZH-TERMS: English terms stay in （…） beside the Chinese one; "单个 head" beside "KV 头" read as two words."""
    import re

    zh = catalog("zh")
    for key, text in zh.items():
        bare = re.sub(r"（[^）]*）|\([^)]*\)|<[^>]*>|\{[^}]*\}|`[^`]*`", "", text)
        assert not re.search(r"(?<![A-Za-z_.-])head(?![A-Za-z_-])", bare), (key, text)
    assert zh["head.title"] == "单个头" and zh["grid.title"] == "全部头"
    assert zh["decode.cost"] == "缓存省下了什么"
    assert "prefill" in zh["decode.prefill"] and zh["decode.prefill"] != "Prefill"
