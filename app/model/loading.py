"""Loading models once, from configured sources only.

A model spec is one of:
  * ``distilgpt2``: the real DistilGPT-2 from the Hugging Face cache, or the hub when it can be
    reached. This is the default whenever its weights can be had.
  * ``builtin``: the tiny character-level model, trained on first use and cached on disk.
  * a path to a local directory holding a GPT-2-family checkpoint.

Requests can only choose among the names of models loaded at start-up; nothing a request sends is
ever passed to ``from_pretrained``. ``trust_remote_code`` is never set.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from app.model.adapter import GPT2Adapter
from app.model.builtin import ensure_builtin

log = logging.getLogger(__name__)

DISTILGPT2_ID = "distilbert/distilgpt2"
DOWNLOAD_COMMAND = "kvscope download distilgpt2"


class ModelUnavailable(RuntimeError):
    """A configured model could not be loaded; the message says why, for the page to show."""


@dataclass
class LoadedModel:
    name: str  # what the UI and the API call it
    source: str  # where the weights came from
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    adapter: GPT2Adapter
    is_builtin: bool = False
    meta: dict = field(default_factory=dict)

    @property
    def max_positions(self) -> int:
        return self.adapter.max_positions

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False).input_ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.token_text(i) for i in ids]


def load_dir(
    path: str | Path, *, name: str, source: str | None = None, local_only: bool = True, cache_dir: str | None = None
) -> LoadedModel:
    """Load a GPT-2-family checkpoint with eager attention (needed for attention weights)."""
    kw = {"local_files_only": local_only, "cache_dir": cache_dir}
    model = AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", dtype=torch.float32, **kw
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kw)
    adapter = GPT2Adapter(model)
    return LoadedModel(name=name, source=source or str(path), model=model, tokenizer=tokenizer, adapter=adapter)


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check, so an offline start doesn't sit through the hub client's retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def load_distilgpt2(cache_dir: str | None = None) -> LoadedModel:
    try:
        lm = load_dir(DISTILGPT2_ID, name="distilgpt2", source=f"{DISTILGPT2_ID} (local cache)", cache_dir=cache_dir)
    except OSError:
        if not hub_reachable():
            raise ModelUnavailable(
                "DistilGPT-2 is not in the local Hugging Face cache and the hub cannot be reached."
            ) from None
        try:
            lm = load_dir(
                DISTILGPT2_ID, name="distilgpt2", source=f"{DISTILGPT2_ID} (hub)", local_only=False, cache_dir=cache_dir
            )
        except OSError as exc:
            raise ModelUnavailable(f"DistilGPT-2 could not be downloaded: {exc}") from None
    return lm


def load_builtin(home: Path) -> LoadedModel:
    path = ensure_builtin(home)
    lm = load_dir(path, name="builtin", source=f"built-in tiny model ({path})")
    lm.is_builtin = True
    return lm


def load_spec(spec: str, home: Path, hf_cache: str | None = None) -> LoadedModel:
    if spec == "distilgpt2":
        return load_distilgpt2(hf_cache)
    if spec == "builtin":
        return load_builtin(home)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelUnavailable(f"{spec!r} is not a directory holding a model.")
    try:
        return load_dir(path, name=path.name, source=str(path))
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"{spec!r} could not be loaded as a GPT-2-family model: {exc}") from None


@dataclass
class ModelRegistry:
    """The models this server runs, loaded once at start-up."""

    models: dict[str, LoadedModel]
    default: str
    failures: dict[str, str]  # spec -> why it could not be loaded

    def get(self, name: str | None) -> LoadedModel:
        return self.models[name or self.default]

    @property
    def names(self) -> list[str]:
        return list(self.models)

    @property
    def distilgpt2_missing(self) -> bool:
        return "distilgpt2" in self.failures


def load_registry(specs: tuple[str, ...], home: Path, hf_cache: str | None = None) -> ModelRegistry:
    models: dict[str, LoadedModel] = {}
    failures: dict[str, str] = {}
    for spec in specs:
        try:
            lm = load_spec(spec, home, hf_cache)
        except ModelUnavailable as exc:
            log.warning("model %s unavailable: %s", spec, exc)
            failures[spec] = str(exc)
            continue
        models[lm.name] = lm
    if not models:
        # Never start with nothing: the built-in model needs no network.
        lm = load_builtin(home)
        models[lm.name] = lm
    return ModelRegistry(models=models, default=next(iter(models)), failures=failures)
