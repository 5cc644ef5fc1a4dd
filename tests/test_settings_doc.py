"""docs/settings.md is what the generator gives from Settings (``kvscope settings-doc``); it names every variable."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from app.cli import main
from app.settings import Settings, var
from app.settings_doc import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_the_committed_settings_doc_is_what_the_generator_gives():
    assert DOC.read_text(encoding="utf-8") == render(), "docs/settings.md is stale: run make settings-doc"


def test_every_setting_is_documented_once_with_its_default(tmp_path):
    text = render()
    for f in dataclasses.fields(Settings):
        assert text.count(f"`{var(f.name)}` = ") == 1, f.name
    assert "`KVSCOPE_TRACE_KEEP_ONE_BYTES` = 1 006 632 960 (960 MiB)" in text  # the default, as Settings has it
    out = tmp_path / "settings.md"
    assert main(["settings-doc", "--out", str(out)]) == 0 and out.read_text(encoding="utf-8") == text
