"""Fixtures for the Training lab: an app state serving only the built-in model, and a lab writing to a temp dir."""

from __future__ import annotations

import time

import pytest

from app.labs.train import TrainingLab, TrainLimits
from app.model.loading import ModelRegistry
from app.settings import Settings
from app.state import AppState


@pytest.fixture
def lab_state(tiny, tmp_path) -> AppState:
    registry = ModelRegistry(models={"builtin": tiny}, default="builtin", failures={})
    return AppState.create(Settings(models=("builtin",), home=tmp_path, allowed_hosts=("testserver",)), registry)


@pytest.fixture
def lab(lab_state, tmp_path):
    lab = TrainingLab(registry=lab_state.registry, limits=TrainLimits.of(lab_state.settings), home=tmp_path,
                      line=lab_state.lab_queue("train", max_run_s=lab_state.settings.train_max_s))
    yield lab
    stop_and_wait(lab)


def stop_and_wait(lab: TrainingLab) -> None:
    """Every run of the lab stops (waiting ones leave the line), then wait until none trains."""
    lab.line.close()
    assert lab.wait(timeout=120), "a training run did not stop"


def wait_for_steps(lab: TrainingLab, n: int, timeout: float = 120) -> None:
    """Poll until the running job has taken ``n`` steps (no assertion on how long that takes)."""
    deadline = time.monotonic() + timeout
    while lab.job is None or (lab.job.next_step < n and lab.job.status in ("queued", "running")):
        assert time.monotonic() < deadline, "training made no progress"
        time.sleep(0.01)
