"""How close two runs of the same fp32 computation must be when they need not be bit-equal.

Exact equality holds by construction only for the same ops on the same shapes in the same thread. A forward in a
worker thread and the same forward on the main thread may split a BLAS reduction differently: MKL's and
OpenMP's thread counts are per-thread settings, so the worker may run a matmul on another number of threads and
add its partial sums in another order. Each reordered sum of n terms moves the result by at most ~n·eps of the sum
of the terms' magnitudes; in these models' activations (d_model ≤ 768, a few layers, LayerNorm renormalising each
layer) that stays below a few hundred eps of the largest value of a tensor. ``THREAD_REL`` is 2 000 eps32
(≈ 2.4e-4 × max|x|): far above that reordering noise, far below any real difference the tests look for (a hook
leaking into another run changes a tensor by O(max|x|), a wrong head or position by O(1) in attention weights).
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps
THREAD_REL = 2_000 * EPS32


def thread_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape, and equal up to reordered fp32 sums (``THREAD_REL`` of the larger magnitude of ``want``)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not want.is_floating_point():
        return torch.equal(got, want)
    scale = float(want.abs().max()) if want.numel() else 0.0
    return bool((got - want).abs().max() <= THREAD_REL * max(scale, 1.0)) if want.numel() else True
