"""Every message a user can get from the server is a catalog key with parameters, in English and Chinese."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from app.i18n import catalog

ROOT = Path(__file__).resolve().parents[1]
ERRORS = {"UserError", "BadInput", "NotFound", "Expired", "Busy", "Throttled", "BadSetting"}
# Files that may still raise literal sentences (none: every message is a key).
PENDING: set[str] = set()


def _error_calls():
    for path in sorted((ROOT / "app").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if name in ERRORS:
                    yield rel, node


def test_every_raised_message_is_a_key_with_english_and_chinese_text_and_matching_parameters():
    calls = list(_error_calls())
    assert len(calls) > 50
    problems = []
    for rel, node in calls:
        first = node.args[0] if node.args else None
        where = f"{rel}:{node.lineno}"
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            if rel not in PENDING:
                problems.append(f"{where}: the message is not a literal catalog key")
            continue
        key = first.value
        if rel in PENDING and not key.startswith("err."):
            continue
        params = sorted(k.arg for k in node.keywords if k.arg and k.arg != "retry_after")
        for lang in ("en", "zh"):
            text = catalog(lang).get(key)
            if text is None:
                problems.append(f"{where}: {key!r} has no {lang} entry")
            elif sorted(set(re.findall(r"\{(\w+)[^{}]*\}", text))) != params:
                problems.append(f"{where}: {key!r} ({lang}) gets {params}: {text}")
    assert not problems, "\n".join(problems)


def test_no_english_sentence_is_raised_outside_the_lead_s_pending_files():
    """A literal English sentence (a space and a capital or a full stop) raised as an error fails this test."""
    sentences = []
    for rel, node in _error_calls():
        first = node.args[0] if node.args else None
        if rel in PENDING:
            continue
        if isinstance(first, ast.JoinedStr) or (isinstance(first, ast.Constant) and " " in str(first.value)):
            sentences.append(f"{rel}:{node.lineno}")
    for path in sorted((ROOT / "app").rglob("*.py")):
        text = path.read_text()
        if re.search(r"HTTPException\(\s*\d+\s*,\s*f?[\"']", text):
            sentences.append(f"{path.relative_to(ROOT)}: HTTPException with a literal message")
    assert not sentences, sentences


def test_api_errors_follow_the_request_language(client):
    for headers, params, marker in [
        ({}, {"lang": "zh"}, "提示词"),
        ({"Accept-Language": "zh-CN,zh;q=0.9,en;q=0.8"}, {}, "提示词"),
        ({"Accept-Language": "fr, en;q=0.5"}, {}, "The prompt"),
        ({}, {}, "The prompt"),
    ]:
        r = client.get("/api/trace", params={"prompt": " ", **params}, headers=headers)
        assert r.status_code == 422 and marker in r.json()["detail"], (headers, params, r.json())
    client.cookies.set("kvscope_lang", "zh")
    try:
        r = client.get("/api/trace", params={"prompt": " "})
        assert "提示词" in r.json()["detail"]
        # A page opened with ?lang=en says so in every request it makes: its language wins over the cookie.
        r = client.get("/api/trace", params={"prompt": " "}, headers={"X-KVScope-Lang": "en"})
        assert "The prompt" in r.json()["detail"]
    finally:
        client.cookies.clear()


def test_accept_language_picks_the_best_catalog_language():
    from app.i18n import accept_language

    langs = ["en", "zh"]
    assert accept_language("zh-CN,zh;q=0.9,en;q=0.8", langs) == "zh"
    assert accept_language("en-US,en;q=0.9,zh;q=0.8", langs) == "en"
    assert accept_language("fr-FR, zh;q=0.3", langs) == "zh"
    assert accept_language("de", langs) is None and accept_language("", langs) is None
    assert accept_language("zh;q=0, en;q=0.1", langs) == "en"
