"""Real model configs, written down here (the hub is not needed), and a safe reader for any config.json.

Each entry holds exactly the config.json fields the KV cache depends on, plus what the parameter count needs.
The numbers are those of the published checkpoints' config.json files; ``tests/capacity/test_catalog.py``
checks the KV bytes per token against ../shared/REFERENCE.md and the parameter counts against the published
totals. ``head_dim`` is read from the config when it has one: Qwen3-0.6B has 16 heads of 128 on a 1024-wide
model (1024 / 16 = 64 would be wrong by half).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from app.errors import BadInput
from app.kv_bytes import MLA

ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")
MAX_CONFIG_CHARS = 60_000
MAX_DIM = 1 << 20  # no real config has a dimension near a million


@dataclass(frozen=True)
class ModelConfig:
    """What the KV cache and the weights of a decoder-only model depend on."""

    key: str
    name: str
    hf_id: str
    family: str  # "gpt2", "llama" (Llama, Mistral, Qwen2, SmolLM), "qwen3", "deepseek_v2"
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

    def view(self) -> dict:
        return asdict(self) | {"attention": self.attention, "parameters": self.parameters}


def count_parameters(c: ModelConfig) -> int:
    """Weights counted from the config (dense models): embeddings, attention, MLP, norms, output layer."""
    d, L = c.hidden, c.n_layer
    if c.family == "gpt2":  # learned positions, fused QKV with biases, 4d MLP with biases, LayerNorm weight + bias
        per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * c.intermediate + c.intermediate) \
            + (c.intermediate * d + d)
        return c.vocab * d + c.max_positions * d + L * per_layer + 2 * d
    q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if c.qkv_bias else 0)
    norms = 2 * d + (2 * c.head_dim if c.family == "qwen3" else 0)  # Qwen3 adds q/k RMSNorm per head width
    per_layer = attn + 3 * d * c.intermediate + norms  # gate, up, down
    embeddings = c.vocab * d * (1 if c.tied_embeddings else 2)
    return embeddings + L * per_layer + d


CATALOG: dict[str, ModelConfig] = {m.key: m for m in (
    ModelConfig("gpt2", "GPT-2", "openai-community/gpt2", "gpt2", 12, 12, 12, 64, 768, 3072, 50257, 1024,
                tied_embeddings=True),
    ModelConfig("distilgpt2", "DistilGPT-2", "distilbert/distilgpt2", "gpt2", 6, 12, 12, 64, 768, 3072, 50257,
                1024, tied_embeddings=True),
    ModelConfig("smollm2-135m", "SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", "llama", 30, 9, 3, 64, 576, 1536,
                49152, 8192, tied_embeddings=True),
    ModelConfig("qwen2.5-0.5b", "Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", "llama", 24, 14, 2, 64, 896, 4864, 151936,
                32768, tied_embeddings=True, qkv_bias=True),
    ModelConfig("qwen2.5-7b", "Qwen2.5-7B", "Qwen/Qwen2.5-7B", "llama", 28, 28, 4, 128, 3584, 18944, 152064,
                131072, qkv_bias=True),
    ModelConfig("qwen3-0.6b", "Qwen3-0.6B", "Qwen/Qwen3-0.6B", "qwen3", 28, 16, 8, 128, 1024, 3072, 151936, 40960,
                tied_embeddings=True, note="capacity.note.qwen3"),
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


def get(key: str) -> ModelConfig:
    if key not in CATALOG:
        raise BadInput("err.capacity.unknown_model", model=key, known=", ".join(CATALOG))
    return CATALOG[key]


def _int_field(cfg: dict, *names: str, required: bool = True, default: int | None = None) -> int | None:
    for name in names:
        if name in cfg and cfg[name] is not None:
            value = cfg[name]
            if isinstance(value, str):  # "32" in quotes: transformers would keep the text and fail on it too
                raise BadInput("err.capacity.config_text", field=name, value=json.dumps(value)[:40])
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM * 1024:
                raise BadInput("err.capacity.config_field", field=name, value=json.dumps(value)[:40])
            return value
    if required and default is None:
        raise BadInput("err.capacity.config_missing", field=" / ".join(names))
    return default


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
    n_kv_head = _int_field(cfg, "num_key_value_heads", "n_kv_head", required=False, default=n_head)
    kv_lora = _int_field(cfg, "kv_lora_rank", required=False)
    rope = _int_field(cfg, "qk_rope_head_dim", required=False)
    head_dim = _int_field(cfg, "head_dim", required=False)
    if head_dim is None and kv_lora:
        head_dim = (_int_field(cfg, "qk_nope_head_dim", required=False) or 0) + (rope or 0) or hidden // n_head
    if head_dim is None:
        if hidden % n_head:
            raise BadInput("err.capacity.config_head_dim", hidden=hidden, heads=n_head)
        head_dim = hidden // n_head
    if n_kv_head > n_head or n_head % n_kv_head:
        raise BadInput("err.capacity.config_kv_heads", kv=n_kv_head, heads=n_head)
    family = "gpt2" if model_type == "gpt2" else ("qwen3" if model_type.startswith("qwen3") else
                                                   ("deepseek_v2" if kv_lora else "llama"))
    intermediate = _int_field(cfg, "intermediate_size", "n_inner", required=False) or 4 * hidden
    dense = not any(k in cfg for k in ("n_routed_experts", "num_local_experts", "num_experts"))
    return ModelConfig(
        key="config", name=str(cfg.get("_name_or_path") or name)[:80], hf_id="", family=family,
        n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, hidden=hidden,
        intermediate=intermediate,
        vocab=_int_field(cfg, "vocab_size", required=False, default=32000),
        max_positions=_int_field(cfg, "max_position_embeddings", "n_positions", "n_ctx", required=False,
                                 default=4096),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", family == "gpt2")),
        qkv_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))),
        kv_lora_rank=kv_lora, qk_rope_head_dim=rope if kv_lora else None,
        params=None if dense else 0,
        note="" if dense else "capacity.note.moe",
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
    """A model this server has loaded, through its adapter's names (n_layer, n_kv_head, head_dim ...)."""
    return ModelConfig(
        key=f"loaded:{name}", name=name, hf_id="", family=adapter.family, n_layer=adapter.n_layer,
        n_head=adapter.n_head, n_kv_head=adapter.n_kv_head, head_dim=adapter.head_dim, hidden=adapter.d_model,
        intermediate=getattr(adapter, "d_mlp", 4 * adapter.d_model), vocab=adapter.vocab_size,
        max_positions=adapter.max_positions, params=adapter.parameter_count(),
    )
