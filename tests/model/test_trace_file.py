"""A pinned trace's file (app/model/trace_file.py) read back, and every file that is not one it wrote whole refused
with ``TraceFileError``: cut at any length, emptied, its header garbled, bytes changed anywhere in it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.model.loading import ModelRegistry
from app.model.trace_file import TraceFileError, read_trace, write_trace
from app.quota import NOBODY
from app.settings import Settings
from app.state import AppState


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """(the trace, the bytes of its file) for a short prompt on the built-in model."""
    home = tmp_path_factory.mktemp("trace-file")
    state = AppState.create(Settings(models=("builtin",), home=home), ModelRegistry(
        models={"builtin": tiny}, default="builtin", failures={}))
    _, _, trace = state.inspect.trace_prompt("builtin", "the cat sat on the mat", who=NOBODY)
    path = home / "t.safetensors"
    write_trace(path, trace, {"model": "builtin"})
    return trace, path.read_bytes()


def _read(tmp_path, blob: bytes, adapter):
    path = tmp_path / "t.safetensors"
    path.write_bytes(blob)
    return read_trace(path, adapter)


def test_a_whole_file_reads_back_the_same_tensors(written, tmp_path, tiny):
    trace, blob = written
    back, meta = _read(tmp_path, blob, tiny.adapter)
    assert meta == {"model": "builtin"} and back.token_ids == trace.token_ids
    assert all(torch.equal(back.tensors[n], t) for n, t in trace.tensors.items())  # the same bytes, read back


def test_a_file_cut_at_any_length_is_refused(written, tmp_path, tiny):
    _, blob = written
    header_end = 8 + int.from_bytes(blob[:8], "little")
    cuts = {0, 1, 7, 8, 9, 1000, header_end - 1, header_end, header_end + 1, len(blob) // 2, len(blob) - 1}
    for n in sorted(c for c in cuts if 0 <= c < len(blob)):
        with pytest.raises(TraceFileError):
            _read(tmp_path, blob[:n], tiny.adapter)


def test_a_foreign_file_is_refused(tmp_path, tiny):
    for blob in (b"\x00" * 64, b"not a safetensors file at all", (10).to_bytes(8, "little") + b'{"a": 1}  ',
                 (2**62).to_bytes(8, "little") + b"{}"):
        with pytest.raises(TraceFileError):
            _read(tmp_path, blob, tiny.adapter)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_changed_byte_in_the_header_is_refused_or_read_never_a_crash(written, tmp_path, tiny, data):
    """A header byte changed (a digit, a quote, a bracket): the file is refused with ``TraceFileError``, or reads as
    a trace whose every tensor lies inside the file; no other exception, no read past the end."""
    _, blob = written
    header_end = 8 + int.from_bytes(blob[:8], "little")
    at = data.draw(st.integers(0, header_end - 1))
    value = data.draw(st.integers(0, 255))
    changed = blob[:at] + bytes([value]) + blob[at + 1 :]
    try:
        back, _ = _read(tmp_path, changed, tiny.adapter)
    except TraceFileError:
        return
    assert all(t.numel() * t.element_size() <= len(changed) for t in back.tensors.values())
