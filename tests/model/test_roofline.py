"""The roofline: probes give finite positive numbers, a step's point comes from the shapes, a step is timed."""

from __future__ import annotations

import math

from app.model import roofline as rl


def test_bandwidth_and_flop_probes_return_finite_positive_numbers():
    probes = [*rl.measure_bandwidth(mib=8, repeats=2), rl.measure_peak_flops(n=256, repeats=2)]
    assert [p.name for p in probes] == ["copy", "triad", "matmul"]
    for p in probes:
        assert math.isfinite(p.value) and p.value > 0 and p.seconds > 0
    copy, triad, matmul = probes
    assert math.isclose(copy.value * copy.seconds, 2 * copy.size)  # bytes moved: 2 arrays of ``size`` bytes
    assert math.isclose(triad.value * triad.seconds, 3 * triad.size)
    assert math.isclose(matmul.value * matmul.seconds, 2 * 256**3)


def test_a_decode_steps_point_is_counted_from_the_shapes(llama):
    """Counted again by hand from the config: every parameter once (tied embeddings once), the KV cache of each
    sequence at that length (2 · layers · KV heads · head_dim · 4 bytes per token), 2 FLOPs per multiplied weight
    per token plus 4 · layers · heads · head_dim per key attended to."""
    cfg = llama.model.config
    L, H, Hkv, Dh = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, llama.adapter.head_dim
    params = {p.data_ptr(): p for p in llama.model.parameters()}
    weights = sum(p.numel() for p in params.values())
    tied = llama.model.get_output_embeddings().weight.data_ptr() == llama.model.get_input_embeddings().weight.data_ptr()
    if not tied:  # a forward reads only the rows of the input table it looks up
        weights -= llama.model.get_input_embeddings().weight.numel()
    kv_per_token = 2 * L * Hkv * Dh * 4
    for context, batch in [(10, 1), (100, 4)]:
        c = rl.step_cost(llama, context=context, batch=batch)
        assert c.weight_bytes == 4 * weights
        assert c.kv_read_bytes == batch * context * kv_per_token and c.kv_write_bytes == batch * kv_per_token
        assert c.flops == batch * (2 * weights + 4 * L * H * Dh * (context + 1))
        assert c.intensity == c.flops / (c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes)
    # Batching shares the weights: intensity grows with batch; fewer KV heads read fewer bytes at long context.
    assert rl.step_cost(llama, context=100, batch=8).intensity > rl.step_cost(llama, context=100).intensity
    assert (rl.step_cost(llama, context=100, batch=8, n_kv_head=1).intensity
            > rl.step_cost(llama, context=100, batch=8, n_kv_head=H).intensity)


def test_a_prefill_counts_the_causal_triangle(tiny):
    c = rl.step_cost(tiny, context=0, new_tokens=5, phase="prefill")
    a = tiny.adapter
    _, count = rl.weight_bytes(tiny)
    assert c.flops == 2 * count * 5 + 4 * a.n_layer * a.n_head * a.head_dim * (1 + 2 + 3 + 4 + 5)
    assert c.intensity > rl.step_cost(tiny, context=0).intensity


def test_a_timed_step_reads_a_cache_of_the_stated_length(llama):
    cache = rl.filled_cache(llama, context=7, batch=3)
    assert cache.get_seq_length() == 7 and cache.layers[0].keys.shape == (3, llama.adapter.n_kv_head, 7,
                                                                          llama.adapter.head_dim)
    points = rl.measure_points(llama, contexts=[8], batches=[1, 2], prefill_tokens=4, repeats=1)
    assert [(p.cost.phase, p.cost.batch, p.cost.context) for p in points] == [
        ("decode", 1, 8), ("decode", 2, 8), ("prefill", 1, 0)]
    for p in points:
        assert p.seconds > 0 and math.isfinite(p.flops_per_s) and p.bytes_per_s > 0
