"""Every hook point's shape comment in the adapters (``hook_points``: ``# [batch, pos, d_model]``, TransformerLens's
axis names) is the shape a forward really records, on every family KVScope reads."""

from __future__ import annotations

import inspect
import re

import torch

from app.model.capture import capture, lse_attention

POINT = re.compile(r'HookPoint\(f?"(?:\{b\}\.)?([\w.]+)"')
SHAPE = re.compile(r"#\s*(\[[^\]]*\])(?:[^;]*;[^\[]*(\[[^\]]*\]))?")


def declared_shapes(adapter) -> dict[str, tuple[str, str | None]]:
    """name -> (its shape comment, the q/k-norm alternative after a ``;`` where there is one), read from the source
    of the adapter's ``hook_points``: the comment beside the ``HookPoint`` or on the line above it."""
    lines = inspect.getsource(type(adapter).hook_points).splitlines()
    out = {}
    for i, line in enumerate(lines):
        if m := POINT.search(line):
            comment = line if "#" in line else lines[i - 1]
            s = SHAPE.search(comment)
            assert s is not None, f"{type(adapter).__name__}: no shape beside {m.group(1)}"
            out[m.group(1)] = (s.group(1), s.group(2))
    return out


def expected(shape: str, adapter, batch: int, pos: int) -> tuple[int, ...]:
    axes = {"batch": batch, "pos": pos, "head": adapter.n_head, "head_kv": adapter.n_kv_head,
            "d_head": adapter.head_dim, "d_model": adapter.d_model, "d_mlp": adapter.d_mlp,
            "d_vocab": adapter.vocab_size}
    return tuple(eval(axis, {}, axes) for axis in shape.strip("[]").split(","))  # noqa: S307 (our own comments)


def test_each_hook_points_shape_comment_is_what_a_forward_records(any_model):
    adapter = any_model.adapter
    declared = declared_shapes(adapter)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with capture(adapter) as rec, lse_attention(any_model.model), torch.no_grad():
        any_model.model(ids)
    assert rec.tensors
    for name, tensor in rec.tensors.items():
        short = name.split(".", 2)[2] if name.startswith("blocks.") else name
        shape, normed = declared[short]
        if normed is not None and getattr(adapter, "qk_norm", False):
            shape = normed
        assert tuple(tensor.shape) == expected(shape, adapter, 1, 5), (name, shape)
