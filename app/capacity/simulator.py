"""A continuous-batching scheduler simulator that decides as vLLM's V1 scheduler does (no model runs).

Each step (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``)::

    budget = max_num_batched_tokens
    1. RUNNING requests, in admission order, while budget > 0:
         n = min(num_tokens - num_computed_tokens, budget)      # 1 for a decode, the rest of a prompt otherwise
         allocate_slots(n) or, while it fails, preempt the LAST running request (the most recently admitted):
             free its blocks, num_computed_tokens = 0, put it at the FRONT of the waiting queue
             (recompute: it re-enters as a prompt of all its tokens); if that was this request, stop.
    2. Only if nobody was preempted: WAITING requests, first come first served, while budget > 0 and
       len(running) < max_num_seqs:
         prefix-cache hit = the longest run of its full blocks already cached (at most num_tokens − 1 tokens)
         n = num_tokens − hit;  without chunked prefill a prompt that does not fit the budget waits;
         with it n = min(n, budget) (the rest comes in later steps)
         allocate_slots(n, hit blocks) or stop (head-of-line: the queue waits for blocks)
    3. The step runs: num_computed_tokens += n; a request whose tokens are all computed samples one token
       (its first one ends TTFT); one that has max_tokens outputs finishes and frees its blocks (tail first,
       so its tail is evicted first; full blocks keep their hashes and stay reusable until evicted).

Block pool (``block_pool.py``): the labs' own pool, ``app.cache.blocks.ArrayBlockPool`` (the array layout of
``BlockPool``, held to the same property tests): free blocks in an LRU queue; a freed block keeps its hash and can
be hit again until a new allocation takes it from the front of the queue (then its hash is evicted). Full blocks
are keyed as the engine keys them: each by the chain of its parent's key and its own tokens
(``app.cache.blocks.hash_request_tokens``, the one chain the prefix cache and the Engine page use), so equal
prefixes give equal keys across requests and a token that differs breaks the chain from its block on. The
simulator runs no model: a request given no ``tokens`` gets stand-in ids that keep exactly what caching depends on,
which tokens it has in common with others (``token_ids``).

KV-cache groups (``SimConfig.groups``, one ``app.cache.spec`` spec per group, from the model's layers): a model whose
layers are all alike has one group and a block holds every layer (the loop above, unchanged). A hybrid model (Gemma
3's sliding-window and full-attention layers) has several: each request keeps one block table per group, every group
takes its blocks for the same tokens from the one pool, and right after a request's tokens of a step are computed a
sliding-window group gives back the blocks its next query will not read (``spec.num_skipped_tokens``; ``NULL`` takes
their place), as the paged engine does at the end of each forward (vLLM frees them at the request's next
``allocate_slots``). A prefix hit then needs every group's blocks (``hybrid_cache_hit``). Such a run decodes step by
step (no lazy decoding).

Counters keep vLLM's names: ``kv_cache_usage_perc`` (a 0–1 fraction, like vLLM's gauge), ``num_preemptions``,
``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens, counted once per admission).
"""

from __future__ import annotations

import random
from bisect import insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from app.cache.blocks import (
    ArrayBlockPool,
    blocks_needed,
    fast_block_hash,
    group_block_hash,
    hash_request_tokens,
    hybrid_cache_hit,
)
from app.cache.spec import KVCacheSpec
from app.errors import BadInput

WAITING, RUNNING, FINISHED = 0, 1, 2
NULL = -1  # a block-table entry whose block a sliding-window group gave back (vLLM's null_block)
_admitted = attrgetter("admitted_at")  # running order
# A fixed fact, not a limit anyone meets: a run given no ``stop`` hook (the engine check's workloads, a few hundred
# steps at most; the tests; the benches) raises past this many steps rather than loop for ever on a workload that
# cannot finish (a bug). A run given one (the capacity lab's: ``Settings.capacity_sim_max_steps``, through
# ``bounds.stopper``) is bounded by that hook alone.
RUNAWAY_STEPS = 2_000_000


