"""Server configuration: every limit the app enforces lives here, read once from the environment.

Environment variables use the ``KVSCOPE_`` prefix (``KVSCOPE_MODELS=distilgpt2,builtin``). Tests build
their own ``Settings`` and hand it to ``create_app``; nothing else reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path


def _default_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvscope"


@dataclass(frozen=True)
class Settings:
    # Which models the server may load, in order of preference. Each entry is "distilgpt2",
    # "builtin", or a local directory holding a GPT-2-family checkpoint. Requests can only pick
    # among these names; they can never make the server load anything else.
    models: tuple[str, ...] = ("distilgpt2", "builtin")
    # Where the built-in tiny model is trained to and cached.
    home: Path = field(default_factory=_default_home)
    # Hugging Face cache directory (None: the library's default, ~/.cache/huggingface).
    hf_cache: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # Input limits.
    max_prompt_chars: int = 20_000
    max_body_bytes: int = 64 * 1024
    # Memory for captured traces kept while a user clicks around (least recently used evicted first).
    trace_cache_bytes: int = 2 * 1024**3
    # Decode sessions.
    session_ttl_s: float = 900.0
    max_sessions: int = 16
    session_cache_bytes: int = 1024**3
    max_decode_steps: int = 256
    # Models trained in the Training lab kept on disk (under home/trained) and offered after a restart;
    # a run beyond this drops the oldest.
    max_trained_models: int = 3
    # Largest trace a download (.npz / .safetensors) may pack, in bytes of tensor data.
    max_export_bytes: int = 512 * 1024**2
    # Torch threads for the model (0 = torch's default).
    torch_threads: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(f"KVSCOPE_{f.name.upper()}")
            if raw is None:
                continue
            if f.name == "models":
                values[f.name] = tuple(m.strip() for m in raw.split(",") if m.strip())
            elif f.name == "home":
                values[f.name] = Path(raw)
            elif f.type in ("int", int):
                values[f.name] = int(raw)
            elif f.type in ("float", float):
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        return cls(**values)  # type: ignore[arg-type]

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]


@lru_cache
def get_settings() -> Settings:
    return Settings.from_env()
