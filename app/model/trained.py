"""Models trained in the Training lab: each one a new name, saved under the home, offered again after a restart.

A finished run never replaces a model: it is added next to the others as ``builtin-trained-<n>`` (n one
more than any name used before, on disk or in the registry), so traces, decode sessions and lab caches
other users hold on ``builtin`` (or on an earlier trained model) keep working. On disk::

    <KVSCOPE_HOME>/trained/builtin-trained-1/   model.safetensors, tokenizer.json, kvscope.json, ...
                           builtin-trained-2/

At start-up the newest ``keep`` of them are loaded into the registry; when a run adds one beyond
``keep``, the oldest is dropped from the registry and its folder deleted (``Settings.max_trained_models``).
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from app.model.loading import LoadedModel, ModelRegistry, load_dir

log = logging.getLogger(__name__)

PREFIX = "builtin-trained-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)$")


def trained_root(home: Path) -> Path:
    return Path(home) / "trained"


def trained_index(name: str) -> int | None:
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def saved_trained_dirs(home: Path) -> list[Path]:
    """Complete saved models, oldest first (a folder is complete once ``kvscope.json`` is written)."""
    root = trained_root(home)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and trained_index(d.name) is not None
            and (d / "model.safetensors").exists() and (d / "kvscope.json").exists()]
    return sorted(dirs, key=lambda d: trained_index(d.name) or 0)


def next_trained_name(home: Path, taken: list[str]) -> str:
    """One more than the highest index ever seen, so a name never comes back with other weights."""
    used = [trained_index(n) for n in taken] + [trained_index(d.name) for d in trained_root(home).glob(f"{PREFIX}*")]
    return f"{PREFIX}{max([i for i in used if i is not None], default=0) + 1}"


def load_trained(path: Path, *, source: str | None = None) -> LoadedModel:
    lm = load_dir(path, name=path.name, source=source or f"trained in the Training lab ({path})")
    lm.is_builtin = True  # the built-in recipe: a character-level tiny GPT-2
    return lm


def load_saved_trained(registry: ModelRegistry, home: Path, *, keep: int) -> list[str]:
    """Add the newest ``keep`` saved trained models to ``registry`` (at start-up); returns their names.

    A folder that fails to load is logged and skipped: it never stops the server from starting."""
    added = []
    for path in saved_trained_dirs(home)[-keep:] if keep > 0 else []:
        if path.name in registry.models:
            continue
        try:
            registry.models[path.name] = load_trained(path)
        except (OSError, ValueError) as exc:
            log.warning("saved trained model %s could not be loaded: %s", path, exc)
            continue
        added.append(path.name)
    return added


def prune_trained(registry: ModelRegistry, home: Path, *, keep: int) -> list[str]:
    """Drop the oldest trained models beyond ``keep``, from the registry and from disk; returns their names.

    The caller holds the lock that guards the registry. Sessions already holding a dropped model keep
    their own reference and finish normally; new requests naming it get "unknown model"."""
    names = {*(n for n in registry.models if trained_index(n) is not None),
             *(d.name for d in saved_trained_dirs(home))}
    ordered = sorted(names, key=lambda n: trained_index(n) or 0)
    dropped = ordered[: max(0, len(ordered) - keep)]
    for name in dropped:
        if name != registry.default:
            registry.models.pop(name, None)
        shutil.rmtree(trained_root(home) / name, ignore_errors=True)
    return dropped
