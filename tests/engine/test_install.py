"""The engine's venv: found where make engine-deps put it, installing again is a no-op, and the tests wait for an
install that is still running (``make test`` runs them side by side)."""

from __future__ import annotations

import subprocess
import sys

from app.engine.install import (
    DEFAULT_VENV,
    REPO_ROOT,
    install,
    install_running,
    installed,
    installing_marker,
    wait_for_install,
)


def test_the_default_venv_sits_beside_dot_venv_in_the_repo_root():
    assert DEFAULT_VENV == REPO_ROOT / ".venv-engine" and (REPO_ROOT / "pyproject.toml").is_file()


def test_installing_again_does_nothing(tmp_path, engine_venv_dir):
    assert installed(engine_venv_dir)
    assert install(engine_venv_dir, log=lambda _: None) == 0.0
    assert not installed(tmp_path / "nothing-here")
    assert not installing_marker(engine_venv_dir).exists()  # no install left its marker behind


def test_an_install_counts_as_running_while_its_process_lives(tmp_path):
    venv = tmp_path / "venv"
    assert not install_running(venv) and wait_for_install(venv, timeout_s=0)  # no marker: nothing to wait for
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        installing_marker(venv).write_text(str(child.pid))
        assert install_running(venv)
        assert not wait_for_install(venv, timeout_s=0.2, poll_s=0.05)  # still running at its deadline
    finally:
        child.kill()
        child.wait()
    assert not install_running(venv) and wait_for_install(venv, timeout_s=5)  # its process ended: a stale marker
    installing_marker(venv).write_text("not a pid")
    assert not install_running(venv)


def test_the_capture_plugin_is_installed_beside_vllm_and_registered(engine_venv_dir):
    from app.engine.install import engine_python, install_plugin, plugin_hash, plugin_marker

    assert install_plugin(engine_venv_dir, log=lambda _: None) == 0.0  # the same sources: nothing to do
    assert plugin_marker(engine_venv_dir).read_text() == plugin_hash()
    probe = ("import importlib.metadata as m\n"
             "print(sorted(e.value for g in ('vllm.general_plugins', 'vllm.endpoint_plugins')"
             " for e in m.entry_points(group=g) if e.name == 'kvscope_capture'))")
    out = subprocess.run([str(engine_python(engine_venv_dir)), "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == str(["kvscope_capture.routes:KVScopeCaptureEndpoints",
                                      "kvscope_capture.worker:register"])