@dataclass
class Request:
    rid: int
    arrival: float  # seconds (or step index with the unit cost)
    prompt_len: int
    output_len: int  # max_tokens; EOS is ignored (vLLM's ignore_eos), as benchmarks do
    prefix_group: int = -1  # requests of one group share their first prefix_len tokens
    prefix_len: int = 0
    tokens: tuple[int, ...] | None = None  # the prompt's token ids (prompt_len of them, each >= 0), or None: stand-ins

    def __post_init__(self) -> None:
        if self.tokens is not None and (len(self.tokens) != self.prompt_len or min(self.tokens, default=0) < 0):
            raise ValueError("a request's tokens are its prompt_len token ids, each >= 0")


@dataclass(frozen=True)
class SimConfig:
    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    chunked_prefill: bool = True
    prefix_caching: bool = True
    groups: tuple[KVCacheSpec, ...] = ()  # the spec of each KV-cache group (``kv_cache_groups``); (): one full group


class _Req:
    """A request's scheduling state (``__slots__``: the simulator touches these millions of times)."""

    __slots__ = ("r", "num_tokens", "num_computed", "num_output", "blocks", "num_hashed", "status", "first_token",
                 "finish", "preemptions", "admitted_at", "hit_tokens", "slots", "target", "base_step", "gen",
                 "ev_block", "ev_finish", "tables", "skipped", "keys")

    def __init__(self, r: Request) -> None:
        self.r = r
        self.num_tokens = r.prompt_len
        self.num_computed = 0
        self.num_output = 0
        self.blocks: list[int] = []  # the first group's block table (the only one when there is one group)
        self.tables: list[list[int]] = [self.blocks]  # one block table per KV-cache group (set by the simulator)
        self.skipped: list[int] = []  # per sliding spec: the blocks its groups have given back (0 when none)
        self.num_hashed = 0
        self.keys: list | None = None  # its full blocks' chained keys, made when first needed, dropped when it ends
        self.status = WAITING
        self.first_token: float | None = None
        self.finish: float | None = None
        self.preemptions = 0
        self.admitted_at: int | None = None
        self.hit_tokens = 0
        self.slots = 0  # len(blocks) · block_size: tokens its blocks can hold
        self.target = r.output_len
        # Lazy decoding (see Simulator.step): while base_step is set, num_computed / num_tokens / num_output hold
        # the values at the start of step base_step, and the request gains one token per step after it.
        self.base_step: int | None = None
        self.gen = 0  # bumped at every lazify: events queued for an older lazy stretch are ignored
        self.ev_block = -1  # the step at whose start its blocks are full (it needs one more)
        self.ev_finish = -1  # the step whose token is its last

    def finished_times(self) -> tuple[float, float]:
        """(first token, finish) of a finished request: ``_finish`` sets both."""
        if self.first_token is None or self.finish is None:
            raise RuntimeError("the request has not finished")
        return self.first_token, self.finish


@dataclass
class StepRecord:
    step: int
    start: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    blocks_used: int
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    scheduled: list[tuple[int, int]] | None = None  # (request id, tokens) for the first steps only


StepCost = Callable[[int, int, int, int], float]  # (prefill tokens, decode tokens, KV tokens read, requests) -> s


def unit_cost(prefill: int, decode: int, kv_read: int, n: int) -> float:
    """Every step takes one time unit: arrival times are step numbers (used to compare with the real engine)."""
    return 1.0


def token_ids(r: Request) -> list[int]:
    """A request's tokens as its blocks are keyed: its prompt, then its outputs (``output_len``, EOS ignored).

    No model runs, so what is not given is made up, keeping what prefix caching depends on: which tokens a request
    shares with others. The given prompt ``tokens`` (ids >= 0) are used as they are; otherwise a shared prefix is
    its group's stand-in (−2 − 2·group) and every other token, the outputs included, the request's own
    (−3 − 2·rid): negative, so never a vocabulary id, and never −1 (whose ``hash`` is −2's).
    """
    own = -3 - 2 * r.rid
    if r.tokens is not None:
        prompt = list(r.tokens)
    elif r.prefix_group >= 0:
        prompt = [-2 - 2 * r.prefix_group] * r.prefix_len + [own] * (r.prompt_len - r.prefix_len)
    else:
        prompt = [own] * r.prompt_len
    return prompt + [own] * r.output_len


