"""A plain next-token trainer for causal language models.

It knows nothing about GPT-2: it takes a model whose forward accepts ``input_ids`` and returns
``.logits``, a 1-D tensor of token ids, and a config. Inputs and targets come from the same window
shifted by one position: the causal rule that inference uses too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 301
    lr: float = 3e-3
    batch_size: int = 16
    block_size: int = 64
    seed: int = 0
    weight_decay: float = 0.01
    # 0: constant lr. Otherwise the original Transformer's schedule: linear warm-up over ``warmup`` steps,
    # then lr·√(warmup/step). It depends only on the step number, so a resumed run sees the same rates.
    warmup: int = 0


def lr_at(config: TrainConfig, step: int) -> float:
    """The learning rate of step ``step`` (0-based)."""
    if config.warmup <= 0:
        return config.lr
    n = step + 1
    return config.lr * min(n / config.warmup, (config.warmup / n) ** 0.5)


@dataclass(frozen=True)
class StepInfo:
    step: int
    loss: float


def batch_windows(data: torch.Tensor, *, batch_size: int, block_size: int, generator: torch.Generator):
    """Random windows of ``block_size + 1`` tokens: inputs are the first T, targets the last T."""
    block = min(block_size, data.numel() - 1)
    starts = torch.randint(0, data.numel() - block, (batch_size,), generator=generator)
    windows = torch.stack([data[s : s + block + 1] for s in starts.tolist()])  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]  # (B, T), (B, T)


def next_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=inputs).logits  # (B, T, V)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def train(
    model: nn.Module,
    data: torch.Tensor,
    config: TrainConfig,
    *,
    on_step: Callable[[StepInfo, nn.Module, torch.optim.Optimizer], None] | None = None,
    stop: threading.Event | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    start_step: int = 0,
    lock: AbstractContextManager | None = None,
    piece: Callable[[], AbstractContextManager] | None = None,
) -> list[StepInfo]:
    """Train ``model`` in place and return the loss of every step taken.

    Each step: forward -> loss -> ``backward()`` writes every parameter's ``.grad`` -> AdamW reads
    the grads and updates the weights (its m and v state appear at the first ``step()``).
    ``stop`` ends the loop between steps; the caller decides what to keep.

    Resuming (``start_step`` > 0, with the same ``optimizer``) first replays the random draws of the
    steps already taken, so a run stopped and resumed sees exactly the batches of an uninterrupted run.
    ``lock``, if given, is held for the whole of each step, so another thread holding it sees weights,
    grads and optimizer state that belong together.

    ``piece`` splits a step into three shorter holds of something else (the Training lab's: the server's model
    gate, so other browsers' requests run in between): ``piece()`` is entered around the forward, the backward
    and the optimizer update, each on its own. The arithmetic is exactly that of one hold (the same operations
    on the same tensors, in the same order), so the losses are the article's to the last bit.
    """
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    for _ in range(start_step):
        batch_windows(data, batch_size=config.batch_size, block_size=config.block_size, generator=generator)
    step_lock = lock if lock is not None else contextlib.nullcontext()
    model.train()
    history: list[StepInfo] = []
    try:
        for step in range(start_step, config.steps):
            if stop is not None and stop.is_set():
                break
            inputs, targets = batch_windows(
                data, batch_size=config.batch_size, block_size=config.block_size, generator=generator
            )
            with step_lock:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(config, step)
                hold = piece if piece is not None else contextlib.nullcontext
                with hold():
                    loss = next_token_loss(model, inputs, targets)
                with hold():
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                with hold():
                    optimizer.step()
            info = StepInfo(step=step, loss=float(loss.detach()))
            history.append(info)
            if on_step is not None:
                on_step(info, model, optimizer)
    finally:
        model.eval()
    return history
