"""The engine's venv: found where make engine-deps put it, and installing again is a no-op."""

from __future__ import annotations

from app.engine.install import DEFAULT_VENV, REPO_ROOT, install, installed
from tests.conftest import engine_venv


def test_the_default_venv_sits_beside_dot_venv_in_the_repo_root():
    assert DEFAULT_VENV == REPO_ROOT / ".venv-engine" and (REPO_ROOT / "pyproject.toml").is_file()


def test_installing_again_does_nothing(tmp_path):
    venv = engine_venv()
    assert installed(venv)
    assert install(venv, log=lambda _: None) == 0.0
    assert not installed(tmp_path / "nothing-here")