def block_keys(r: Request, block_size: int) -> list:
    """The chained keys of a request's full blocks (``hash_request_tokens`` over ``token_ids``), each block keyed by
    ``fast_block_hash``: a run hashes every block of every request (hundreds of thousands), sha256 would double its
    time, and a simulated run has no tenants to keep apart."""
    return hash_request_tokens(token_ids(r), block_size, hash_block=fast_block_hash)


def _most_cached(r: Request, block_size: int) -> int:
    """At most this many of a waiting request's blocks can be cached: its shared prefix's (stand-in tokens), or all
    but the last of its prompt's (given tokens: any of them may be another request's)."""
    if r.tokens is not None:
        return (r.prompt_len - 1) // block_size
    return r.prefix_len // block_size if r.prefix_group >= 0 else 0


class Simulator:
    """vLLM's scheduling decisions over a block budget. ``run()`` returns the step records and the requests."""

    def __init__(self, config: SimConfig, requests: list[Request], cost: StepCost = unit_cost,
                 keep_scheduled: int = 400, on_step: Callable[[Simulator, StepRecord], None] | None = None,
                 lazy: bool = True) -> None:
        if config.num_blocks < 1 or config.block_size < 1 or config.max_num_batched_tokens < 1 \
                or config.max_num_seqs < 1:
            raise BadInput("err.capacity.sim_budget")
        self.cfg = config
        self.cost = cost
        self.keep_scheduled = keep_scheduled
        self.on_step = on_step
        self.reqs = [_Req(r) for r in sorted(requests, key=lambda r: (r.arrival, r.rid))]
        # Several KV-cache groups: one block table per group, sliding windows give blocks back (the general path).
        self.multi = len(config.groups) > 1 or any(g.sliding_window is not None for g in config.groups)
        self.n_groups = max(1, len(config.groups))
        windows: dict[KVCacheSpec, list[int]] = {}  # each sliding spec and the groups that have it
        for g, spec in enumerate(config.groups):
            if spec.sliding_window is not None:
                windows.setdefault(spec, []).append(g)
        self._sliding = list(windows.items())
        if self.multi:
            for q in self.reqs:
                q.tables = [q.blocks] + [[] for _ in range(self.n_groups - 1)]
                q.skipped = [0] * len(self._sliding)
        longest = max((r.prompt_len + r.output_len - 1 for r in requests), default=0)
        if self.n_groups * blocks_needed(longest, config.block_size) > config.num_blocks:  # a recompute's prefill
            raise BadInput("err.capacity.sim_too_long", tokens=longest,
                           blocks=self.n_groups * blocks_needed(longest, config.block_size),
                           num_blocks=config.num_blocks)
        self.pool = ArrayBlockPool(config.num_blocks, enable_caching=config.prefix_caching)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.steps: list[StepRecord] = []
        self.stopped: str | None = None  # why run() stopped before every request finished (its ``stop`` said)
        self.now = 0.0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._admissions = 0
        # Lazy decoding: on by default; off with an on_step callback (which reads every request's counters) and
        # with several KV-cache groups.
        self.lazy = lazy and on_step is None and not self.multi
        self.active: list[_Req] = []  # the running requests that are not lazy, in running (admission) order
        self.n_lazy = 0
        self.lazy_sumc = 0  # the lazy requests' num_computed at the start of the current step, summed
        self.block_events: dict[int, list[tuple[_Req, int]]] = {}
        self.finish_events: dict[int, list[tuple[_Req, int]]] = {}

    def _hits(self, q: _Req) -> list:
        """get_computed_blocks: the cached full blocks at the start of the request (at most num_tokens − 1). With
        several groups: one list per group (None where a window does not need the block), as long in every group."""
        keys = self._keys(q)
        max_blocks = (q.num_tokens - 1) // self.cfg.block_size
        if not self.multi:
            return self.pool.find_longest_cache_hit(keys, max_blocks)
        keys = keys[:max_blocks]
        group_keys = [keys if g == 0 else [group_block_hash(k, g) for k in keys] for g in range(self.n_groups)]
        return hybrid_cache_hit(self.pool, group_keys, self.cfg.groups, self.cfg.block_size)

    def _keys(self, q: _Req) -> list:
        if q.keys is None:
            q.keys = block_keys(q.r, self.cfg.block_size)
        return q.keys

    def _allocate_groups(self, q: _Req, n_new: int, hits: list[list] | None) -> bool:
        """allocate_slots with several groups: in every group, blocks for num_computed + n_new tokens (the hits, then
        new blocks), or False and nothing changed."""
        pool, ref = self.pool, self.pool.ref_cnt
        want = blocks_needed(q.num_computed + n_new, self.cfg.block_size)
        hits = hits or [[] for _ in q.tables]
        need = sum(max(0, want - len(t) - len(h)) for t, h in zip(q.tables, hits, strict=True))
        need += sum(1 for h in hits for b in h if b is not None and ref[b] == 0)  # evictable hits are taken back
        if need > len(pool.free_block_queue):
            return False
        for table, h in zip(q.tables, hits, strict=True):
            if h:
                pool.touch(b for b in h if b is not None)
                table.extend(NULL if b is None else b for b in h)
        counts = [max(0, want - len(t)) for t in q.tables]
        new = pool.get_new_blocks(sum(counts))  # taken group by group from the front, as the engine takes them
        i = 0
        for table, k in zip(q.tables, counts, strict=True):
            table.extend(new[i : i + k])
            i += k
        q.slots = len(q.blocks) * self.cfg.block_size
        return True

    def _remove_skipped(self, q: _Req) -> None:
        """Each sliding-window group gives back the blocks wholly before its next query's window (newest first),
        ``NULL`` in their place: vLLM's ``remove_skipped_blocks``, as the paged engine does after each forward. The
        groups of one spec skip the same blocks: the spec is asked once."""
        bs = self.cfg.block_size
        tables = q.tables
        for i, (spec, members) in enumerate(self._sliding):
            skipped = spec.num_skipped_tokens(q.num_computed) // bs
            if skipped == q.skipped[i]:
                continue  # no block left the window since the last call
            q.skipped[i] = skipped
            for g in members:
                table = tables[g]
                j = min(skipped, len(table)) - 1
                if j < 0 or table[j] == NULL:
                    continue  # nothing new outside the window (the ones before were given back earlier)
                removed = []
                while j >= 0 and table[j] != NULL:
                    removed.append(table[j])
                    table[j] = NULL
                    j -= 1
                self.pool.free_blocks(removed)

    def _allocate(self, q: _Req, n_new: int, hits: list | None = None) -> bool:
        """allocate_slots: blocks for num_computed + n_new tokens, or False and nothing changed."""
        if not hits and q.num_computed + n_new <= q.slots:
            return True
        if self.multi:
            return self._allocate_groups(q, n_new, hits)
        pool = self.pool
        ref = pool.ref_cnt
        need = blocks_needed(q.num_computed + n_new, self.cfg.block_size) - len(q.blocks) - (len(hits) if hits else 0)
        evictable_hits = sum(1 for b in hits if ref[b] == 0) if hits else 0
        if max(need, 0) + evictable_hits > len(pool.free_block_queue):
            return False
        blocks = q.blocks
        if hits:
            pool.touch(hits)  # before taking new blocks, so the hits cannot be evicted by this allocation
            blocks.extend(hits)
        if need > 0:
            blocks.extend(pool.get_new_blocks(need))
        q.slots = len(blocks) * self.cfg.block_size
        return True

    def _free(self, q: _Req) -> None:
        if self.multi:  # group by group, each tail first
            for table in q.tables:
                self.pool.free_blocks(b for b in reversed(table) if b != NULL)
            q.blocks = []
            q.tables = [q.blocks] + [[] for _ in range(self.n_groups - 1)]
            q.skipped = [0] * len(self._sliding)
        else:
            self.pool.free_blocks(reversed(q.blocks))  # tail first: it is evicted first
            q.blocks = []
        q.num_hashed = 0
        q.slots = 0

    def _hash_full_blocks(self, q: _Req, computed: int | None = None) -> None:
        bs = self.cfg.block_size
        full = (q.num_computed if computed is None else computed) // bs
        start = q.num_hashed
        if start >= full:
            return
        cache_full_block = self.pool.cache_full_block
        keys = self._keys(q)
        if self.multi:  # every group's blocks, each under keys of its own (vLLM: the hash and the group id)
            for g, table in enumerate(q.tables):
                for j in range(start, full):
                    if table[j] != NULL:
                        cache_full_block(table[j], keys[j] if g == 0 else group_block_hash(keys[j], g))
        else:
            blocks = q.blocks
            for j in range(start, full):
                cache_full_block(blocks[j], keys[j])
        q.num_hashed = full

    # --- lazy decoding ------------------------------------------------------------------------------------
    # Most of a run is decoding: every running request gains one token per step, and only now and then needs a
    # new block (every block_size tokens) or finishes. A request that is decoding is made lazy at the end of a
    # step: its counters stay as they were and two events are queued for it — the step at whose start its blocks
    # are full, and the step of its last token. A step then touches only the requests that are not lazy (those
    # in prefill, or just admitted) and the lazy ones with an event, in running order; the others' tokens are
    # counted in bulk (n_lazy decode tokens, lazy_sumc + n_lazy KV tokens read). The plain loop
    # alone (lazy=False) gives the same steps, blocks and times: tests/capacity/test_simulator.py checks it.

    def _lazify(self, q: _Req, step: int) -> None:
        c = q.num_computed
        q.base_step = step
        q.gen += 1
        q.ev_block = step + q.slots - c
        q.ev_finish = step + q.target - q.num_output - 1
        self.block_events.setdefault(q.ev_block, []).append((q, q.gen))
        self.finish_events.setdefault(q.ev_finish, []).append((q, q.gen))
        self.n_lazy += 1
        self.lazy_sumc += c

    def _materialize(self, q: _Req, step: int, ran: bool = False) -> None:
        """Make a lazy request eager with its counters at the start of ``step`` (after it, if ``ran``)."""
        assert q.base_step is not None, "only a lazy request (base_step set) is materialized"
        k = step - q.base_step
        c = q.num_computed + k
        self.n_lazy -= 1
        self.lazy_sumc -= c
        if ran:
            k += 1
            c += 1
        q.num_computed = c
        q.num_tokens = c + 1
        q.num_output += k
        q.base_step = None
        if self.cfg.prefix_caching and c // self.cfg.block_size > q.num_hashed:
            self._hash_full_blocks(q)

    def _events(self, table: dict[int, list[tuple[_Req, int]]], step: int) -> list[_Req]:
        """The lazy requests with an event at ``step`` (stale entries from an earlier lazy stretch dropped)."""
        evs = table.pop(step, None)
        if not evs:
            return []
        out = [q for q, gen in evs if q.gen == gen and q.base_step is not None]
        if len(out) > 1:
            out.sort(key=_admitted)
        return out

    def _all_eager(self, step: int) -> None:
        for q in self.running:
            if q.base_step is not None:
                self._materialize(q, step)
        self.active = list(self.running)

    # --- scheduling -------------------------------------------------------------------------------------
    def _preempt_last(self, step: int) -> _Req:
        victim = self.running.pop()
        if victim.base_step is not None:
            self._materialize(victim, step)
        else:
            self.active.pop()  # the last running request is the last eager one
        self._free(victim)
        victim.num_computed = 0
        victim.status = WAITING
        victim.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _computed(self, q: _Req, c: int, first: list[_Req], done: list[_Req]) -> None:
        """A chunk of prompt (or a recompute) ran: ``c`` tokens are computed; full blocks get their hashes and,
        once all are computed, the step samples one token (the first one ends TTFT)."""
        q.num_computed = c
        if self.cfg.prefix_caching and c // self.cfg.block_size > q.num_hashed:
            self._hash_full_blocks(q)
        if self.multi:
            self._remove_skipped(q)
        if c == q.num_tokens:
            q.num_output += 1
            q.num_tokens = c + 1
            if q.first_token is None:
                first.append(q)
            if q.num_output >= q.target:
                done.append(q)

    def step(self) -> StepRecord:
        """Schedule (running first, then waiting) and run one step, in four phases:

            _schedule_running   each running request in order: a decode token, or a chunk of its prompt; a request
                                that needs a block it cannot get preempts the last running one
            _admit_waiting      (only in a step that preempted nobody) waiting requests while budget, sequences
                                and blocks allow, their prefix hits first
            _finish             the step's time from its cost; first tokens; finished requests freed
            _lazify_decoding    requests now only decoding leave the per-step loop until their next event

        A scheduled request is advanced as soon as it is scheduled: nothing later in the same schedule reads its
        token counts, except prefix hits on blocks it fills this step, which vLLM allows too (it hashes blocks
        when it allocates them). Blocks of requests that finish are freed after the whole schedule, as in vLLM.
        """
        s = len(self.steps)
        sched: list[tuple[int, int]] | None = [] if s < self.keep_scheduled else None  # (request id, tokens)
        preempted: list[int] = []
        admitted: list[int] = []
        first: list[_Req] = []  # requests whose first token this step samples
        done: list[_Req] = []  # requests whose last token this step samples
        # The counters travel as arguments and results (no object a step: this is the simulator's hottest path).
        budget, prefill, decode, kv_read, nsched = self._schedule_running(s, sched, preempted, first, done)
        if not preempted and self.waiting:
            prefill, kv_read, nsched = self._admit_waiting(budget, sched, admitted, first, done, prefill, kv_read,
                                                           nsched)
        start, duration, finished = self._finish(s, first, done, prefill, decode, kv_read, nsched + decode)
        self._lazify_decoding(s)
        rec = StepRecord(s, start, duration, prefill, decode, len(self.running), len(self.waiting),
                         self.pool.num_used_blocks, admitted, preempted, finished)
        rec.scheduled = sched
        self.steps.append(rec)
        if self.on_step:
            self.on_step(self, rec)
        return rec

    def _schedule_running(self, s: int, sched: list[tuple[int, int]] | None, preempted: list[int],
                          first: list[_Req], done: list[_Req]) -> tuple[int, int, int, int, int]:
        """(budget left, prefill tokens, decode tokens, KV tokens read, requests given prompt tokens)."""
        cfg = self.cfg
        bs = cfg.block_size
        caching = cfg.prefix_caching
        budget = cfg.max_num_batched_tokens
        prefill = decode = kv_read = nsched = 0
        running = self.running
        multi = self.multi
        free = self.pool.free_block_queue
        get_new_blocks = self.pool.get_new_blocks
        block_events = self.block_events
        block_ev = self._events(block_events, s)
        items = running
        if self.n_lazy:
            active = self.active
            # The fast path needs the running order [lazy requests..., eager requests...]: each lazy request then
            # decodes with the budget it would have had in the plain loop (reserved up front), and the eager
            # ones see what the lazy ones left. A prompt still in prefill was admitted last, so it is at the end:
            # the order holds in practice; when it does not, every request is made eager for this step.
            if self.n_lazy <= budget and (not active or running[len(running) - len(active)] is active[0]):
                items = block_ev + active if active else block_ev
                budget -= self.n_lazy
            else:
                self._all_eager(s)
        for q in items:  # preemption pops from the end of running, so that loop never sees a preempted request
            if q.status != RUNNING:  # (a separate list of items can: skip it)
                continue
            c = q.num_computed
            if q.base_step is not None:  # a lazy request whose blocks are full (its token is reserved)
                c += s - q.base_step
                if free:  # one more block from the free queue; it stays lazy
                    q.blocks += get_new_blocks(1)
                    q.slots = c + bs
                    if caching:  # the block it filled last step gets its hash
                        self._hash_full_blocks(q, c)
                    e = q.ev_block = s + bs
                    if e in block_events:
                        block_events[e].append((q, q.gen))
                    else:
                        block_events[e] = [(q, q.gen)]
                    continue
                self._materialize(q, s)  # no free block: the plain path below preempts
                insort(self.active, q, key=_admitted)
                budget += 1  # its reserved token goes back: the plain path counts it
            elif budget <= 0:
                break
            if q.num_tokens - c == 1 and q.num_output and (c < q.slots or free) and not multi:  # the hot path
                if c >= q.slots:  # its blocks are full: one more from the free queue
                    q.blocks += get_new_blocks(1)
                    q.slots = c + bs
                budget -= 1
                kv_read += c + 1
                decode += 1
                if sched is not None:
                    sched.append((q.r.rid, 1))
                c += 1
                q.num_computed = c
                q.num_tokens = c + 1
                o = q.num_output = q.num_output + 1
                if caching and c % bs == 0:
                    self._hash_full_blocks(q)
                if o >= q.target:
                    done.append(q)
                continue
            n = q.num_tokens - c
            if n > budget:
                n = budget
            if c + n > q.slots:  # needs a new block (the common decode step does not)
                ok = True
                while not self._allocate(q, n):
                    if running[-1].base_step is not None:
                        budget += 1  # a lazy victim will not decode: its reserved token goes back
                    victim = self._preempt_last(s)
                    preempted.append(victim.r.rid)
                    if victim is q:
                        ok = False
                        break
                if not ok:
                    break
            budget -= n
            kv_read += c + n
            if sched is not None:
                sched.append((q.r.rid, n))
            if n == 1 and q.num_output and c + 1 == q.num_tokens:  # a decode that needed a new block
                decode += 1
            else:
                prefill += n
                nsched += 1
            self._computed(q, c + n, first, done)
        if self.n_lazy:  # every lazy request still running decoded one token
            decode += self.n_lazy
            kv_read += self.lazy_sumc + self.n_lazy
        return budget, prefill, decode, kv_read, nsched

    def _admit_waiting(self, budget: int, sched: list[tuple[int, int]] | None, admitted: list[int],
                       first: list[_Req], done: list[_Req], prefill: int, kv_read: int, nsched: int
                       ) -> tuple[int, int, int]:
        """(prefill tokens, KV tokens read, requests given prompt tokens), the admitted ones' added."""
        cfg = self.cfg
        bs = cfg.block_size
        caching = cfg.prefix_caching
        running = self.running
        free = self.pool.free_block_queue
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            q = waiting[0]
            cached_at_most = _most_cached(q.r, bs) if caching else 0
            if self.n_groups * (blocks_needed(min(q.num_tokens, budget), bs) - cached_at_most) > len(free):
                break  # it cannot fit, however many of its blocks are cached (a cheap test: it waits a lot)
            hits = self._hits(q) if caching and q.num_computed == 0 else []
            n_hit = len(hits[0]) if self.multi and hits else len(hits)
            hit_tokens = n_hit * bs
            n = q.num_tokens - hit_tokens
            if n > budget:
                if not cfg.chunked_prefill:
                    break
                n = budget
            q.num_computed = hit_tokens
            if not self._allocate(q, n, hits):
                q.num_computed = 0
                break
            waiting.popleft()
            if caching:
                self.prefix_cache_queries += q.num_tokens
                self.prefix_cache_hits += hit_tokens
            q.hit_tokens += hit_tokens
            q.num_hashed = n_hit
            q.status = RUNNING
            q.admitted_at = self._admissions
            self._admissions += 1
            running.append(q)
            self.active.append(q)
            admitted.append(q.r.rid)
            budget -= n
            kv_read += hit_tokens + n
            nsched += 1
            prefill += n
            if sched is not None:
                sched.append((q.r.rid, n))
            self._computed(q, hit_tokens + n, first, done)
        return prefill, kv_read, nsched

    def _finish(self, s: int, first: list[_Req], done: list[_Req], prefill: int, decode: int, kv_read: int,
                nsched: int) -> tuple[float, float, list[int]]:
        """The step's start and duration (its cost), its first tokens' time, and the requests it finished (freed,
        in admission order): (start, duration, finished ids)."""
        running = self.running
        start = self.now
        duration = self.cost(prefill, decode, kv_read, nsched) if nsched else 0.0
        self.now = end = start + duration
        for q in first:
            q.first_token = end
        ending = self._events(self.finish_events, s)
        if ending:
            for q in ending:
                self._materialize(q, s, ran=True)
            done = sorted(done + ending, key=_admitted)
        finished: list[int] = []
        for q in done:
            q.status = FINISHED
            q.finish = end
            q.keys = None
            self._free(q)
            finished.append(q.r.rid)
        for q in done:
            running.remove(q)
            if q in self.active:
                self.active.remove(q)
        return start, duration, finished

    def _lazify_decoding(self, s: int) -> None:
        self.lazy_sumc += self.n_lazy  # every lazy request gained a token
        if self.lazy and s + 1 >= self.keep_scheduled and self.active:
            keep = []
            for q in self.active:
                if q.num_tokens - q.num_computed == 1 and q.num_output:
                    self._lazify(q, s + 1)
                else:
                    keep.append(q)
            self.active = keep

    def run(self, stop: Callable[[Simulator], str | None] | None = None) -> Simulator:
        """Step until every request has finished, or until ``stop`` (asked after every step: a deadline, a step
        limit, a cancel flag) names a reason: then ``self.stopped`` holds it and the run so far is kept."""
        pending = deque(self.reqs)
        while pending or self.waiting or self.running:
            if not self.waiting and not self.running and pending[0].r.arrival > self.now:
                self.now = pending[0].r.arrival  # idle until the next arrival
            while pending and pending[0].r.arrival <= self.now:
                self.waiting.append(pending.popleft())
            self.step()
            if stop is not None and (why := stop(self)):
                self.stopped = why
                break
            if stop is None and len(self.steps) > RUNAWAY_STEPS:
                raise BadInput("err.capacity.sim_steps", steps=RUNAWAY_STEPS)
        return self

    # --- results ------------------------------------------------------------------------------------------
    def blocks_used(self) -> int:
        return self.pool.num_used_blocks

    def kv_cache_usage_perc(self) -> float:
        return self.blocks_used() / self.cfg.num_blocks


