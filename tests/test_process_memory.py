"""The process's allocators (app/memory.py): MKL's scratch pools, glibc's settings, weights paged in at start."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from app.memory import _libc, _mkl, mkl_scratch_bytes, page_in, release_free_memory, tune_allocators
from app.model.capture import run_traced
from app.model.loading import load_dir
from app.settings import Settings

GLIBC_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
needs_mkl = pytest.mark.skipif(_mkl() is None, reason="this torch has no MKL")


def in_a_thread_of_its_own(fn) -> None:
    """Run ``fn`` as a server worker thread does: a thread that runs the model once and stays."""
    t = threading.Thread(target=fn)
    t.start()
    t.join()


@needs_mkl
def test_a_forward_pass_leaves_no_mkl_scratch_in_its_thread(distil):
    ids = list(range(1000, 1200))  # 200 tokens: MKL takes ~64 MB of scratch for this pass
    for _ in range(3):  # three server threads in turn, each running one capture
        in_a_thread_of_its_own(lambda: run_traced(distil.model, distil.adapter, ids, distil.token_texts(ids)))
    assert mkl_scratch_bytes() == 0


@needs_mkl
@pytest.mark.skipif("MKL_DISABLE_FAST_MM" in os.environ, reason="MKL keeps no pools at all")
def test_the_janitor_empties_pools_other_model_work_left(distil):
    import torch

    x, w = torch.randn(200, 768), torch.randn(768, 2304)
    in_a_thread_of_its_own(lambda: x @ w)  # model work outside the capture: its pool stays with the thread
    assert mkl_scratch_bytes() > 0
    release_free_memory()  # what AppState.purge calls
    assert mkl_scratch_bytes() == 0


def clean_env(monkeypatch) -> None:
    for name in GLIBC_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(_libc() is None, reason="not glibc")
def test_glibc_is_set_as_the_settings_say(monkeypatch):
    clean_env(monkeypatch)
    applied = tune_allocators(Settings(malloc_mmap_threshold_kib=128, malloc_arena_max=2))
    assert applied == {"M_MMAP_THRESHOLD": 128 * 1024, "M_ARENA_MAX": 2}


def test_what_the_operator_set_in_the_environment_wins(monkeypatch):
    clean_env(monkeypatch)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert tune_allocators(Settings()) == {}


def test_zero_leaves_glibc_as_it_was(monkeypatch):
    clean_env(monkeypatch)
    assert tune_allocators(Settings(malloc_mmap_threshold_kib=0, malloc_arena_max=0)) == {}


def test_the_allocator_module_loads_before_torch():
    """``kvscope serve`` bounds glibc's arenas before torch loads and starts its threads."""
    out = subprocess.run([sys.executable, "-c", "import sys, app.memory, app.cli; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False"


def mapped_rss(path: Path) -> tuple[int, int]:
    """(size, resident bytes) of this process's mappings of ``path``, from /proc/self/smaps."""
    size = rss = 0
    current = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
            current = len(parts) >= 6 and parts[5] == str(path)
        elif current and parts[0] == "Size:":
            size += int(parts[1]) * 1024
        elif current and parts[0] == "Rss:":
            rss += int(parts[1]) * 1024
    return size, rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc")
def test_page_in_makes_every_page_of_the_mapped_weights_resident(distil_dir):
    lm = load_dir(distil_dir, name="paged-in")  # a mapping of its own: its pages not yet touched by this process
    touched = page_in(lm.model)
    assert touched == sum(t.numel() * t.element_size() for t in {*lm.model.parameters(), *lm.model.buffers()})
    size, rss = mapped_rss((distil_dir / "model.safetensors").resolve())
    if size == 0:  # the loader copied the weights instead of mapping the file: nothing to page in
        return
    assert rss >= touched  # every page holding a weight is resident (the file's header page may be too)
