"""pin.json checked where it is read (app/labs/kit_files.py): every field the kit reads, given a wrong type or value
by hand, is refused naming that field; the pin KVScope wrote reads back as it was written."""

from __future__ import annotations

import json

import pytest

from app.labs.kit_files import PIN_FIELDS, SUMMARIES, Damaged, read_pin
from app.model.loading import ModelRegistry
from app.quota import NOBODY
from app.settings import Settings
from app.state import AppState

WRONG = ("text", -1, True, None, [], {}, 1e400)  # 1e400: JSON's way of writing what Python reads as inf


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """A trace pin and a head-roles pin, written by the kit: {kind: the pin folder}."""
    home = tmp_path_factory.mktemp("kit-files")
    state = AppState.create(Settings(models=("builtin",), home=home), ModelRegistry(
        models={"builtin": tiny}, default="builtin", failures={}))
    _, key, _ = state.inspect.trace_prompt("builtin", "the cat sat on the mat", who=NOBODY)
    state.heads.view("builtin")
    pins = {"trace": state.kit.pin("trace", name="t", owner="a", key=key),
            "heads": state.kit.pin("heads", name="h", owner="a", model="builtin")}
    return {kind: home / "kit" / pin.code for kind, pin in pins.items()}


def _fields(kind: str) -> list[tuple[str, str]]:
    return [(kind, f"pin.{f}") for f in PIN_FIELDS] + [(kind, f"pin.summary.{f}") for f in SUMMARIES[kind]]


def test_a_pin_as_written_reads_back(written):
    for kind, folder in written.items():
        fields, record, signed = read_pin(folder)
        stored = json.loads((folder / "pin.json").read_text(encoding="utf-8"))
        assert fields == stored["pin"] and record == stored["record"] and fields["kind"] == kind and signed


@pytest.mark.parametrize(("kind", "field"), _fields("trace") + _fields("heads"))
def test_every_field_with_a_wrong_type_or_value_is_refused_by_name(written, tmp_path, kind, field):
    folder = tmp_path / written[kind].name
    folder.mkdir()
    data = json.loads((written[kind] / "pin.json").read_text(encoding="utf-8"))
    *path, last = field.split(".")[1:]
    target = data["pin"]
    for part in path:
        target = target[part]
    good = target[last]
    for wrong in WRONG:
        if type(wrong) is type(good) and field != "pin.code":
            continue  # a value of the right type: the range checks below
        target[last] = wrong
        (folder / "pin.json").write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(Damaged) as e:
            read_pin(folder)
        assert e.value.key in ("err.kit.bad_field", "err.kit.bad_json") and e.value.params["code"] == folder.name
        if e.value.key == "err.kit.bad_field":
            assert e.value.params["field"] == field, wrong


def test_values_out_of_range_are_refused(written, tmp_path):
    folder = tmp_path / written["trace"].name
    folder.mkdir()
    original = json.loads((written["trace"] / "pin.json").read_text(encoding="utf-8"))
    for change, field in ((lambda d: d["pin"].update(kind="file"), "pin.kind"),
                          (lambda d: d["pin"].update(name=""), "pin.name"),
                          (lambda d: d["pin"].update(name="a\x00b"), "pin.name"),
                          (lambda d: d["pin"].update(name="x" * 401), "pin.name"),
                          (lambda d: d["pin"].update(code="AAAAA"), "pin.code"),  # another folder's code
                          (lambda d: d["pin"]["summary"].update(tokens=-3), "pin.summary.tokens"),
                          (lambda d: d["record"].update(grid=[0, {}]), "record.grid"),
                          (lambda d: d["record"].update(zoom_grid={"x": {}}), "record.zoom_grid"),
                          (lambda d: d["record"].update(prompt=7), "record.prompt"),
                          (lambda d: d["record"].update(extra=1), "record")):  # the digest no longer matches
        data = json.loads(json.dumps(original))
        change(data)
        (folder / "pin.json").write_text(json.dumps(data), encoding="utf-8")
        with pytest.raises(Damaged) as e:
            read_pin(folder)
        assert e.value.params.get("field") == field


def test_a_pin_written_before_digests_reads_back(written, tmp_path):
    folder = tmp_path / written["heads"].name
    folder.mkdir()
    data = json.loads((written["heads"] / "pin.json").read_text(encoding="utf-8"))
    data.pop("digest")
    (folder / "pin.json").write_text(json.dumps(data), encoding="utf-8")
    _, record, signed = read_pin(folder)
    assert record == data["record"] and not signed
