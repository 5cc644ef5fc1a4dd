"""A page's scripts and styles as one file per group: the joined files, in order, cached for a year."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from bs4 import BeautifulSoup

from app.web.assets import STATIC

ROOT = Path(__file__).resolve().parents[2]


def _bundles(html: str) -> list[str]:
    page = BeautifulSoup(html, "html.parser")
    return ([s["src"] for s in page.select("head script[src]")] +
            [link["href"] for link in page.select("head link[rel=stylesheet]")])


def _parts(body: str) -> list[tuple[str, str]]:
    """A bundle cut back into (url, text) at the comment that heads each file."""
    heads = list(re.finditer(r"^/\* (/(?:static|vendor)/[\w./-]+) \*/\n", body, flags=re.M))
    return [(m.group(1), body[m.end(): heads[i + 1].start() if i + 1 < len(heads) else len(body)])
            for i, m in enumerate(heads)]


def test_the_inspect_page_asks_for_four_files_each_the_joined_files_in_order(client):
    html = client.get("/", params={"prompt": "The cat sat on"}).text
    urls = _bundles(html)
    assert len(urls) == 4 and all(u.startswith("/bundle/") for u in urls[:3]), urls  # base js, page js, base css
    served = {u: client.get(u) for u in urls}
    base_js = _parts(served[urls[0]].text)
    assert [u for u, _ in base_js][:2] == ["/vendor/htmx.min.js", "/static/kv.js"]
    for url, text in base_js + _parts(served[urls[1]].text) + _parts(served[urls[2]].text):
        if url.startswith("/static/"):  # the file as it is on disk, then the line that ends it
            own = (STATIC / url.removeprefix("/static/")).read_text()
            assert text in (own + "\n;\n", own + "\n"), url
    page_js = [u for u, _ in _parts(served[urls[1]].text)]
    assert page_js == ["/static/heatframe.js", "/static/inspect.js", "/static/why.js", "/static/export.js",
                       "/static/zoom.js", "/static/long.js", "/static/climb.js"]
    for r in served.values():
        assert r.status_code == 200 and "immutable" in r.headers["cache-control"]
    assert served[urls[0]].headers["content-type"].startswith("text/javascript")
    assert served[urls[2]].headers["content-type"].startswith("text/css")


def test_an_unknown_bundle_is_a_404_that_says_to_reload(client):
    r = client.get("/bundle/0123456789abcdef.js", headers={"Accept": "application/json"})
    assert r.status_code == 404 and "reload" in r.json()["detail"]


def test_every_script_bundle_parses_as_one_script(client, tmp_path):
    """Joined, the files still parse (a file ending without its semicolon or inside a // comment would break
    the next one). Node comes with npm, which ``make test`` installs (axe-deps)."""
    html = client.get("/", params={"prompt": "The cat sat on"}).text
    for url in _bundles(html):
        if url.endswith(".js"):
            path = tmp_path / url.rsplit("/", 1)[-1]
            path.write_bytes(client.get(url).content)
            subprocess.run(["node", "--check", str(path)], check=True, capture_output=True, timeout=60)
