"""What a new user met on a first visit, each pinned down."""

from __future__ import annotations

from pathlib import Path

from app.i18n import translate

ROOT = Path(__file__).resolve().parents[2]


def test_counts_of_one_are_singular_in_english():
    assert translate("tokens.count", n=1) == "1 token" and translate("tokens.count", n=2) == "2 tokens"
    assert translate("shapes.steps", n=1) == "1 step"
    assert translate("tokens.count", "zh", n=1) == "1 个 token"
    assert "(s)" not in (ROOT / "app/locales/en.js.json").read_text()


def test_the_space_rule_is_only_said_for_a_tokenizer_that_has_it(client):
    distil = client.get("/?prompt=the+cat&model=distilgpt2").text
    builtin = client.get("/?prompt=the+cat&model=builtin").text
    assert "Spaces belong to the token that follows them" in distil
    assert "Spaces belong to the token that follows them" not in builtin and "one token per character" in builtin


def test_the_offline_notice_names_a_command_that_runs_from_a_fresh_clone(tiny_client):
    html = tiny_client.get("/").text
    assert ".venv/bin/kvscope download distilgpt2" in html


def test_embedding_numbers_never_break_inside_a_number():
    css = (ROOT / "static/style.css").read_text()
    rule = next(line for line in css.splitlines() if line.startswith(".vec {"))
    assert "break-all" not in rule and "word-break: normal" in rule


def test_the_training_step_panel_is_read_again_when_a_run_ends():
    """The step panel ("on this batch now") reloads when a run stops or finishes, not only when one starts."""
    html = (ROOT / "templates/train.html").read_text()
    assert 'hx-trigger="train-job from:body, train-settled from:body"' in html
    assert 'fire("train-settled")' in (ROOT / "static/train.js").read_text()


def test_no_inline_script_or_event_handler_in_any_template():
    import re

    for path in (ROOT / "templates").rglob("*.html"):
        text = path.read_text()
        assert not re.search(r"\son[a-z]+=", text), path.name
        for tag in re.findall(r"<script\b[^>]*>", text):
            assert "src=" in tag or 'type="application/json"' in tag, (path.name, tag)
