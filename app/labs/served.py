"""Requests a real vLLM served, opened on Inspect: the attention its workers computed (the KVScope capture plugin,
``plugins/kvscope-capture``; docs/served-capture.md), fetched from an engine named at start-up, stitched and checked
(``app/engine/capture.py``), put into KVScope's own trace of the same token ids (``app/engine/served_trace.py``) and
held for Inspect's views.

    ServedLab.open(index, name)   fetch the capture named ``name`` (a label or a request id) from engine ``index``,
                                  hold it as a trace; its key (``served-…``), found by every Inspect view
    ServedLab.page(key)           the Inspect page's context for a held served trace, with its banner's figures

The engine drops a capture once fetched, so a served trace is held here (through Inspect's pin protocol: never
recomputed, since KVScope cannot recompute what the engine computed) and at most ``engine_served_max_traces`` at
once, the oldest let go first. The server connects only to the engines named in its settings.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from app.engine.capture import ServedAttention, ServedConflict, fetch_served
from app.engine.served_trace import served_trace
from app.errors import Expired
from app.labs.engine import EngineLab, EngineLimits
from app.labs.inspect import InspectLab
from app.model.loading import LoadedModel

PREFIX = "served-"


class ServedLab:
    def __init__(self, *, engine: EngineLab, inspect: InspectLab, limits: EngineLimits) -> None:
        self.engine = engine
        self.inspect = inspect
        self.limits = limits
        self._held: OrderedDict[str, dict] = OrderedDict()  # key -> the banner's figures, oldest first
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

    def open(self, index: int, name: str) -> str:
        """Fetch capture ``name`` from engine ``index``, hold it as a trace and return its key."""
        link = self.engine.link(index)  # 404 for an engine the server was not started with
        served = fetch_served(link.url, name, timeout_s=self.limits.engine_served_timeout_s)
        lm = self._model(served)
        own = self.inspect.compute_trace(lm, list(served.token_ids))
        trace = served_trace(own, served, engine=index)
        key = PREFIX + hashlib.sha256(f"{index}|{served.request_id}|{id(trace)}".encode()).hexdigest()[:16]
        figures = banner(trace.meta["served"], link.url)
        with self._lock:
            self.inspect.pin(key, (lm, trace))
            self._held[key] = figures
            while len(self._held) > self.limits.engine_served_max_traces:
                old, _ = self._held.popitem(last=False)
                self.inspect.unpin(old)
        return key

    def page(self, key: str) -> dict:
        """Inspect's page context for a held served trace, ``served`` the banner's figures."""
        with self._lock:
            figures = self._held.get(key)
        if figures is None:
            raise Expired("err.served.gone", limit=self.limits.engine_served_max_traces)
        tokens = self.inspect.trace_by_key(key)[1].token_texts
        return self.inspect.key_page(key, prompt="".join(tokens)) | {"served": figures}


def banner(meta: dict, engine_url: str) -> dict:
    """What the banner says of a served trace: the engine, the request, its ranks, which positions it computed and
    which keys came from cached blocks, and the largest difference per layer from KVScope's own capture."""
    diffs = meta["max_diff"]
    return {"engine": meta["engine"], "engine_url": engine_url, "request_id": meta["request_id"],
            "label": meta["label"], "tp": meta["tp"], "pp": meta["pp"], "computed_from": meta["computed_from"],
            "cached_blocks": len(meta["cached_block_ids"]), "block_ids": list(meta["cached_block_ids"]),
            "block_size": meta["block_size"], "steps": len(meta["steps"]), "max_diff": f"{max(diffs):.1e}",
            "worst_layer": diffs.index(max(diffs)), "diffs": [f"{d:.1e}" for d in diffs]}
