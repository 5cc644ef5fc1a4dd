"""Decoding through a KV store of our own: paged, quantized, windowed or plain; and the /paged scheduler.

The model side lives behind the adapter: ``lm.adapter.forward_through(store, ids)`` runs the model's own
modules and does the attention itself (``app.model.attention.attend``), so the K/V it reads come from the
store and nowhere else, for every model family. The store contract is ``app.cache.store.KVStore``; the
plain and paged stores live there too (imported here for the callers that know them by this module).

``PagedEngine`` is the small scheduler the /paged page drives: several sequences decoding greedily through
one ``PagedKVCache``, forked, finished, cancelled, preempted and recomputed, one step at a time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from app.cache import spec as kv_spec
from app.cache.paged import PagedKVCache, PoolExhausted
from app.cache.store import FloatKVStore, KVStore, PagedSeqStore  # noqa: F401  (the stores, re-exported)
from app.errors import BadInput
from app.i18n import Term
from app.model.loading import LoadedModel


def forward_through(lm: LoadedModel, store: KVStore, ids: list[int]) -> torch.Tensor:
    """Run ``ids`` (the next T tokens) through ``lm`` reading and writing K/V via ``store``: logits (T, V)."""
    return lm.adapter.forward_through(store, ids)


# --- the scheduler the page drives ---------------------------------------------------------------------

RUNNING, WAITING, FINISHED, CANCELLED = "running", "waiting", "finished", "cancelled"


@dataclass
class Sequence:
    seq_id: int
    prompt_len: int
    tokens: list[int]  # ids whose K/V are in the pool (once running)
    pending: int | None  # the next token, chosen from the last logits, fed at the next step
    max_new: int
    status: str = WAITING
    parent: int | None = None
    alternatives: list[int] = field(default_factory=list)  # runner-up tokens of the last step, for forks
    preemptions: int = 0
    recomputed_tokens: int = 0
    admitted: int = -1  # admission order (vLLM's running list order); the newest is preempted first

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len + (self.pending is not None)


class PagedEngine:
    """Sequences decoding greedily, together, through one block pool.

    Each ``step`` advances every running sequence by one token (in admission order), then admits waiting
    sequences first come, first served (a preempted one re-enters by recomputing its whole history plus its
    pending token, as vLLM does, and picks its next token from that). With ``preemption="manual"`` a
    sequence whose next token needs a block the pool does not have stays put and is reported in ``stall``;
    the user then chooses to wait (others go on, blocks may free up) or to preempt a sequence.

    With ``preemption="auto"`` the engine decides as vLLM's scheduler does: when a running sequence cannot
    grow, the most recently admitted running sequence is preempted by recompute (blocks freed, put at the
    front of the waiting queue), repeatedly, until the blocked one fits or is itself the one preempted; a
    step that preempted admits nobody. ``max_num_seqs`` caps the running sequences (vLLM's max_num_seqs),
    ``ignore_eos`` decodes to ``max_new`` whatever the tokens (vLLM's SamplingParams.ignore_eos).
    ``app/capacity/check.py`` drives this engine and the scheduler simulator side by side.
    """

    def __init__(
        self, lm: LoadedModel, *, num_blocks: int, block_size: int, max_sequences: int = 8, log_size: int = 40,
        lock: AbstractContextManager | None = None, preemption: str = "manual", max_num_seqs: int | None = None,
        ignore_eos: bool = False,
    ) -> None:
        a = lm.adapter
        self.lm = lm
        # Each layer's KV-cache spec: sliding-window layers get block tables of their own that drop blocks once
        # outside the window.
        self.cache = PagedKVCache(num_blocks=num_blocks, block_size=block_size, n_layer=a.n_layer,
                                  n_kv_head=a.n_kv_head, head_dim=a.head_dim, dtype=a.dtype,
                                  specs=kv_spec.from_adapter(a))
        self.sequences: OrderedDict[int, Sequence] = OrderedDict()
        self.waiting: deque[int] = deque()
        self.max_sequences = max_sequences
        self.events: deque[tuple[str, dict]] = deque(maxlen=log_size)  # (catalog key, parameters)
        self.stall: dict | None = None
        self.step_count = 0
        self._next_id = 0
        self._lock = lock or nullcontext()
        if preemption not in ("manual", "auto"):
            raise ValueError(f"preemption must be 'manual' or 'auto', not {preemption!r}")
        self.preemption = preemption
        self.max_num_seqs = max_num_seqs
        self.ignore_eos = ignore_eos
        self._admissions = 0
        self._deferred: list[Sequence] | None = None  # auto policy: finished this step, released at its end

    @property
    def lock(self):
        """Held by the web layer around an action and the view that follows it (the model lock, re-entrant)."""
        return self._lock

    # --- lifecycle ---------------------------------------------------------------------------------
    def _live(self) -> int:
        return sum(s.status in (RUNNING, WAITING) for s in self.sequences.values())

    def _make_room(self) -> None:
        """Forget the oldest finished/cancelled sequences so the table stays bounded."""
        done = [i for i, s in self.sequences.items() if s.status in (FINISHED, CANCELLED)]
        while len(self.sequences) >= 2 * self.max_sequences and done:
            del self.sequences[done.pop(0)]

    def _new_id(self) -> int:
        if self._live() >= self.max_sequences:
            raise BadInput("err.paged.too_many", n=self.max_sequences)
        self._make_room()
        self._next_id += 1
        return self._next_id - 1

    def add(self, prompt_ids: list[int], max_new: int, *, admit: bool = True) -> Sequence:
        """A new request. ``admit=False`` only queues it (vLLM's add_request): the next ``step`` admits it."""
        need = self.cache.blocks_for(len(prompt_ids))
        if need > self.cache.num_blocks:
            raise BadInput("err.paged.too_big", need=need, total=self.cache.num_blocks)
        seq = Sequence(self._new_id(), len(prompt_ids), list(prompt_ids), None, max_new)
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq.seq_id)
        self.events.append(("ev.arrives", {"seq": seq.seq_id, "n": len(prompt_ids)}))
        self.stall = None
        if admit:
            self._admit()
        return seq

    def _admit(self) -> None:
        """Admit waiting sequences first come, first served, while their blocks fit."""
        while self.waiting:
            if self.max_num_seqs is not None and len(self._running()) >= self.max_num_seqs:
                return
            seq = self.sequences[self.waiting[0]]
            # A preempted sequence recomputes its history and its pending token (vLLM: num_computed_tokens = 0).
            feed = seq.tokens if seq.pending is None else seq.tokens + [seq.pending]
            try:
                with self._lock:
                    logits = forward_through(self.lm, PagedSeqStore(self.cache, seq.seq_id), feed)
            except PoolExhausted as exc:
                self.stall = {"kind": "admit", "seq_id": seq.seq_id, "needed": exc.needed, "free": exc.free}
                self.events.append(("ev.waits", {"seq": seq.seq_id, "needed": exc.needed, "free": exc.free}))
                return
            self.waiting.popleft()
            table = self.cache.block_tables[seq.seq_id]
            if seq.pending is None:  # a new sequence: prefill picks its first token
                self._pick(seq, logits[-1])
                self.events.append(("ev.prefilled", {"seq": seq.seq_id, "blocks": list(table)}))
            else:  # a preempted one: its history and pending token recomputed, the next token picked from them
                seq.recomputed_tokens += len(feed)
                seq.tokens.append(seq.pending)
                self._pick(seq, logits[-1])
                self.events.append(("ev.recomputed", {"seq": seq.seq_id, "n": len(feed), "blocks": list(table)}))
            seq.status = RUNNING
            seq.admitted, self._admissions = self._admissions, self._admissions + 1
            self._finish_if_done(seq)

    def _pick(self, seq: Sequence, logits: torch.Tensor) -> None:
        top = torch.topk(logits, 4).indices.tolist()
        seq.pending, seq.alternatives = top[0], top[1:]

    def _finish_if_done(self, seq: Sequence) -> None:
        if seq.generated >= seq.max_new or (seq.pending in self.lm.end_ids and not self.ignore_eos):
            if self._deferred is not None:  # vLLM frees a finished request's blocks after the step's schedule
                self._deferred.append(seq)
            else:
                self._release(seq, FINISHED)

    def _release(self, seq: Sequence, status: str) -> None:
        if seq.seq_id in self.cache.block_tables:
            freed = self.cache.free(seq.seq_id)
            self.events.append((f"ev.{status}.freed", {"seq": seq.seq_id, "blocks": list(freed)}))
        else:
            self.events.append((f"ev.{status}", {"seq": seq.seq_id}))
        if seq.seq_id in self.waiting:
            self.waiting.remove(seq.seq_id)
        seq.status = status

    def step(self) -> None:
        """One greedy token for every running sequence that can get its slot, then admit waiting ones that fit.

        Running sequences go first (as in vLLM's scheduler), so a preempted sequence does not immediately take
        back the blocks it just gave up; a sequence admitted now does its prefill this step and decodes from the next.
        """
        self.stall = None
        self.step_count += 1
        blocked, preempted = [], []
        self._deferred = [] if self.preemption == "auto" else None
        running = self._running()
        decoded, grew = [], []  # for the log: who got a token this step, who took a new block for it
        i = 0
        while i < len(running):
            seq = running[i]
            token = seq.pending
            assert token is not None, "a running sequence holds the token its admission or last step picked"
            had = len(self.cache.block_tables.get(seq.seq_id, ()))
            try:
                with self._lock:
                    logits = forward_through(self.lm, PagedSeqStore(self.cache, seq.seq_id), [token])
            except PoolExhausted:
                if self.preemption == "manual":
                    blocked.append(seq.seq_id)
                    i += 1
                    continue
                victim = running.pop()  # the most recently admitted running sequence, maybe seq itself
                self._preempt(victim, front=True)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
                continue  # retry seq with the freed blocks
            seq.tokens.append(token)
            decoded.append(seq.seq_id)
            table = self.cache.block_tables.get(seq.seq_id, [])
            if len(table) > had:
                grew.append((seq.seq_id, table[-1]))
            self._pick(seq, logits[-1])
            self._finish_if_done(seq)
            i += 1
        if decoded:  # the decode step itself, in the log with what it allocated (admissions come after)
            self.events.append(("ev.decoded", {"step": self.step_count, "seqs": decoded}))
            for seq_id, block in grew:
                self.events.append(("ev.grew", {"seq": seq_id, "block": block}))
        if not preempted:  # vLLM admits no waiting request in a step that had to preempt
            self._admit()
        for seq in self._deferred or []:
            self._release(seq, FINISHED)
        self._deferred = None
        if blocked:
            self.stall = {"kind": "grow", "seq_id": blocked[0], "blocked": blocked, "needed": 1,
                          "free": self.cache.num_free_blocks}
            self.events.append(("ev.exhausted", {"seqs": list(blocked)}))

    def _running(self) -> list[Sequence]:
        """Running sequences in admission order (vLLM's running list)."""
        return sorted((s for s in self.sequences.values() if s.status == RUNNING), key=lambda s: s.admitted)

    def _preempt(self, seq: Sequence, *, front: bool) -> None:
        freed = self.cache.free(seq.seq_id)
        seq.status, seq.preemptions = WAITING, seq.preemptions + 1
        stalled = self.stall["seq_id"] if self.stall and self.stall["kind"] == "admit" else None
        if front or stalled is None or stalled not in self.waiting:
            self.waiting.appendleft(seq.seq_id)
        else:  # the user freed blocks for the sequence waiting to be admitted: it goes first, then this one
            self.waiting.insert(self.waiting.index(stalled) + 1, seq.seq_id)
        self.events.append(("ev.preempted", {"seq": seq.seq_id, "blocks": list(freed), "n": len(seq.tokens)}))

    # --- the user's actions --------------------------------------------------------------------------
    def get(self, seq_id: int) -> Sequence:
        if seq_id not in self.sequences:
            raise BadInput("err.paged.no_seq", seq=seq_id)
        return self.sequences[seq_id]

    def fork(self, seq_id: int) -> Sequence:
        """Parallel sampling in miniature: the child shares every block and continues with a runner-up token."""
        parent = self.get(seq_id)
        if parent.status != RUNNING:
            raise BadInput("err.paged.fork_status", seq=seq_id, status=Term(f"status.{parent.status}"))
        if not parent.alternatives:
            raise BadInput("err.paged.no_runner_up", seq=seq_id)
        child = Sequence(self._new_id(), parent.prompt_len, list(parent.tokens), parent.alternatives.pop(0),
                         parent.max_new, status=RUNNING, parent=seq_id, admitted=self._admissions)
        self._admissions += 1
        self.cache.fork(seq_id, child.seq_id)
        self.sequences[child.seq_id] = child
        shared = self.cache.block_tables[seq_id]
        self.events.append(("ev.forks", {"seq": child.seq_id, "parent": seq_id, "blocks": list(shared)}))
        return child

    def finish(self, seq_id: int) -> None:
        self._end(seq_id, FINISHED)

    def cancel(self, seq_id: int) -> None:
        self._end(seq_id, CANCELLED)

    def _end(self, seq_id: int, status: str) -> None:
        """Finishing and cancelling release the same way (blocks freed tail first); only the status differs."""
        seq = self.get(seq_id)
        if seq.status not in (RUNNING, WAITING):
            raise BadInput("err.paged.already", seq=seq_id, status=Term(f"status.{seq.status}"))
        self._release(seq, status)
        self.stall = None

    def preempt(self, seq_id: int) -> None:
        """Free a running sequence's blocks; it is recomputed when it fits again.

        It goes first in line (as vLLM puts a preempted request), except when a sequence is waiting to be
        admitted (an admission stall): the user preempted to make room for that one, so it gets the freed
        blocks first and the preempted sequence queues right behind it.
        """
        seq = self.get(seq_id)
        if seq.status != RUNNING:
            raise BadInput("err.paged.preempt_status", seq=seq_id, status=Term(f"status.{seq.status}"))
        self._preempt(seq, front=False)
        self.stall = None

    def wait(self) -> None:
        """The 'wait' choice: leave everything as it is; the next step tries again."""
        self.events.append(("ev.wait", {}))
        self.stall = None
