"""The prefix-cache lab (app/labs/prefix.py): one lab per browser, its limits the server's settings, the form's
prompts split as the page writes them."""

from __future__ import annotations

import pytest

from app.errors import BadInput
from app.labs.prefix import PROMPT_SEPARATOR, parse_block_size, split_prompts
from app.model.loading import ModelRegistry
from app.quota import Requester
from app.settings import Settings
from app.state import AppState


def lab_state(tiny, **settings) -> AppState:
    registry = ModelRegistry(models={"builtin": tiny}, default="builtin", failures={})
    return AppState.create(Settings(models=("builtin",), **settings), registry)


def test_the_forms_prompts_are_split_on_separator_lines_only():
    text = f"a b\r\n{PROMPT_SEPARATOR}\nc---d\n  {PROMPT_SEPARATOR}  \n\n{PROMPT_SEPARATOR}\ne"
    assert split_prompts(text) == ["a b", "c---d", "e"]
    assert split_prompts(None) == [] and split_prompts("") == []


def test_block_size_is_auto_or_one_of_the_sizes():
    assert parse_block_size("auto") is None and parse_block_size(None) is None and parse_block_size("8") == 8
    for bad in ("3", "x", 64):
        with pytest.raises(BadInput, match="4, 8, 16, 32"):
            parse_block_size(bad)


def test_each_browser_gets_its_own_lab_and_a_stranger_sees_an_empty_one(tiny):
    state = lab_state(tiny)
    lab = state.prefix.run(model=None, preset="system", prompts=None, block_size="auto", num_blocks=None, salt=None,
                           who=Requester("alice"))
    assert lab.totals.requests == 3 and lab.totals.requests_hit == 2  # the 2nd and 3rd reuse the system prompt
    assert state.prefix.peek("alice") is lab and state.prefix.peek("bob").cache is None
    assert state.prefix_labs.stats()["items"] == 1  # peeking made nothing for bob
    # The bytes the cache holds are admitted against the server's budget.
    assert state.prefix_labs.stats()["bytes"] == lab.cache.page_bytes * lab.cache.pool.num_blocks
    state.prefix.reset(Requester("alice"))
    assert state.prefix_labs.stats()["bytes"] == 0 and state.prefix.peek("alice").cache is None


def test_the_labs_limits_are_the_settings(tiny):
    state = lab_state(tiny, prefix_max_prompts=2, prefix_max_blocks=100, prefix_default_blocks=4,
                      prefix_max_salt_chars=3)

    def run(preset="custom", prompts=("abc",), block_size="auto", num_blocks=None, salt=None):
        return state.prefix.run(model=None, preset=preset, prompts=list(prompts), block_size=block_size,
                                num_blocks=num_blocks, salt=salt, who=Requester("carol"))

    with pytest.raises(BadInput, match="At most 2 prompts"):
        run(preset="system")  # three prompts
    with pytest.raises(BadInput, match="at most 3 characters"):
        run(salt="long")
    with pytest.raises(BadInput, match="between 1 and 100 blocks"):
        run(num_blocks=101)
    # The default capacity (4 blocks) grows to fit a run and says so; a capacity chosen is kept.
    prompts = ["the cat sat on the mat. " * 3, "the dog sat on the mat. " * 3]
    lab = run(prompts=prompts, block_size="4")
    assert lab.cache.pool.num_blocks > 4 and [k for k, _ in lab.notes] == ["prefix.note.grown"]
    with pytest.raises(BadInput):
        run(prompts=prompts, block_size="4", num_blocks=5)
