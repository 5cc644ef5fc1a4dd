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
    base                      settings, errors, i18n, kv_bytes, memory, admission, owned, startup, catalog

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
