"""Quantized K/V: round trips within their error bounds, bytes per token derived by hand, window = band mask."""

from __future__ import annotations

import pytest
import torch

from app.cache.paged_decode import FloatKVStore, forward_through
from app.cache.quant import FORMATS, QuantizedKVStore, QuantizedStream, dequantize, pack_int4, quantize, unpack_int4
from app.cache.window import WindowKVStore


def sample(h: int = 3, t: int = 10, d: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h, t, d, generator=g) * torch.linspace(0.1, 5, t).view(1, t, 1)


def test_int4_packs_two_values_per_byte_and_unpacks_exactly():
    q = torch.arange(-8, 8, dtype=torch.int8).view(1, 1, 16)
    packed = pack_int4(q)
    assert packed.shape == (1, 1, 8) and packed.dtype == torch.uint8
    assert packed[0, 0, 0].item() == (0 + 8) * 0 + ((-8 + 8) | ((-7 + 8) << 4))  # low nibble first
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("fmt,qmax", [("int8-head", 127), ("int4-head", 7)])
def test_integer_formats_round_to_within_half_a_step(fmt, qmax):
    x = sample()
    q, s = quantize(x, fmt)
    assert torch.allclose(s[..., 0], x.abs().amax(-1) / qmax)  # one scale per (head, token)
    err = (dequantize(q, s, fmt) - x).abs()
    assert bool((err <= s / 2 + 1e-6).all())


def test_fp8_e4m3_keeps_three_mantissa_bits():
    x = sample()
    q, s = quantize(x, "fp8-e4m3")
    assert q.dtype == torch.float8_e4m3fn
    err = (dequantize(q, s, "fp8-e4m3") - x).abs()
    # relative rounding error of a 3-bit mantissa is at most 2^-4; tiny values fall into subnormals (step 2^-9 · s)
    assert bool((err <= x.abs() * 2**-4 + s * 2**-9 + 1e-7).all())


def test_per_block_scales_grow_and_requantize_the_block():
    x = sample(t=11)
    stream = QuantizedStream("int8-block", block_size=4)
    for t in range(11):
        stream.append(x[:, t : t + 1])
    assert stream.scales.shape == (3, 3, 1)  # 3 blocks of 4 tokens (the last one holds 3)
    for b in range(3):
        block = x[:, 4 * b : 4 * b + 4]
        assert torch.allclose(stream.scales[:, b, 0], block.abs().amax(dim=(1, 2)) / 127)
    per_token = stream.scales.repeat_interleave(4, dim=1)[:, :11]
    err = (stream.read() - x).abs()
    # each time its block's scale grows, a token is rounded again (≤ half a step each time, ≤ 4 times here)
    assert bool((err <= 4 * per_token / 2 + 1e-6).all())
    assert float((err / per_token).mean()) < 0.5


def test_bytes_per_token_including_scales():
    shape = {"n_layer": 6, "n_kv_head": 12, "head_dim": 64}
    assert FORMATS["int8-head"].bytes_per_token(**shape) == 2 * 6 * 12 * (64 + 4) == 9792
    assert FORMATS["fp8-e4m3"].bytes_per_token(**shape) == 9792
    assert FORMATS["int4-head"].bytes_per_token(**shape) == 2 * 6 * 12 * (32 + 4) == 5184
    assert FORMATS["int8-block"].bytes_per_token(**shape, block_size=16) == 2 * 6 * 12 * (64 + 4 / 16)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bytes_held_match_bytes_per_token(tiny, fmt):
    a = tiny.adapter
    store = QuantizedKVStore(fmt, n_layer=a.n_layer, block_size=4)
    forward_through(tiny, store, tiny.encode("the cat sat on"))  # 14 characters
    forward_through(tiny, store, tiny.encode("!!"[:1]))
    forward_through(tiny, store, tiny.encode("!"))  # 16 tokens: 4 whole blocks
    per_token = FORMATS[fmt].bytes_per_token(n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim,
                                             block_size=4)
    assert store.length == 16 and store.nbytes == per_token * 16


def test_window_buffer_equals_a_band_mask_over_the_full_cache(tiny):
    """The cyclic buffer keeps W slots; its logits equal full K/V read through a banded causal mask."""
    a = tiny.adapter
    ids = tiny.encode("the cat sat on the mat, then")
    window = WindowKVStore(5, n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim)
    band = FloatKVStore(a.n_layer)
    band.window = 5
    assert torch.allclose(forward_through(tiny, window, ids[:9]), forward_through(tiny, band, ids[:9]), atol=1e-5)
    for t in ids[9:]:
        assert torch.allclose(forward_through(tiny, window, [t]), forward_through(tiny, band, [t]), atol=1e-5)
    assert window.k.shape[2] == 5  # memory stays at W slots
    assert sorted(window.slot_pos[0].tolist()) == list(range(len(ids) - 5, len(ids)))