def synthetic_workload(
    *, n: int, rate: float, prompt_min: int, prompt_max: int, output_min: int, output_max: int,
    max_requests: int, shared_prefix_fraction: float = 0.0, prefix_len: int = 0, groups: int = 4, seed: int = 0,
) -> list[Request]:
    """Poisson arrivals (``rate`` requests/s; 0 = all at t = 0), uniform prompt and output lengths; a fraction
    of the requests starts with one of ``groups`` shared prefixes of ``prefix_len`` tokens (a system prompt)."""
    if not 1 <= n <= max_requests or rate < 0 or not 1 <= prompt_min <= prompt_max or \
            not 1 <= output_min <= output_max or not 0 <= shared_prefix_fraction <= 1 or prefix_len < 0:
        raise BadInput("err.capacity.workload")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for rid in range(n):
        if rate > 0:
            t += rng.expovariate(rate)
        prompt = rng.randint(prompt_min, prompt_max)
        shared = rng.random() < shared_prefix_fraction and prefix_len > 0
        out.append(Request(rid, t, prompt, rng.randint(output_min, output_max),
                           rng.randrange(groups) if shared else -1, min(prefix_len, prompt - 1) if shared else 0))
    return out


def parse_requests(text: str, *, max_requests: int) -> list[Request]:
    """A pasted list, one request a line: ``arrival prompt_tokens output_tokens [prefix_group prefix_tokens]``
    (spaces or commas; ``#`` starts a comment)."""
    out: list[Request] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].replace(",", " ").split()
        if not line:
            continue
        try:
            if len(line) not in (3, 5):
                raise ValueError
            arrival, prompt, output = float(line[0]), int(line[1]), int(line[2])
            group, plen = (int(line[3]), int(line[4])) if len(line) == 5 else (-1, 0)
            if not (0 <= arrival < 1e7 and 1 <= prompt <= 1_000_000 and 1 <= output <= 1_000_000
                    and group >= -1 and 0 <= plen < prompt):
                raise ValueError
        except ValueError:
            raise BadInput("err.capacity.request_line", line=lineno, text=raw.strip()[:60]) from None
        out.append(Request(len(out), arrival, prompt, output, group, plen if group >= 0 else 0))
        if len(out) > max_requests:
            raise BadInput("err.capacity.too_many_requests", limit=max_requests)
    if not out:
        raise BadInput("err.capacity.no_requests")
    return out
