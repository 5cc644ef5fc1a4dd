"""The import graph has no upward arrow: every ``from app.X import`` in every module of ``app/`` (at the top of a file
or inside a function, a TYPE_CHECKING block included) points to its own layer or one below.

    cli                       the command line: starts a server or exports a trace
    web                       routes (thin: parse, call one lab function, render), middleware, pages
    state                     the composition root: builds every lab from its pieces (imports any layer below web)
    labs                      one module per lab: owner, lock, admission, budget, engine call, view
    viz                       tensors and results in, plain view data out (reads capacity's and training's results)
    capacity, training,       the capacity arithmetic and simulator; the trainer and its tensors' views; a real
    engine                    serving engine's KV events, metrics and block hashes (app/engine/)
    cache                     blocks, pools, K/V stores, the policies
    model                     loading, adapters, capture, decode
    base                      settings, errors, i18n, kv_bytes, memory, quota, admission, owned, startup, catalog

``capacity``, ``training`` and ``engine`` share a rank and may not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import app

RANKS = {"base": 0, "model": 1, "cache": 2, "capacity": 3, "training": 3, "engine": 3, "viz": 4, "labs": 5, "state": 6,
         "web": 7, "cli": 8}
PACKAGES = {"model", "cache", "capacity", "training", "engine", "viz", "labs", "web"}
TOP_MODULES = {"state": "state", "cli": "cli"}  # app/<name>.py files above the base; every other one is base
ROOT = Path(app.__file__).parent


def layer(module: str) -> str:
    """``app.cache.prefix`` -> cache; ``app.settings`` -> base."""
    parts = module.split(".")
    if len(parts) < 2:
        return "base"
    head = parts[1]
    return head if head in PACKAGES else TOP_MODULES.get(head, "base")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of an ``app`` module in the file, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("app"):
            if node.module == "app":  # from app import startup
                found += [(node.lineno, f"app.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("app.")]
    return found


def module_of(path: Path) -> str:
    parts = ("app", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        src = layer(module_of(path))
        for line, target in imports(path):
            dst = layer(target)
            if RANKS[dst] > RANKS[src] or (RANKS[dst] == RANKS[src] and dst != src):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({src}) imports {target} ({dst})")
    return bad


def test_no_module_imports_up_the_layers():
    assert upward_imports() == []


def test_every_package_has_a_rank_and_the_scan_sees_real_imports():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert packages == PACKAGES
    web_imports = [t for _, t in imports(ROOT / "web" / "deps.py")]
    assert "app.state" in web_imports and any(t.startswith("app.labs.") for t in web_imports)
    assert layer("app.labs.decode") == "labs" and layer("app.settings") == "base" and layer("app") == "base"


def test_the_scan_catches_an_upward_import(tmp_path):
    """A model module or a lab importing the state points up; training and capacity importing each other too."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from app.state import AppState\n    from app import startup\n")
    found = [t for _, t in imports(bad)]
    assert found == ["app.state", "app.startup"]
    assert RANKS[layer(found[0])] > RANKS["model"] and RANKS[layer(found[0])] > RANKS["labs"]
    assert RANKS[layer("app.training.trainer")] == RANKS[layer("app.capacity.simulator")]  # siblings: refused


# Modules of app/labs/ that are a lab's helpers, not a lab: the limits, the lines, how a run in one is shown,
# what a pin's files must hold, how a kit file's demos are run into the kit.
LAB_HELPERS = {"limits", "queue", "lines", "kit_files", "pins", "kit_demos"}
TYPED_ELSEWHERE: set[str] = set()


def lab_classes() -> dict[str, type]:
    """The labs AppState holds (its fields made in ``create``, not handed in) whose type is a class of ``app/labs/``:
    field name -> class."""
    import dataclasses
    import typing

    from app.state import AppState

    hints = typing.get_type_hints(AppState)
    made = {f.name for f in dataclasses.fields(AppState) if not f.init}
    return {name: cls for name, cls in hints.items()
            if name in made and isinstance(cls, type) and cls.__module__.startswith("app.labs.")}


def test_every_lab_is_a_typed_object_built_by_the_state_and_reached_by_one_dependency():
    """Each lab module defines a class that ``AppState`` holds (made in ``AppState.create``) and that ``deps.py``
    hands to the routes through one ``Annotated`` alias; no lab function takes the untyped state."""
    import typing

    import app.web.deps as deps
    from app.labs.limits import Limits
    from app.model.loading import ModelRegistry
    from app.settings import Settings
    from app.state import AppState

    labs = lab_classes()
    modules = {p.stem for p in (ROOT / "labs").glob("*.py")} - {"__init__"} - LAB_HELPERS - TYPED_ELSEWHERE
    assert modules <= {cls.__module__.rsplit(".", 1)[1] for cls in labs.values()}
    aliases = [typing.get_args(v)[0] for v in vars(deps).values() if typing.get_origin(v) is typing.Annotated]
    for cls in labs.values():
        assert aliases.count(cls) == 1, f"{cls.__name__}: one dependency in app/web/deps.py"
    state = AppState.create(Settings(), ModelRegistry(models={}, default="", failures={}))
    for name, cls in labs.items():
        lab = getattr(state, name)
        assert isinstance(lab, cls)
        assert not hasattr(lab, "settings"), f"{cls.__name__} holds the whole Settings: give it its Limits"
        limits = getattr(lab, "limits", None)
        assert limits is None or isinstance(limits, Limits), name
    for path in sorted((ROOT / "labs").glob("*.py")):
        if path.stem in TYPED_ELSEWHERE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = [a.arg for a in node.args.args + node.args.kwonlyargs]
                assert "state" not in args, f"{path.name}:{node.lineno} {node.name} takes the untyped state"
