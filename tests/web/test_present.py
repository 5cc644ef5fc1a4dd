"""Presenter mode over HTTP: ?present=1 per request, /present/on|off kept in a cookie, the notice folds."""

from __future__ import annotations


def test_query_parameter_and_cookie_switch_presenter_mode(tiny_client):
    plain = tiny_client.get("/").text
    assert '<body class="present">' not in plain and 'href="/present/on?next=' in plain
    assert '<details class="notice" id="model-notice"' in plain  # one line on every page, the details folded
    shown = tiny_client.get("/", params={"present": "1"}).text
    assert '<body class="present">' in shown
    assert '<details class="notice" id="model-notice"' in shown
    r = tiny_client.get("/present/on", params={"next": "/decode?present=0&lang=zh"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/decode"
    assert "kvscope_present=1" in r.headers["set-cookie"]
    tiny_client.cookies.set("kvscope_present", "1")
    assert '<body class="present">' in tiny_client.get("/decode").text
    assert '<body class="present">' not in tiny_client.get("/decode", params={"present": "0"}).text
    off = tiny_client.get("/present/off", params={"next": "https://evil.example/"}, follow_redirects=False)
    assert off.headers["location"] == "/" and 'kvscope_present=""' in off.headers["set-cookie"]
    assert tiny_client.get("/present/sideways").status_code == 404


def test_the_model_notice_is_one_line_and_names_the_command_once(settings, tiny):
    """The notice above every page is one line (its summary); why, and the download command, folded under it: the
    command once, whether or not the loader's reason already names it."""
    from bs4 import BeautifulSoup
    from fastapi.testclient import TestClient

    from app.i18n import translate
    from app.model.loading import ModelRegistry
    from app.state import AppState
    from app.web.main import create_app

    command = translate("notice.download_cmd")
    for reasons in ({"distilgpt2": ("err.model.not_cached", {"model": "DistilGPT-2", "command": command})}, {}):
        reg = ModelRegistry(models={tiny.name: tiny}, default=tiny.name, reasons=reasons,
                            failures={"distilgpt2": "DistilGPT-2 is not in the local cache."})
        with TestClient(create_app(state=AppState.create(settings, reg))) as c:
            for lang in ("en", "zh"):
                for present in ("0", "1"):
                    page = c.get("/decode", params={"lang": lang, "present": present}).text
                    soup = BeautifulSoup(page, "html.parser")
                    notice = soup.find(id="model-notice")
                    assert notice.name == "details" and not notice.has_attr("open")
                    summary = notice.find("summary").get_text(" ", strip=True)
                    assert summary == f'{translate("notice.short_builtin", lang)} {translate("notice.more", lang)}'
                    assert notice.get_text().count(command) == 1, (reasons, lang)
