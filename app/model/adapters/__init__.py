"""Model families. Each module here defines one ``ModelAdapter`` subclass; this package finds them all.

Adding a family means adding a module (see README, "Adding a model family"): loading picks the adapter
whose ``model_types`` contains the checkpoint's ``config.model_type``.
"""

from __future__ import annotations

import importlib
import pkgutil

from transformers import PreTrainedModel

from app.model.adapters.base import HookPoint, ModelAdapter, for_this_thread

__all__ = ["HookPoint", "ModelAdapter", "for_this_thread", "adapter_for", "adapter_class", "supported_model_types"]


def _families() -> list[type[ModelAdapter]]:
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")
    return [cls for cls in _subclasses(ModelAdapter) if getattr(cls, "model_types", None)]


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    subs: list[type] = cls.__subclasses__()
    for sub in subs:
        out += [sub, *_subclasses(sub)]
    return out


def supported_model_types() -> list[str]:
    return sorted({t for cls in _families() for t in cls.model_types})


def adapter_class(model_type: str | None) -> type[ModelAdapter] | None:
    for cls in _families():
        if model_type in cls.model_types:
            return cls
    return None


def adapter_for(model: PreTrainedModel) -> ModelAdapter:
    cls = adapter_class(getattr(model.config, "model_type", None))
    if cls is None:
        raise ValueError(f"unsupported model type {model.config.model_type!r}; "
                         f"supported: {', '.join(supported_model_types())}")
    return cls(model)
