"""A served request as a trace Inspect reads (app/engine/served_trace.py): the engine's q and k put into KVScope's own
trace of the same ids. Built here from KVScope's own q and k cut as the plugin cuts them (tests/engine/
test_capture.py's pieces come from the same cut), so the served trace must equal the own one, and a served head
that differs must show up in that head's weights and nowhere else."""

from __future__ import annotations

import pytest
import torch

from app.engine.capture import ServedAttention
from app.engine.served_trace import served_trace
from app.errors import BadInput
from app.model.capture import run_traced


@pytest.fixture(scope="module")
def own(llama):
    ids = list(range(20, 40))
    return run_traced(llama.model, llama.adapter, ids, [str(i) for i in ids], keep_cache=False)


def as_served(trace, computed_from=0) -> ServedAttention:
    a = trace.adapter
    kv_map = torch.as_tensor(a.kv_map)
    q = {i: trace.q(i)[0, :, computed_from:].float().clone() for i in range(a.n_layer)}
    k = {i: trace.keys(i)[0][kv_map].float().clone() for i in range(a.n_layer)}
    return ServedAttention("cmpl-x-0-1", "x", list(trace.token_ids), computed_from, q, k, [], 32, 1, 1,
                           trace.q(0).shape[-1])


def test_the_served_trace_of_the_own_q_and_k_is_the_own_trace(own):
    got = served_trace(own, as_served(own, computed_from=4))
    # fp32 softmax rows of ≤ 20 keys recomputed from the same q and k: equal to rounding
    assert max(got.meta["served"]["max_diff"]) <= 1e-6 and got.meta["served"]["computed_from"] == 4
    for layer in range(own.adapter.n_layer):
        assert torch.allclose(got.weights(layer), own.weights(layer), atol=1e-6)
        assert torch.allclose(got.lse(layer), own.lse(layer), atol=1e-5)


def test_a_served_head_that_differs_changes_that_head_only(own):
    served = as_served(own)
    served.q[0][1] = served.q[0][1].flip(0)  # head 1 of layer 0: its rows reversed
    got = served_trace(own, served)
    diff = (got.weights(0) - own.weights(0)).abs().amax(dim=(0, 2, 3))
    assert diff[1] > 1e-3 and float(diff[torch.arange(len(diff)) != 1].max()) == 0.0
    assert got.meta["served"]["max_diff"][0] > 1e-3 and own.meta.get("served") is None


def test_other_tokens_are_refused(own):
    served = as_served(own)
    served.token_ids = served.token_ids[::-1]
    with pytest.raises(BadInput):
        served_trace(own, served)


def test_inspect_shades_the_keys_a_served_request_read_from_cached_blocks(own, llama):
    """The view names where the request's own rows start (the cached blocks' end): the heatmap shades the columns
    before it; a request without a hit, and any trace not served, shade nothing."""
    from app.viz.inspect import inspect_view

    assert inspect_view(llama, "k", served_trace(own, as_served(own, computed_from=4)))["cached_keys"] == 4
    assert inspect_view(llama, "k", served_trace(own, as_served(own)))["cached_keys"] is None
    assert inspect_view(llama, "k", own)["cached_keys"] is None
