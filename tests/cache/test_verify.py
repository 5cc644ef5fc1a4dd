"""The verification bench: its reference is greedy decoding, and every number it reports can be re-derived."""

from __future__ import annotations

import torch

from app.cache.quant import FORMATS
from app.cache.verify import run_bench


def test_bench_on_the_tiny_model(tiny):
    ids = tiny.encode("the cat sat on the")
    steps = 12
    r = run_bench(tiny, ids, steps=steps, block_size=4, window=6)
    assert r["paths"] == ["full", "contiguous", "paged", *FORMATS, "window-6"]
    assert len(r["rows"]) == steps  # one row per generated token: step 0 is the prefill's prediction
    assert [row["step"] for row in r["rows"]] == list(range(steps))

    # The reference tokens are plain greedy decoding (derived a second way: transformers' generate).
    out = tiny.model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                              pad_token_id=tiny.tokenizer.eos_token_id)
    assert r["tokens"] == out[0].tolist()

    # Exact paths: within 1e-4 of full recompute at every step, never diverging.
    for name in ("full", "contiguous", "paged"):
        assert r["max_abs_diff"][name] <= 1e-4, name
        assert r["first_divergence"][name] is None
    # The first divergent step is the first row whose token differs; the worst error is the row maximum.
    for name in r["paths"]:
        firsts = [row["step"] for row in r["rows"] if row["cells"][name]["token"] != row["token"]]
        assert r["first_divergence"][name] == (firsts[0] if firsts else None)
        assert r["max_abs_diff"][name] == max(row["cells"][name]["max_abs_diff"] for row in r["rows"])
    # The window drops history once the sequence is longer than W: it must differ from full attention.
    assert r["max_abs_diff"]["window-6"] > 1e-3
    # Bytes per token: 2 · layers · heads · head_dim · 4 bytes for the float paths.
    a = tiny.adapter
    assert r["bytes_per_token"]["paged"] == 2 * a.n_layer * a.n_kv_head * a.head_dim * 4
    # The paged path held exactly the blocks the sequence needed: the prompt and every generated token but the
    # last (nothing has read it yet), in blocks of 4.
    assert r["bytes_held"]["paged"] == -(-(len(ids) + steps - 1) // 4) * 4 * 2 * a.n_layer * a.d_model * 4


def test_a_window_as_long_as_the_sequence_is_exact(tiny):
    ids = tiny.encode("hello there")
    r = run_bench(tiny, ids, steps=5, block_size=4, window=len(ids) + 6)
    assert r["max_abs_diff"][f"window-{len(ids) + 6}"] <= 1e-4


def test_paged_and_contiguous_match_full_recompute_on_distilgpt2_shape(distil):
    r = run_bench(distil, distil.encode("The cat sat on"), steps=2, block_size=2, window=3)
    for name in ("contiguous", "paged"):
        assert r["max_abs_diff"][name] <= 1e-4
    assert r["rows"][0]["position"] == 3
