"""Every memory budget Settings declares, plus the models the default settings load, fits the laptop that
docs/operating.md names.

The budgets are found from the Settings fields themselves (every ``*_bytes`` field), so a budget added later is
counted without touching this file. Each is counted at its full size and once, a request body and a download as
one in flight; the trace store as the larger of ``trace_cache_bytes`` and ``trace_keep_one_bytes`` (it makes room
before a forward, tested in tests/model/test_store.py), ``trace_browser_bytes`` (one browser's part of it) counted
in that maximum too. Bounded by settings that are not ``*_bytes`` fields and
counted here by name: the roofline panel's probe arrays and K/V cache (``roofline_max_context``,
``roofline_max_batch``). Not counted, because no setting claims to bound it: the transient tensors of one capture
while it runs (one at a time, under the model lock), and several downloads packed at the same moment.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
import torch
from transformers import GPT2LMHeadModel

from app.catalog import CATALOG
from app.labs.speculative import SpecLimits, roofline_bytes, roofline_cache_tokens
from app.model.builtin import build_char_tokenizer, builtin_vocabulary, tiny_config
from app.settings import Settings

GiB, MiB = 1024**3, 1024**2
LAPTOP = 4 * GiB  # docs/operating.md, "How memory is bounded": the server fits a 4 GiB laptop
# Python, torch and the app with no model loaded: docs/operating.md's ~750 MB RSS with DistilGPT-2 less its ~330 MB
# of weights.
RUNTIME = 450 * MiB
FLOAT32 = 4  # app/model/loading.py loads every checkpoint in float32


# Budgets of bytes on disk, not in memory: the class kit's files (pinned traces are read back memory-mapped, file
# pages the OS drops and reads again: tests/labs/test_kit.py checks that reading one copies nothing).
ON_DISK = ("kit_disk_bytes",)


def budgets(s: Settings) -> dict[str, int]:
    """Every memory budget the settings declare: the fields named ``*_bytes`` (but those of ``ON_DISK``)."""
    return {f.name: getattr(s, f.name) for f in fields(s) if f.name.endswith("_bytes") and f.name not in ON_DISK}


def tiny_params(vocab_size: int) -> int:
    with torch.device("meta"):  # shapes only, nothing allocated
        model = GPT2LMHeadModel(tiny_config(vocab_size))
    return sum(p.numel() for p in model.parameters())


def model_bytes(s: Settings) -> int:
    """The weights the settings load: catalog models by their parameter count, the built-in one by its config, and
    ``max_trained_models`` Training-lab models (each at most one token per character of the longest text) plus one
    run in progress (weights, gradients and AdamW's two moments)."""
    total = 0
    for name in s.models:
        if name == "builtin":
            total += FLOAT32 * tiny_params(len(builtin_vocabulary()))
        else:
            total += FLOAT32 * CATALOG[name].parameters  # counted from the config (app/catalog.py: sizes)
    trained = FLOAT32 * tiny_params(len(build_char_tokenizer("")) + Settings().train_max_text_chars)
    return total + s.max_trained_models * trained + 4 * trained


def kv_bytes_per_token(name: str) -> int:
    """K and V of every layer for one token, float32, from the catalog's shapes (the built-in model from its
    config)."""
    if name == "builtin":
        c = tiny_config(len(builtin_vocabulary()))
        return 2 * c.n_layer * c.n_embd * FLOAT32
    m = CATALOG[name]
    return 2 * m.n_layer * m.n_kv_head * m.head_dim * FLOAT32


def roofline_lab_bytes(s: Settings) -> int:
    """The speculative page's roofline panel (Settings ``roofline_max_context``, ``roofline_max_batch``): its
    probe arrays and the random K/V cache of the largest step it times, for the loaded model with the widest
    cache per token (one run at a time: it holds the model gate)."""
    return max(roofline_bytes(SpecLimits.of(s), kv_bytes_per_token(name)) for name in s.models)


TRACE_STORE = ("trace_cache_bytes", "trace_keep_one_bytes", "trace_browser_bytes")  # one browser's: within the store


def counted(s: Settings) -> dict[str, int]:
    """The budgets as they add up: the trace store holds at most the larger of its two (app/model/store.py drops
    older traces before a forward whose trace would not fit beside them), every other budget at its full size."""
    b = budgets(s)
    store = max(b.pop(name) for name in TRACE_STORE)
    return {**b, "trace_store": store}


def held(s: Settings) -> int:
    return sum(counted(s).values()) + model_bytes(s) + roofline_lab_bytes(s) + RUNTIME


def test_every_memory_budget_and_the_default_models_fit_a_4_gib_laptop():
    s = Settings()
    # docs/operating.md's list of what is bounded is found by the derivation (a check that the derivation looks).
    assert {"trace_cache_bytes", "trace_keep_one_bytes", "session_cache_bytes", "paged_cache_bytes",
            "prefix_cache_bytes", "max_export_bytes", "max_body_bytes"} <= budgets(s).keys()
    assert held(s) <= LAPTOP, f"{held(s) / GiB:.2f} GiB: {budgets(s)}, models {model_bytes(s) / MiB:.0f} MiB"


@pytest.mark.parametrize("name", sorted(budgets(Settings())))
def test_the_check_fails_when_any_one_budget_grows_past_what_is_left(name):
    s = Settings()
    spare = LAPTOP - held(s)
    assert spare > 0
    now = max(getattr(s, n) for n in TRACE_STORE) if name in TRACE_STORE else getattr(s, name)
    bigger = s.with_(**{name: now + spare + 1})
    assert held(bigger) > LAPTOP  # either of the trace store's two budgets counts once it is the larger


def test_a_budget_added_to_settings_later_is_counted():
    @dataclass(frozen=True)
    class WithANewBudget(Settings):
        new_lab_cache_bytes: int = 300 * MiB

    assert held(WithANewBudget()) == held(Settings()) + 300 * MiB


def test_the_roofline_labs_cache_is_counted_and_grows_with_its_settings():
    s = Settings()
    smol = kv_bytes_per_token("smollm2-135m-instruct")
    assert smol == 2 * 30 * 3 * 64 * 4  # 46 080 B: 30 layers, 3 KV heads, head_dim 64, fp32
    # Its largest step: 1024 tokens at batch 1, or 64 tokens at batch 16 — 1024 tokens, 45 MiB of K/V for SmolLM2.
    assert roofline_cache_tokens(SpecLimits.of(s)) == 1024
    assert roofline_lab_bytes(s) == 3 * 64 * MiB + 3 * 1024**2 * 4 + 1024 * smol
    assert held(s) == sum(counted(s).values()) + model_bytes(s) + roofline_lab_bytes(s) + RUNTIME
    spare = LAPTOP - held(s)
    assert spare > 0
    # The cache bound is a product of the two settings' reach: more batch at the first context (64) counts.
    wider = s.with_(roofline_max_batch=s.roofline_max_batch * 64)
    assert roofline_cache_tokens(SpecLimits.of(wider)) == 64 * 16  # the lab times batches 1, 4, 16 only: no larger step
    longer = s.with_(roofline_max_context=100_000)
    assert roofline_cache_tokens(SpecLimits.of(longer)) == 1024  # nor contexts past 1024


def test_no_roofline_step_holds_more_cache_than_counted(tiny, settings, monkeypatch):
    """The second way: run the panel and record every cache it fills (sequences × tokens)."""
    from app.model import roofline as rl
    from tests.conftest import make_state

    filled = []
    real = rl.filled_cache

    def spy(lm, *, context, batch):
        filled.append(context * batch)
        return real(lm, context=context, batch=batch)

    monkeypatch.setattr(rl, "filled_cache", spy)
    monkeypatch.setattr(rl, "measure_bandwidth", lambda **kw: [rl.Probe("copy", 1e9, 1, 1.0)])
    monkeypatch.setattr(rl, "measure_peak_flops", lambda **kw: rl.Probe("matmul", 1e10, 1, 1.0))
    state = make_state(settings, tiny)
    state.speculative.roofline("builtin")
    assert filled and max(filled) == roofline_cache_tokens(SpecLimits.of(settings), tiny.max_positions)
