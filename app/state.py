"""What the server holds for its lifetime: settings, the loaded models, traces kept for reuse.

Model forwards are serialised by ``model_lock``: torch already uses every core for one forward,
and a shared model must not run two captures with hooks at once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from app.errors import BadInput, Expired
from app.model.capture import run_traced
from app.model.loading import LoadedModel, ModelRegistry
from app.model.prompts import encode_prompt
from app.model.sessions import SessionStore
from app.model.store import TraceStore
from app.model.trace import Trace
from app.settings import Settings


@dataclass
class AppState:
    settings: Settings
    registry: ModelRegistry
    traces: TraceStore
    sessions: SessionStore
    # trace key -> (model name, token ids): small, so it outlives the traces themselves and lets an
    # evicted trace be recomputed from a page's link.
    trace_index: OrderedDict[str, tuple[str, tuple[int, ...]]] = field(default_factory=OrderedDict)
    model_lock: threading.RLock = field(default_factory=threading.RLock)
    extras: dict = field(default_factory=dict)

    @classmethod
    def create(cls, settings: Settings, registry: ModelRegistry) -> AppState:
        sessions = SessionStore(ttl_s=settings.session_ttl_s, max_sessions=settings.max_sessions,
                                max_bytes=settings.session_cache_bytes, max_steps=settings.max_decode_steps)
        return cls(settings=settings, registry=registry, traces=TraceStore(settings.trace_cache_bytes),
                   sessions=sessions)

    def model(self, name: str | None) -> LoadedModel:
        if name and name not in self.registry.models:
            raise BadInput(f"Unknown model {name!r}; this server runs: {', '.join(self.registry.names)}.")
        return self.registry.get(name)

    def _key(self, model: str, ids: list[int] | tuple[int, ...]) -> str:
        digest = hashlib.sha256(f"{model}|{','.join(map(str, ids))}".encode()).hexdigest()[:20]
        self.trace_index[digest] = (model, tuple(ids))
        self.trace_index.move_to_end(digest)
        while len(self.trace_index) > 10_000:
            self.trace_index.popitem(last=False)
        return digest

    def _compute(self, lm: LoadedModel, ids: list[int]) -> Trace:
        with self.model_lock:
            return run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))

    def trace_prompt(self, model: str | None, prompt: str | None) -> tuple[LoadedModel, str, Trace]:
        lm = self.model(model)
        ids = encode_prompt(lm, prompt, max_chars=self.settings.max_prompt_chars)
        key = self._key(lm.name, ids)
        return lm, key, self.traces.get_or_compute(key, lambda: self._compute(lm, ids))

    def trace_by_key(self, key: str) -> tuple[LoadedModel, Trace]:
        if key not in self.trace_index:
            raise Expired("This view has expired on the server: submit the prompt again.")
        name, ids = self.trace_index[key]
        if name not in self.registry.models:  # a trained model dropped since (Settings.max_trained_models)
            raise Expired("err.classroom.model_gone", model=name)
        lm = self.registry.get(name)
        return lm, self.traces.get_or_compute(key, lambda: self._compute(lm, list(ids)))
