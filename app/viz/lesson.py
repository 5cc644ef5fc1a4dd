"""The guided lesson: the reference article's story on "The cat sat on", told on the live pages.

``STOPS`` is the whole lesson as data, in order. Each stop names the page it lives on, the element it
highlights (a CSS selector on that page), its catalog keys (``lesson.<id>.title`` / ``.body``, plus optional
sentences that apply to some models only, see ``EXTRAS``) and an optional action: the page's own controls
driven in order (click a button, fill the prompt, choose a radio), so every number the learner reads is the
page's own. ``static/lesson.js`` interprets the actions; nothing else in the lesson is code.

An action is a list of steps ``{"do": click | fill | check | choose | wait, "sel": CSS, ...}``:

- ``value``   what ``fill`` types or ``choose`` selects;
- ``if``      the step runs only while this selector matches (a Reset button that exists only sometimes);
- ``unless``  the step is skipped while this selector matches (the state is already there);
- ``once``    the step runs at most once per page load (a decode step is taken once, not again on Back);
- ``wait``    after the step, wait until this selector matches (the answer has been drawn);
- ``changes`` ``[selector, attribute]``: after the step, wait until that attribute differs from before it;
- ``ms``      how long those waits may take (default a minute; a run in a lab's line may take several).

``uncheck`` clears every checkbox ``sel`` matches (the arena's policies but two). A stop on a page whose address
is made by a run (the zoom page of a long capture: ``/zoom/<trace key>``) names the page it is reached ``via`` and
the steps there that open it (``via_action``: fill the long-prompt form, press its button); the page that opens
keeps the lesson's step in its address (``kv.visit``). ``when`` adds sentences that apply to what the page shows:
key suffix → a selector, the sentence shown only while it matches (the engine page: one connected, or none).

Placeholders in a stop's text: the model's facts (``{layers}``, ``{heads}``, ``{kv_heads}``, ``{d}``,
``{head_dim}``, ``{group}``, ``{vocab}``, ``{model}``) and the lesson's prompts (``{prompt}``, ``{first}``,
``{second}``) are filled on the server; the names in a stop's ``fill`` are filled in the browser with the text
of an element on the page (the greedy pick as the page shows it, say).
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlencode

import torch

from app.viz.head_roles import STRONG

PROMPT = "The cat sat on"
PREFIX_PROMPTS = ("The cat sat on the mat.", "The cat sat on the sofa.")
PREFIX_SEPARATOR = "---"  # the prefix form's separator line between custom prompts

# The long-context stop's prompt: the first LONG_TOKENS tokens of the built-in long text (or the model's window,
# if shorter). Long enough for the sink to stand out over a thousand keys, short enough that its capture takes
# seconds on a CPU (the whole 8 192-token text takes minutes with its grid of heads).
LONG_TOKENS = 1024
LONG_PROMPT = "{long_prompt}"  # an action value the server replaces with that text, cut for the model

# Each page's path; a path ending in "/" is a family of pages (the zoom page of each long capture).
PAGES = {"inspect": "/", "decode": "/decode", "prefix": "/prefix", "paged": "/paged", "capacity": "/capacity",
         "zoom": "/zoom/", "arena": "/arena", "heads": "/heads", "speculative": "/speculative", "engine": "/engine",
         "served": "/served/"}
PROMPT_PAGES = ("inspect", "decode")  # pages that take ?prompt=
ARENA_PAIR = ("window", "streaming")  # the compression stop's two policies: a plain window, StreamingLLM
ARENA_STEPS = 8
RUN_MS = 300_000  # a run the lesson starts (the arena, the drafts' comparison, a grid of heads) on a busy CPU
SPEC_TOKENS = 32  # the comparison's new tokens: enough to copy the preset's sentence, a third less than its 48
# The speculative stop's prompt where the copy preset is longer than the model reads (the built-in model's 128
# positions): the lesson's sentence, repeated, which prompt lookup can copy from too.
COPY_PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on"

_KIND = "input[name=kind][value={k}]"


def _kind(kind: str) -> list[dict]:
    """Show the head's matrix as ``kind`` (weights, masked, scores) with the page's own radio button."""
    return [{"do": "check", "sel": _KIND.format(k=kind), "unless": _KIND.format(k=kind) + ":checked",
             "changes": ["body", "data-heatmap-drawn"]}]


STOPS: tuple[dict, ...] = (
    # --- Inspect: one forward pass, read panel by panel -------------------------------------------------
    {"id": "tokens", "page": "inspect", "target": "#tokens-panel", "action": [
        {"do": "fill", "sel": "#prompt", "value": PROMPT, "unless": "#inspect-view"},
        {"do": "click", "sel": "#run", "unless": "#inspect-view", "wait": "#inspect-view"},
    ]},
    {"id": "embed", "page": "inspect", "target": "#embed-panel"},
    {"id": "qkv", "page": "inspect", "target": "#shape-panel details[data-group=layer0]"},
    {"id": "scores", "page": "inspect", "target": "#head-panel", "action": _kind("scores"),
     "fill": {"layer": "#sel-layer option:checked", "head": "#sel-head option:checked"}},
    {"id": "mask", "page": "inspect", "target": "#head-panel", "action": _kind("masked")},
    {"id": "softmax", "page": "inspect", "target": "#head-panel", "action": _kind("weights")},
    {"id": "weighted", "page": "inspect", "target": "#math-panel", "fill": {"check": "#math-check"}},
    {"id": "next", "page": "inspect", "target": "#topk-panel",
     "fill": {"pick": "#topk-table tr.pick code", "prob": "#topk-table tr.pick td:nth-child(4)"}},
    # --- Decode: prefill once, then one token at a time through the cache --------------------------------
    {"id": "prefill", "page": "decode", "target": "#cache-panel", "action": [
        {"do": "fill", "sel": "#prompt", "value": PROMPT, "once": True},
        {"do": "click", "sel": "#prefill", "once": True, "wait": "body[data-decode-step]"},
    ], "fill": {"bytes": "#cache-bytes"}},
    {"id": "step", "page": "decode", "target": "#step-panel", "action": [
        {"do": "click", "sel": "#step", "once": True,
         "wait": "body[data-decode-step]:not([data-decode-step='0'])"},
    ], "fill": {"len": "#len-badge"}},
    {"id": "equiv", "page": "decode", "target": "#equiv-panel", "action": [
        {"do": "wait", "sel": "#equiv tbody tr:nth-child(2) td.same:is(.ok, .bad)"},
    ], "fill": {"summary": "#equiv-summary"}},
    {"id": "saves", "page": "decode", "target": "#cost-panel", "action": [
        {"do": "fill", "sel": "#run-n", "value": "5", "once": True},
        {"do": "click", "sel": "#run", "once": True, "wait": "#run:not([disabled])"},
    ]},
    # --- Prefix cache: two requests that begin alike ------------------------------------------------------
    {"id": "reuse", "page": "prefix", "target": "#prefix-align", "action": [
        {"do": "click", "sel": "#reset", "if": "#reset", "once": True, "wait": "#prefix-empty"},
        {"do": "check", "sel": "input[name=preset][value=custom]", "once": True},
        {"do": "fill", "sel": "#prompts", "value": f"\n{PREFIX_SEPARATOR}\n".join(PREFIX_PROMPTS), "once": True},
        {"do": "choose", "sel": "#block-size", "value": "4", "once": True},
        {"do": "click", "sel": "#prefix-form button[type=submit]", "once": True, "wait": "#prefix-align"},
    ], "fill": {"saved": "#tokens-saved"}},
    {"id": "hashes", "page": "prefix", "target": "#prefix-blocks"},
    # --- Paged cache: the same tokens in fixed-size blocks of a shared pool ------------------------------
    {"id": "pool", "page": "paged", "target": "#pool-map", "action": [
        {"do": "wait", "sel": "#pool-map .blk"},
        {"do": "fill", "sel": "#add-prompt", "value": PROMPT, "once": True},
        {"do": "click", "sel": "#add-seq", "once": True, "wait": "#seq-table tbody tr"},
        {"do": "click", "sel": "#step", "once": True, "wait": "#seq-table .gen:not(:empty)"},
    ]},
    {"id": "tables", "page": "paged", "target": "#seq-table"},
    # --- Capacity: how many requests fit, and why grouped-query attention fits more ----------------------
    {"id": "capacity", "page": "capacity", "target": "#calc-result", "action": [
        {"do": "click", "sel": "button[data-preset=loaded]", "unless": "#calc-result[data-model^='loaded:']",
         "wait": "#calc-result[data-model^='loaded:'] #variants tbody tr.pick"},
    ], "fill": {"conc": "#r-conc", "mha": "#variants tr[data-kind=MHA] td:nth-child(3)",
                "mine": "#variants tr.pick td:nth-child(3)"}},
    # --- Long context: one head's map over a thousand tokens, on the zoom page of a long capture -----------
    {"id": "long", "page": "zoom", "target": "#zoom", "via": "inspect", "via_action": [
        {"do": "fill", "sel": "#long-text", "value": LONG_PROMPT},
        {"do": "click", "sel": "#long-run"},
    ], "action": [
        {"do": "click", "sel": "#zoom-grid-run", "unless": "body[data-zoom-grid-done]",
         "wait": "body[data-zoom-grid-done] .zg-cell.top", "ms": RUN_MS},
        {"do": "click", "sel": ".zg-cell.top", "unless": ".zg-cell.top.sel", "wait": ".zg-cell.top.sel"},
    ], "fill": {"layer": "#zoom-layer option:checked", "head": "#zoom-head option:checked", "share": ".zg-cell.top"}},
    # --- Compression: the same short budget with and without the attention sinks --------------------------
    {"id": "compress", "page": "arena", "target": "#arena-table-panel", "action": [
        {"do": "uncheck", "sel": "input[name=policies]" + "".join(f":not([value={p}])" for p in ARENA_PAIR),
         "once": True},
        *({"do": "check", "sel": f"input[name=policies][value={p}]", "once": True} for p in ARENA_PAIR),
        {"do": "fill", "sel": "#arena-steps", "value": str(ARENA_STEPS), "once": True},
        {"do": "click", "sel": "#arena-run", "once": True, "wait": "#arena-table tr[data-policy=streaming]",
         "ms": RUN_MS},
    ], "fill": {"kl_window": "#arena-table tr[data-policy=window] td:nth-child(4)",
                "kl_stream": "#arena-table tr[data-policy=streaming] td:nth-child(4)",
                "agree_window": "#arena-table tr[data-policy=window] td:nth-child(6)",
                "agree_stream": "#arena-table tr[data-policy=streaming] td:nth-child(6)",
                "tokens": "#arena-table tr[data-policy=streaming] td:nth-child(3)"}},
    # --- Head roles: the induction head on a repeated random sequence --------------------------------------
    {"id": "induction", "page": "heads", "target": "#role-induction",
     "fill": {"top": "#role-induction .top-head", "score": "#role-induction .best b"}},
    # --- Speculative decoding: a draft that wins and one that loses, on the copy preset --------------------
    {"id": "speculative", "page": "speculative", "query": {"preset": "copy"}, "target": "#spec-compare-view",
     "action": [
         {"do": "fill", "sel": "#spec-prompt", "value": COPY_PROMPT, "if": "#preset-copy.off", "once": True},
         {"do": "fill", "sel": "#spec-new", "value": str(SPEC_TOKENS), "once": True},
         {"do": "click", "sel": "#spec-compare-run", "once": True, "unless": "#spec-compare-table",
          "wait": "#spec-compare-table", "ms": RUN_MS},
     ], "fill": {"lookup_acc": "#spec-compare-table tr[data-draft=lookup] td:nth-child(2)",
                 "lookup_speed": "#spec-compare-table tr[data-draft=lookup] td.speedup",
                 "early_acc": "#spec-compare-table tr[data-draft=early] td:nth-child(2)",
                 "early_speed": "#spec-compare-table tr[data-draft=early] td.speedup"}},
    # --- The real engine: vLLM's own cache, when one is connected ------------------------------------------
    {"id": "engine", "page": "engine", "target": "#engine-status-panel, #engine-none",
     "when": {"connected": "#engine-root", "none": "#engine-none"}, "fill": {"url": "#engine-url"}},
    # --- The engine's own request: the keys a prefix hit read from cached blocks, on Inspect ------------------
    # Reached via the Engine page's "Send and capture" (its two prompts filled in by the server): the captured
    # request opens on /served/<key>, its heatmap's cached key columns shaded. Where it cannot (no engine, or the
    # engine refused), the Engine page's own panel is shown instead (``via_target``) with the sentence that says why.
    {"id": "served", "page": "served", "target": "#head-panel", "via": "engine", "via_action": [
        {"do": "click", "sel": "#served-send", "if": "#served-send", "once": True,
         "wait": "#error .error-box", "ms": RUN_MS},
    ], "via_target": "#engine-none, #engine-served-panel",
     "when": {"connected": "#served-banner", "none": "#engine-none", "refused": "#error .error-box"}},
)

# Sentences a stop may add for some models: key suffix → when it applies, read from the model card and from what
# the model's heads were measured to do (``measured_heads``: None where no head does it). A trained
# model shows what a random or tiny one cannot, and the text says so only where it was measured.
EXTRAS: dict[str, Callable[[dict], bool]] = {
    "chars": lambda c: bool(c["char_level"]),
    "subword": lambda c: not c["char_level"],
    "learned": lambda c: not c["rotary"],
    "rotary": lambda c: bool(c["rotary"]),
    "mha": lambda c: c["n_kv_head"] == c["n_head"],
    "gqa": lambda c: c["n_kv_head"] < c["n_head"],
    "sink": lambda c: c["heads"].get("sink") is not None,
    "previous": lambda c: c["heads"].get("previous") is not None,
    "induction": lambda c: c["heads"].get("induction") is not None,
}
# Sentences that apply to what the page shows (a stop's ``when``): every suffix a stop may use.
WHEN = ("connected", "none", "refused")


def stop_keys(stop: dict) -> list[str]:
    """Every catalog key a stop may show (title, body and all its model-dependent sentences)."""
    base = f"lesson.{stop['id']}"
    return [f"{base}.title", f"{base}.body", *(f"{base}.{extra}" for extra in (*EXTRAS, *stop.get("when", {})))]


def facts(card: dict, heads: dict | None = None) -> dict:
    """The model's numbers a stop's sentences may quote: the model card's, and its measured heads' (``heads``)."""
    out = {
        "model": card["name"], "layers": card["n_layer"], "heads": card["n_head"], "kv_heads": card["n_kv_head"],
        "d": card["d_model"], "head_dim": card["head_dim"], "group": card["n_head"] // card["n_kv_head"],
        "vocab": card["vocab_size"], "prompt": PROMPT, "first": PREFIX_PROMPTS[0], "second": PREFIX_PROMPTS[1],
        "arena_steps": ARENA_STEPS, "strong": STRONG,
    }
    heads = heads or {}
    for role, short in (("previous", "prev"), ("induction", "ind")):
        if heads.get(role):
            h = heads[role]
            out |= {f"{short}_layer": h["layer"], f"{short}_head": h["head"], f"{short}_pct": f"{h['score']:.0%}"}
    if heads.get("sink"):
        sink = heads["sink"]
        out |= {"sink_mean": f"{sink['mean']:.0%}", "sink_uniform": f"{sink['uniform']:.0%}",
                "sink_token": sink["token"], "all_heads": card["n_layer"] * card["n_head"]}
    return out


def measured_heads(roles: dict[str, torch.Tensor] | None, sinks: dict | None) -> dict:
    """What the lesson may say a model's heads do, each None where it was not measured:

    - ``previous`` / ``induction``: the strongest head on that role of the head-roles survey (``roles``, from
      ``app.labs.heads``: (L, H) scores on a repeated random sequence), if it passes ``STRONG``;
    - ``sink``: the lesson prompt's attention-sinks view (``app.viz.explain.sinks_view``), if its verdict is that
      the heads park their weight on the first token (mean share, uniform share, that token's text)."""
    out: dict = {"previous": None, "induction": None, "sink": None}
    for role in ("previous", "induction"):
        if roles is not None:
            scores = torch.nan_to_num(roles[role], nan=-1.0)
            layer, head = divmod(int(scores.flatten().argmax()), scores.shape[1])
            if float(scores[layer, head]) > STRONG:
                out[role] = {"layer": layer, "head": head, "score": float(scores[layer, head])}
    if sinks is not None and sinks["sinks"]:
        out["sink"] = {"mean": sinks["mean"], "uniform": sinks["uniform"], "token": sinks["tokens"][0]}
    return out


def stop_url(index: int, *, model: str, extra: dict | None = None) -> str:
    """The URL of stop ``index`` (1-based): its page (or the page it is reached ``via``), the lesson's prompt where
    the page takes one, the stop's own query, the model."""
    stop = STOPS[index - 1]
    page = stop.get("via", stop["page"])
    query: dict[str, object] = {"prompt": PROMPT} if page in PROMPT_PAGES and "via" not in stop else {}
    query |= {**stop.get("query", {}), "model": model, **(extra or {}), "lesson": index}
    return f"{PAGES[page]}?{urlencode(query)}"


def _with_values(action: list[dict], values: dict[str, str]) -> list[dict]:
    """An action's steps with the server's values in place of their placeholders (``LONG_PROMPT``)."""
    return [{**s, "value": values.get(s["value"], s["value"])} if "value" in s else s for s in action]


def lesson_view(card: dict, translate: Callable[..., str], has_key: Callable[[str], bool],
                heads: dict | None = None, long_prompt: str = "") -> dict:
    """The lesson for one model in one language: every stop with its text, target, action and URL.

    ``heads``: what the model's heads were measured to do (``measured_heads``), for the sentences only a trained
    model earns (an attention sink, a previous-token head, an induction head). ``long_prompt``: the long-context
    stop's text, cut to ``LONG_TOKENS`` of this model's tokens."""
    values = facts(card, heads)
    caps = {**card, "heads": heads or {}}
    stops = []
    for i, stop in enumerate(STOPS, start=1):
        base = f"lesson.{stop['id']}"
        runtime = {name: "{" + name + "}" for name in stop.get("fill", {})}  # left for the browser to fill
        sentences = [translate(f"{base}.body", **values, **runtime)]
        sentences += [translate(f"{base}.{extra}", **values, **runtime) for extra, applies in EXTRAS.items()
                      if applies(caps) and has_key(f"{base}.{extra}")]
        when = [{"sel": sel, "text": translate(f"{base}.{suffix}", **values, **runtime)}
                for suffix, sel in stop.get("when", {}).items()]
        via = {"path": PAGES[stop["via"]], "action": _with_values(stop["via_action"], {LONG_PROMPT: long_prompt}),
               "target": stop.get("via_target")} if "via" in stop else None
        stops.append({
            "index": i, "id": stop["id"], "page": stop["page"], "path": PAGES[stop["page"]],
            "url": stop_url(i, model=card["name"]), "target": stop["target"],
            "title": translate(f"{base}.title", **values), "text": sentences, "when": when, "via": via,
            "action": stop.get("action", []), "fill": stop.get("fill", {}),
        })
    return {"prompt": PROMPT, "model": card["name"], "stops": stops,
            "labels": {k: translate(f"lesson.ui.{k}") for k in
                       ("next", "back", "exit", "finish", "step", "waiting", "waited", "missing", "title", "keys",
                        "more")}}
