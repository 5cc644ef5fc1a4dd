"""Decode sessions: an id, a time-to-live, and caps on how many and how many bytes.

Expired or deleted sessions leave a tombstone (their token ids and sampling), so the page can say
the session expired and rebuild it. Releasing a session drops its KV cache, so the memory returns.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from app.errors import Busy, Expired
from app.model.decode import DecodeSession
from app.model.loading import LoadedModel
from app.model.sampling import Sampling


class SessionStore:
    def __init__(self, *, ttl_s: float, max_sessions: int, max_bytes: int, max_steps: int) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.max_steps = max_steps
        self._live: dict[str, DecodeSession] = {}
        self._tombstones: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, lm: LoadedModel, prompt_ids: list[int], sampling: Sampling) -> DecodeSession:
        with self._lock:
            self._purge_expired()
            if len(self._live) >= self.max_sessions:
                raise Busy("err.sessions.too_many", n=len(self._live))
            if self._bytes() >= self.max_bytes:
                raise Busy("err.sessions.memory")
            session = DecodeSession(id=secrets.token_urlsafe(9), lm=lm, prompt_ids=list(prompt_ids),
                                    sampling=sampling, max_steps=self.max_steps)
            self._live[session.id] = session
            return session

    def get(self, sid: str) -> DecodeSession:
        with self._lock:
            self._purge_expired()
            session = self._live.get(sid)
            if session is None:
                if sid in self._tombstones:
                    raise Expired("err.session.ended")
                raise Expired("err.session.unknown")
            session.last_used = time.monotonic()
            return session

    def tombstone(self, sid: str) -> dict | None:
        return self._tombstones.get(sid)

    def check_budget(self, session: DecodeSession) -> None:
        """Refuse to grow past the byte cap: the caller stops before the next step."""
        with self._lock:
            if self._bytes() > self.max_bytes:
                raise Busy("err.sessions.budget")

    def delete(self, sid: str) -> bool:
        with self._lock:
            session = self._live.pop(sid, None)
            if session is None:
                return False
            self._bury(session)
            return True

    def _bury(self, session: DecodeSession) -> None:
        self._tombstones[session.id] = {
            "model": session.lm.name, "ids": session.ids, "prompt_len": len(session.prompt_ids),
            "sampling": session.sampling.__dict__,
        }
        while len(self._tombstones) > 1000:
            self._tombstones.popitem(last=False)
        session.release()

    def _purge_expired(self) -> None:
        now = time.monotonic()
        for sid in [s for s, sess in self._live.items() if now - sess.last_used > self.ttl_s]:
            self._bury(self._live.pop(sid))

    def _bytes(self) -> int:
        return sum(s.nbytes() for s in self._live.values())

    def stats(self) -> dict:
        with self._lock:
            return {"sessions": len(self._live), "bytes": self._bytes(), "max_sessions": self.max_sessions,
                    "max_bytes": self.max_bytes}
