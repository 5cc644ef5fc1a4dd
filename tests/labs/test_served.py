"""What the served lab holds (app/labs/served.py): each browser its newest served traces, a class within the caps.
(Fetching, stitching and the pages, on a real vLLM: tests/engine/test_served_capture.py.)"""

from __future__ import annotations

import pytest
import torch

from app.errors import Expired
from app.labs.engine import EngineLab, EngineLimits
from app.labs.served import ServedLab
from app.quota import NOBODY


def lab_with(state, settings, **caps) -> ServedLab:
    limits = EngineLimits.of(settings.with_(**caps))
    return ServedLab(engine=EngineLab(limits=limits, links=[]), inspect=state.inspect, limits=limits)


@pytest.fixture
def trace(state, tiny):
    return state.inspect.compute_trace(tiny, tiny.encode("The cat sat on the mat"))


def held(lab: ServedLab, keys: list[str]) -> list[str]:
    """The keys still held, each checked both ways: in the lab and pinned in Inspect (where every view reads it)."""
    out = [k for k in keys if k in lab._held]
    assert out == [k for k in keys if lab.inspect.pinned_item(k) is not None]
    return out


def test_each_browser_keeps_its_newest_and_the_oldest_go_past_the_class_cap(state, settings, tiny, trace):
    lab = lab_with(state, settings, engine_served_per_browser=1, engine_served_max_traces=3)
    keys = [f"served-{who}{n}" for n, who in enumerate("abcd")]
    for key, who in zip(keys, "abcd", strict=True):
        lab.hold(key, tiny, trace, {}, who)
    assert held(lab, keys) == keys[1:]  # four browsers, three held: the first one's went
    lab.hold("served-b9", tiny, trace, {}, "b")
    assert held(lab, keys + ["served-b9"]) == ["served-c2", "served-d3", "served-b9"]  # b's older one went first
    with pytest.raises(Expired):
        lab.page("served-a0", who=NOBODY)


def test_the_bytes_cap_lets_the_oldest_go_but_never_the_newest(state, settings, tiny):
    long = state.inspect.compute_trace(tiny, tiny.encode("a b " * 60)[:120])  # ~0.2 MiB of tensors
    nbytes = sum(t.nbytes for t in long.tensors.values())
    lab = lab_with(state, settings, engine_served_max_mib=1, engine_served_per_browser=10)
    keys = [f"served-x{n}" for n in range(8)]
    for key in keys:
        lab.hold(key, tiny, long, {}, "x")
    fit = 2**20 // nbytes  # as many as 1 MiB holds
    assert 1 < fit < len(keys) and held(lab, keys) == keys[-fit:]
    small = lab_with(state, settings, engine_served_max_mib=1, engine_served_per_browser=10)
    huge = state.inspect.compute_trace(tiny, tiny.encode("a b " * 60)[:120])
    huge.tensors = {**huge.tensors, "padding": torch.zeros(2**20 // 4 + 1)}  # alone over the cap
    small.hold("served-only", tiny, huge, {}, "y")
    assert held(small, ["served-only"]) == ["served-only"]  # the newest is held even alone over the cap
