"""Requests a real vLLM served, opened on Inspect: the attention its workers computed (the KVScope capture plugin,
``plugins/kvscope-capture``; docs/served-capture.md), fetched from an engine named at start-up, stitched and checked
(``app/engine/capture.py``), put into KVScope's own trace of the same token ids (``app/engine/served_trace.py``) and
held for Inspect's views.

    ServedLab.open(index, name)   fetch the capture named ``name`` (a label or a request id) from engine ``index``,
                                  hold it as a trace; its key (``served-…``), found by every Inspect view
    ServedLab.ask(index, prompt)  send ``prompt`` to engine ``index`` flagged for capture (``before`` first, not
                                  flagged: its blocks land in the engine's prefix cache), then ``open`` it
    ServedLab.page(key)           the Inspect page's context for a held served trace, with its banner's figures

The banner names the cached blocks a prefix hit read its keys from twice over: the block ids the workers read (the
plugin's), and their hashes computed the engine's way from the request's token ids (``app/engine/hashing.py``),
each looked up in the mirror of the engine's KV events (``EngineLab.blocks_held``): a hash the mirror holds with
the same tokens is the block the engine announced when another request stored it.

The engine drops a capture once fetched, so a served trace is held here (through Inspect's pin protocol: never
recomputed, since KVScope cannot recompute what the engine computed): each browser's newest
``engine_served_per_browser``, within ``engine_served_max_traces`` and ``engine_served_max_mib`` for all browsers, the
oldest let go first. The server connects only to the engines named in its settings.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

from app.engine.capture import COMPUTE_DTYPES, ServedAttention, ServedConflict, fetch_served, served_progress
from app.engine.hashing import VllmBlockHasher
from app.engine.served_trace import served_trace
from app.errors import BadInput, Expired, UserError
from app.i18n import translate
from app.labs.engine import EngineLab, EngineLimits
from app.labs.inspect import InspectLab
from app.model.loading import LoadedModel
from app.quota import Requester

PREFIX = "served-"
# How long the banner waits for the KV event of a cached block the mirror does not hold yet: the engine publishes a
# block's event in the step that stored it, so a block missing after this is one the mirror will not get (stored
# before the server listened, or evicted).
EVENTS_GRACE_S = 1.0
FOLLOW_POLL_S = 0.05  # how often a followed request's progress is read while it runs (a decode step here: ~0.1 s)
# The Engine page's "Send and capture" form, filled in: a beginning of three full blocks (vLLM's 32 tokens a block
# on CPU, SmolLM2's tokenizer), sent first, then the same beginning with a question, captured. The lesson's stop on
# the keys a request did not compute presses its button.
ASK_BEFORE = ("A serving engine keeps the keys and values of every token it has read in its KV cache, in blocks of "
              "a fixed number of tokens. When a new request begins with exactly the same tokens as an earlier one, "
              "the engine finds those blocks by their hashes and reads their keys and values instead of computing "
              "them again, so only the new tokens run through the model. This is called prefix caching, and it is "
              "why a long shared system prompt costs almost nothing after its first request.")
ASK_PROMPT = ASK_BEFORE + " Question: which of these tokens did the second request compute itself? Answer:"


class ServedLab:
    def __init__(self, *, engine: EngineLab, inspect: InspectLab, limits: EngineLimits) -> None:
        self.engine = engine
        self.inspect = inspect
        self.limits = limits
        self._held: OrderedDict[str, dict] = OrderedDict()  # key -> its banner's figures, owner, bytes; oldest first
        self._lock = threading.Lock()

    def _model(self, served: ServedAttention) -> LoadedModel:
        """The served model KVScope runs too: the default one when its shape is the engine's, else the first that
        is (the capture carries layers, heads and head size; ``served_trace`` checks them again)."""
        reg = self.inspect.registry
        models = [reg.pick(None), *reg.models.values()]
        for lm in models:
            a = lm.adapter
            if a.n_layer == len(served.layers) and a.n_head == served.heads and a.head_dim == served.head_dim:
                return lm
        raise ServedConflict("err.served.no_model", layers=len(served.layers), heads=served.heads,
                          head_dim=served.head_dim)

    def open(self, index: int, name: str, owner: str = "") -> str:
        """Fetch capture ``name`` from engine ``index``, hold it as a trace for ``owner`` (the browser that asked)
        and return its key."""
        link = self.engine.link(index)  # 404 for an engine the server was not started with
        served = fetch_served(link.url, name, timeout_s=self.limits.engine_served_timeout_s)
        lm = self._model(served)
        own = self.inspect.compute_trace(lm, list(served.token_ids))
        trace = served_trace(own, served, engine=index)
        key = PREFIX + hashlib.sha256(f"{index}|{served.request_id}|{id(trace)}".encode()).hexdigest()[:16]
        figures = banner(trace.meta["served"], link.url)
        figures["blocks"] = self._blocks(index, served)
        figures["listening"] = link.events is not None
        self.hold(key, lm, trace, figures, owner)
        return key

    def hold(self, key: str, lm: LoadedModel, trace, figures: dict, owner: str) -> None:
        """Hold a served trace for ``owner``: a browser keeps its newest ``engine_served_per_browser``; all browsers
        together at most ``engine_served_max_traces`` traces and ``engine_served_max_mib`` MiB of tensors, the
        oldest let go first (so in a class each learner's newest stays while the server's memory allows)."""
        nbytes = sum(t.nbytes for t in trace.tensors.values())
        cap_bytes = self.limits.engine_served_max_mib * 2**20
        with self._lock:
            self.inspect.pin(key, (lm, trace))
            self._held[key] = {"figures": figures, "owner": owner, "nbytes": nbytes}
            mine = [k for k, h in self._held.items() if h["owner"] == owner]
            gone = mine[:max(0, len(mine) - self.limits.engine_served_per_browser)]
            for k in gone:
                del self._held[k]
            while len(self._held) > 1 and (len(self._held) > self.limits.engine_served_max_traces
                                           or sum(h["nbytes"] for h in self._held.values()) > cap_bytes):
                k, _ = self._held.popitem(last=False)
                gone.append(k)
            for k in gone:
                self.inspect.unpin(k)

    def _checked(self, prompt: str, before: str | None, max_tokens: int) -> tuple[str, str | None]:
        prompt, before = (prompt or "").strip(), (before or "").strip() or None
        if not prompt:
            raise BadInput("err.engine.empty_prompt")
        limit = self.limits.max_prompt_chars
        if len(prompt) > limit or (before is not None and len(before) > limit):
            raise BadInput("err.engine.prompt_long", n=limit)
        if not 1 <= max_tokens <= self.limits.engine_served_max_new_tokens:
            raise BadInput("err.served.new_tokens", n=self.limits.engine_served_max_new_tokens)
        return prompt, before

    def _send(self, index: int, prompt: str, before: str | None, max_tokens: int, name: str) -> None:
        link, timeout = self.engine.link(index), self.limits.engine_served_timeout_s
        if before is not None:
            link.complete(before, max_tokens=1, timeout=timeout)
        link.complete(prompt, max_tokens=max_tokens, timeout=timeout,
                      extra={"vllm_xargs": {"kvscope_capture": name}})

    def ask(self, index: int, prompt: str, before: str | None = None, max_tokens: int = 4, owner: str = "") -> str:
        """Send ``prompt`` to engine ``index`` flagged for capture, ``before`` (if given) first and unflagged, so a
        prompt that begins with it finds its blocks cached; then open the capture: its key."""
        self.engine.link(index)  # 404 for an engine the server was not started with, before anything is sent
        prompt, before = self._checked(prompt, before, max_tokens)
        name = "kvscope-" + uuid.uuid4().hex[:16]  # this request's label: no other request carries it
        self._send(index, prompt, before, max_tokens, name)
        return self.open(index, name, owner)

    def follow(self, index: int, prompt: str, before: str | None, max_tokens: int, lang: str,
               owner: str = "") -> Callable[[], dict]:
        """``ask``, watched: the request is sent from a thread, and its capture read while the engine serves it
        (the steps every worker has finished in every layer, ``served_progress``: no tensors), so each forward
        step's rows are seen as the engine computes them. Returns ``look()``: the newest of
            {"event": "sending"}                                   the plain request first, if any
            {"event": "rows", "computed_from", "n_tokens", "steps", "expect", "text"}   the steps done so far
            {"event": "done", "result": {"key", "page"}, ...}    held, open it
            {"event": "failed", "text"}                            the reason, in ``lang``; nothing held
        Checked before anything is sent (a bad request raises here, as ``ask`` does)."""
        link = self.engine.link(index)
        prompt, before = self._checked(prompt, before, max_tokens)
        name = "kvscope-" + uuid.uuid4().hex[:16]
        state: dict = {"event": "sending", "text": translate("served.follow.sending", lang)}

        def rows(cached: int, steps: list[tuple[int, int]]) -> dict:
            last_a, last_n = steps[-1]
            n_tokens = last_a + last_n
            expect = steps[0][0] + steps[0][1] + max_tokens - 1  # the prefill's rows, a row per new token but the last
            return {"event": "rows", "computed_from": cached, "n_tokens": n_tokens, "steps": [list(x) for x in steps],
                    "expect": max(expect, n_tokens),
                    "text": translate("served.follow.rows" if last_n > 1 else "served.follow.row", lang, k=len(steps),
                                      a=last_a, b=n_tokens - 1, c=cached)}

        def run() -> None:
            nonlocal state
            sent: list[BaseException] = []

            def send() -> None:
                try:
                    self._send(index, prompt, before, max_tokens, name)
                except BaseException as exc:  # noqa: BLE001 (told to the follower below)
                    sent.append(exc)

            try:
                sender = threading.Thread(target=send, name="kvscope-served-send", daemon=True)
                sender.start()
                seen = 0
                while sender.is_alive():
                    sender.join(FOLLOW_POLL_S)
                    if not sender.is_alive():
                        break
                    progress = served_progress(link.url, name, timeout_s=self.limits.engine_served_timeout_s)
                    if progress is not None and len(progress[1]) > seen:  # None: not scheduled yet
                        seen = len(progress[1])
                        state = rows(*progress)
                if sent:
                    raise sent[0]
                key = self.open(index, name, owner)
                _, held_trace = self.inspect.trace_by_key(key, who=Requester(owner))  # held: never computed again
                served_meta = held_trace.meta["served"]
                state = {"event": "done", "result": {"key": key, "page": f"/served/{key}"},
                         "text": translate("served.follow.done", lang),
                         "steps": [list(x) for x in served_meta["steps"]],
                         "computed_from": served_meta["computed_from"]}
            except UserError as exc:
                state = {"event": "failed", "text": exc.text(lang)}
            except Exception:  # noqa: BLE001 (an engine's failure ends the follow with a message, never a dead page)
                state = {"event": "failed", "text": translate("err.served.unreachable", lang, url=link.url)}

        threading.Thread(target=run, name="kvscope-served-follow", daemon=True).start()
        return lambda: state

    def _blocks(self, index: int, served: ServedAttention) -> list[dict]:
        """Each cached block the request read keys from: its id in the engine's pool (the workers'), its hash as
        vLLM chains it from the token ids, and whether the mirror of the engine's events holds that hash with
        these tokens (and from which event batch)."""
        c, bs = served.computed_from, served.block_size
        hashes = VllmBlockHasher().request(served.token_ids[:c], bs) if c and bs else []
        held = self.engine.blocks_held(index, hashes)
        link = self.engine.link(index)
        end = time.monotonic() + EVENTS_GRACE_S
        while link.events is not None and None in held and (left := end - time.monotonic()) > 0:
            link.wait(link.mirror.version, left)  # a block stored a moment ago: its event may still be on its way
            held = self.engine.blocks_held(index, hashes)
        out = []
        for j, (bid, h, seen) in enumerate(zip(served.cached_block_ids, hashes, held, strict=False)):
            tokens = tuple(served.token_ids[j * bs:(j + 1) * bs])
            out.append({"index": j, "id": bid, "hash": f"{h:016x}", "first": j * bs, "last": (j + 1) * bs - 1,
                        "seq": seen[0] if seen is not None and seen[1] == tokens else None})
        return out

    def page(self, key: str, *, who: Requester) -> dict:
        """Inspect's page context for a held served trace, ``served`` the banner's figures."""
        with self._lock:
            held = self._held.get(key)
        if held is None:
            raise Expired("err.served.gone", limit=self.limits.engine_served_max_traces,
                          per=self.limits.engine_served_per_browser)
        figures = held["figures"]
        tokens = self.inspect.trace_by_key(key, who=who)[1].token_texts
        return self.inspect.key_page(key, prompt="".join(tokens), who=who) | {"served": figures}


def banner(meta: dict, engine_url: str) -> dict:
    """What the banner says of a served trace: the engine, the request, its ranks, which positions it computed and
    which keys came from cached blocks, and the largest difference per layer from KVScope's own capture."""
    diffs = meta["max_diff"]
    return {"engine": meta["engine"], "engine_url": engine_url, "request_id": meta["request_id"],
            "label": meta["label"], "tp": meta["tp"], "pp": meta["pp"], "computed_from": meta["computed_from"],
            "cached_blocks": len(meta["cached_block_ids"]), "block_ids": list(meta["cached_block_ids"]),
            "block_size": meta["block_size"], "steps": len(meta["steps"]),
            "step_rows": ", ".join(f"{a}" if n == 1 else f"{a}–{a + n - 1}" for a, n in meta["steps"]),
            "max_diff": f"{max(diffs):.1e}",
            "worst_layer": diffs.index(max(diffs)), "diffs": [f"{d:.1e}" for d in diffs],
            "dtype": meta.get("dtype"), "mantissa": COMPUTE_DTYPES.get(meta.get("dtype") or "")}
