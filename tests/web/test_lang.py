"""The language switch: a cookie set by /lang/{code}, read by every page, and a safe way back to the page."""

from __future__ import annotations

import json
import re

import pytest

from app.i18n import LANG_COOKIE, catalog
from app.web.routes.lang import safe_next


def test_switch_sets_the_cookie_and_goes_back(client):
    r = client.get("/lang/zh", params={"next": "/decode?model=builtin"}, follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/decode?model=builtin"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{LANG_COOKIE}=zh;") and "Path=/" in cookie and "SameSite=lax" in cookie


def test_switch_drops_lang_from_the_page_address_so_the_cookie_decides(client):
    r = client.get("/lang/en", params={"next": "/?prompt=the+cat&lang=zh"}, follow_redirects=False)
    assert r.headers["location"] == "/?prompt=the+cat"


@pytest.mark.parametrize("target", [
    "https://evil.example/", "//evil.example/x", "/\\evil.example", "\\\\evil.example", "/\t/evil.example",
    "/\n/evil.example", "javascript:alert(1)", "evil.example", "", "http:/evil.example",
])
def test_switch_never_leaves_the_site(client, target):
    r = client.get("/lang/zh", params={"next": target}, follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/"


def test_safe_next_keeps_paths_on_this_site():
    assert safe_next("/paged") == "/paged"
    assert safe_next("/?prompt=a%26b&layer=2") == "/?prompt=a%26b&layer=2"
    assert safe_next(None) == "/"


@pytest.mark.parametrize("code", ["xx", "EN", "zh-Hans", "zh_CN", "en.decode", "%2e%2e"])
def test_unknown_language_is_a_clear_404_and_sets_no_cookie(client, code):
    r = client.get(f"/lang/{code}", params={"next": "/"}, follow_redirects=False)
    assert r.status_code == 404
    assert "Unknown language" in r.json()["detail"] and "en, zh" in r.json()["detail"]
    assert LANG_COOKIE not in r.headers.get("set-cookie", "")


def test_page_with_the_cookie_is_chinese(client):
    client.cookies.set(LANG_COOKIE, "zh")
    for path, key in [("/", "inspect.title"), ("/decode", "decode.title"), ("/prefix", "prefix.title"),
                      ("/paged", "paged.title"), ("/train", "train.title")]:
        html = client.get(path).text
        assert '<html lang="zh-Hans">' in html, path
        assert catalog("zh")[key] in html and catalog("en")[key] not in html, path
    # The scripts' strings are embedded in Chinese too (as JSON, read by kv.t).
    html = client.get("/decode").text
    embedded = re.search(r'<script type="application/json" id="i18n-strings">(.*?)</script>', html)
    assert json.loads(embedded.group(1))["js.decode.title_prefill"] == catalog("zh")["js.decode.title_prefill"]


def test_query_parameter_wins_over_the_cookie_and_bad_values_are_ignored(client):
    client.cookies.set(LANG_COOKIE, "zh")
    html = client.get("/", params={"lang": "en"}).text
    assert '<html lang="en">' in html and catalog("en")["inspect.title"] in html
    client.cookies.set(LANG_COOKIE, "klingon")
    html = client.get("/", params={"lang": "../etc"}).text
    assert '<html lang="en">' in html and catalog("en")["inspect.title"] in html


def test_header_offers_both_languages_and_marks_the_current_one(client):
    html = client.get("/decode?model=builtin").text
    assert 'href="/lang/zh?next=/decode%3Fmodel%3Dbuiltin"' in html
    assert ">中文</a>" in html and 'class="on" aria-current="true">English</a>' in html


def test_htmx_fragment_follows_the_cookie(client):
    client.cookies.set(LANG_COOKIE, "zh")
    html = client.get("/", params={"prompt": "The cat sat on"}, headers={"HX-Request": "true"}).text
    assert catalog("zh")["tokens.title"] in html and catalog("zh")["shapes.title"] in html


def test_server_error_messages_follow_the_cookie(client):
    client.cookies.set(LANG_COOKIE, "zh")
    try:
        r = client.get("/api/trace", params={"prompt": ""})
        assert r.status_code == 422 and "提示词是空的" in r.json()["detail"]
    finally:
        client.cookies.delete(LANG_COOKIE)
    assert "empty" in client.get("/api/trace", params={"prompt": ""}).json()["detail"]


@pytest.mark.browser
def test_click_chinese_and_it_sticks(page, live_server):
    page.goto(live_server + "/")
    page.click("header .lang-switch a[data-lang='zh']")
    page.wait_for_selector("html[lang='zh-Hans']")
    assert page.inner_text("h1") == catalog("zh")["inspect.title"]
    assert page.url.rstrip("/") == live_server.rstrip("/")

    page.goto(live_server + "/decode")
    assert page.get_attribute("html", "lang") == "zh-Hans"
    assert page.inner_text("h1") == catalog("zh")["decode.title"]
    page.fill("#prompt", "The cat sat on")
    page.click("#prefill")
    page.wait_for_function("document.body.dataset.decodeStep === '0'")
    assert page.inner_text("#step-title") == catalog("zh")["js.decode.title_prefill"]
    assert catalog("zh")["js.decode.len_badge"].format(n=5, cache=4) in page.inner_text("#len-badge")

    page.click("header .lang-switch a[data-lang='en']")
    page.wait_for_selector("html[lang='en']")
    assert page.inner_text("h1") == catalog("en")["decode.title"]
    assert page.js_errors == []


def test_training_api_axis_titles_follow_the_cookie(client):
    """The training page's script fetches parameter heatmaps without ?lang=: the cookie decides their axis titles."""
    client.cookies.set(LANG_COOKIE, "zh")
    assert catalog("zh")["train.param.axis_x"] in client.get("/api/train/param").text
    client.cookies.set(LANG_COOKIE, "en")
    assert catalog("en")["train.param.axis_x"] in client.get("/api/train/param").text


def test_the_header_reaches_every_lab_and_speaks_the_pages_language(client):
    """Every lab page is one click from any other, and in Chinese no header link is left in English."""
    from bs4 import BeautifulSoup

    from app.web.routes import all_routers

    labs = {r.path for router in all_routers() for r in router.routes  # the pages: /decode, /heads … (not the API)
            if getattr(r, "methods", None) == {"GET"} and not r.include_in_schema and r.path[1:].isalpha()}
    texts = {}
    for lang in ("en", "zh"):
        soup = BeautifulSoup(client.get("/decode", params={"lang": lang}).text, "html.parser")
        links = soup.select("header.top > nav a")
        hrefs = {a["href"].split("?")[0] for a in links}
        assert {"/heads", "/speculative"} <= hrefs and labs <= hrefs, labs - hrefs
        texts[lang] = [a.get_text(strip=True) for a in links]
    same = [en for en, zh in zip(texts["en"], texts["zh"], strict=True) if en == zh]
    assert same == [], same
