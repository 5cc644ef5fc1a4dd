"""/docs and /redoc work with no internet: every asset they load comes from this server."""

from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize("url", ["/docs", "/redoc"])
def test_docs_pages_load_only_local_assets(client, url):
    html = client.get(url).text
    refs = re.findall(r"""(?:src|href)=["']([^"']+)""", html)
    assert refs and all(r.startswith("/") and not r.startswith("//") for r in refs), refs
    assert "<script>" not in html and "cdn" not in html.lower()  # no inline script, no CDN
    for ref in refs:
        r = client.get(ref)
        assert r.status_code == 200 and len(r.content) > 100, ref
        assert "max-age" in r.headers.get("cache-control", ""), ref


def test_favicon_is_served(client):
    r = client.get("/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg")


@pytest.mark.browser
def test_swagger_ui_draws_the_api_offline(browser, live_server):
    # A context with the app's Content-Security-Policy enforced (the shared ``page`` fixture bypasses it):
    # the CSP is what keeps ReDoc from fetching its logo from a CDN.
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    outside = []

    def block(route):
        outside.append(route.request.url)
        route.abort()

    page.route(re.compile(r"^(?!http://127\.0\.0\.1).*"), block)
    page.goto(live_server + "/docs")
    page.wait_for_selector(".opblock-tag", timeout=30_000)
    assert page.locator(".opblock").count() > 10
    page.goto(live_server + "/redoc")
    page.wait_for_selector("[role=menuitem], .menu-content", timeout=30_000)
    context.close()
    assert outside == [] and errors == []
