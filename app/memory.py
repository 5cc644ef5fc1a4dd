"""How the server's process gives memory back: the C allocators under torch.

Python frees a tensor the moment its last reference goes; whether its pages go back to the OS is up to the C
allocators underneath. Under a class (``bench/bench_load.py``; bench/RESULTS.md, "Memory under a class") two of
them kept what the browsers had used:

- **MKL**, torch's matrix library on x86, keeps the scratch of its matrix products in a pool per thread. Model
  work runs in whichever server thread holds the model gate (``app/admission.py``), and each keeps its pool
  (~64 MB after a 200-token DistilGPT-2 capture, the thread's OpenMP worker's included), also after the thread
  ends. ``release_mkl_scratch`` empties every pool not in use: the capture calls it after each forward pass
  (``app/model/capture.py``), the janitor after each purge, so one pool is held at a time, not one per thread.
- **glibc** serves a block of at least ``M_MMAP_THRESHOLD`` bytes from a mapping of its own and unmaps it when it
  is freed; smaller blocks come from heap arenas, which keep freed memory for later. By default the threshold
  rises to the largest block freed so far (up to 32 MiB), after which every activation of a few MB lands in an
  arena, and with many threads glibc makes up to 8 arenas per core, each keeping its own: a class left hundreds
  of MB there. ``tune_allocators`` fixes the threshold (``Settings.malloc_mmap_threshold_kib``) and bounds the
  arenas (``Settings.malloc_arena_max``); ``release_free_memory`` (after every purge) hands back the free pages
  of every arena (``malloc_trim``).

The arena bound holds only for arenas made after it is set, so ``kvscope serve`` calls ``tune_allocators`` before
torch loads or any thread starts; the server's lifespan calls it again (``AppState.prepare_memory``) for a server
started another way. A variable the operator set (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_`` or the same in
``GLIBC_TUNABLES``) wins over the settings. Without glibc, or a torch without MKL, these do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from app.settings import Settings

if TYPE_CHECKING:  # torch is not imported here: ``kvscope serve`` calls ``tune_allocators`` before it loads
    import torch

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc on Linux
        return None


def _operator_set(variable: str, tunable: str) -> bool:
    return variable in os.environ or f"glibc.malloc.{tunable}" in os.environ.get("GLIBC_TUNABLES", "")


def tune_allocators(settings: Settings) -> dict[str, int]:
    """Set glibc's mmap threshold and arena bound as ``settings`` say; returns what it set. Safe to call again."""
    applied: dict[str, int] = {}
    libc = _libc()
    if libc is None:
        return applied
    for name, param, value, variable, tunable in (
        ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, settings.malloc_mmap_threshold_kib * 1024, "MALLOC_MMAP_THRESHOLD_",
         "mmap_threshold"),
        ("M_ARENA_MAX", M_ARENA_MAX, settings.malloc_arena_max, "MALLOC_ARENA_MAX", "arena_max"),
    ):
        if value and not _operator_set(variable, tunable) and libc.mallopt(param, value) == 1:
            applied[name] = value
    return applied


def release_free_memory() -> None:
    """Hand every free MKL scratch pool and every free heap page back to the OS: RSS falls when sessions end."""
    release_mkl_scratch()
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.malloc_trim(0)


# --- MKL's scratch pools -------------------------------------------------------------------------------------

def _mkl() -> ctypes.CDLL | None:
    """The MKL service functions torch links in (x86 wheels export them from libtorch_cpu), or None."""
    torch_module = sys.modules.get("torch")
    if torch_module is None or torch_module.__file__ is None:  # no torch loaded yet: no pool to empty either
        return None
    return _mkl_of(Path(torch_module.__file__).parent / "lib" / "libtorch_cpu.so")


@lru_cache(maxsize=1)
def _mkl_of(path: Path) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
        lib.mkl_serv_mem_stat.restype = ctypes.c_int64
        lib.mkl_serv_mem_stat.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.mkl_serv_free_buffers.restype = None
    except (OSError, AttributeError):  # another platform, or a torch built without MKL
        return None
    return lib


def mkl_scratch_bytes() -> int:
    """Bytes MKL's pools hold now, in use or not (0 without MKL)."""
    lib = _mkl()
    if lib is None:
        return 0
    buffers = ctypes.c_int(0)
    return int(lib.mkl_serv_mem_stat(ctypes.byref(buffers)))


def release_mkl_scratch() -> None:
    """Empty every MKL scratch pool not in use now, whichever thread's (``mkl_free_buffers``)."""
    lib = _mkl()
    if lib is not None:
        lib.mkl_serv_free_buffers()


# --- model weights ---------------------------------------------------------------------------------------------

def page_in(model: torch.nn.Module) -> int:
    """Read one value of every 4 KiB page of the model's weights; returns the bytes touched.

    Checkpoints are memory-mapped, so their pages become resident at the first forward pass, not when the model
    loads: before this, a fresh server's RSS left out ~320 MB of DistilGPT-2 weights that its first click then
    paged in (the "1.78× after the TTL" of a long-prompt probe was that, not memory kept). Paged in at start, the
    RSS a teacher sees before class is what the server holds while it serves, and the first click does not wait
    for the disk."""
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        t.detach().reshape(-1)[:: max(1, 4096 // t.element_size())].sum()  # one element per page
        total += t.numel() * t.element_size()
    return total
