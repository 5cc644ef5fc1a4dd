"""The simulator checked against the real paged engine: same requests, same budgets, decisions step by step.

The engine is /paged's ``PagedEngine`` with its automatic, vLLM-like policy (``preemption="auto"``): the real
model decodes greedily through a real ``PagedKVCache``. The simulator runs with the unit step cost (a step is
one time unit) and with what the engine does not have turned off. Both are driven by the same loop::

    now = 0
    while requests remain:
        if nothing runs or waits: now = next arrival
        queue the requests that have arrived (arrival <= now)
        one step   (the engine: running sequences decode, then waiting ones are admitted)
        now += 1

After every step each side reports which requests were admitted, preempted and finished, and how many blocks
are in use; the two lists must be equal. Both sides split the layers into the KV-cache groups their specs make
(``app.cache.spec``): for a sliding-window model (Gemma 3) each group has its own block table and the local groups
give back the blocks that fall outside the window, so the block counts compared are the windowed ones.

Differences by design (stated on the page): the engine prefills a whole prompt at once and has no token budget
(so the simulator's max_num_batched_tokens is set above any step's tokens and chunked prefill is off), it has
no prefix cache (off in the simulator), it runs the sequences of a step one after another (vLLM batches them),
and the text is real: with ``ignore_eos`` both decode to each request's max_tokens.
"""

from __future__ import annotations

from app.cache.paged_decode import FINISHED, RUNNING, WAITING, PagedEngine
from app.cache.spec import KVCacheSpec, from_adapter, kv_cache_groups
from app.capacity.simulator import Request, SimConfig, Simulator
from app.errors import BadInput
from app.model.loading import LoadedModel

TEXT = ("When a language model reads a sentence, every new token asks a question of the tokens before it. "
        "The answer mixes the values of the tokens whose keys match best. ") * 8


def _prompts(lm: LoadedModel, requests: list[Request]) -> list[list[int]]:
    ids = lm.encode(TEXT)
    return [(ids[7 * r.rid:] + ids)[: r.prompt_len] for r in requests]


def run_engine(lm: LoadedModel, requests: list[Request], *, num_blocks: int, block_size: int, max_num_seqs: int,
               lock=None) -> list[dict]:
    """Drive the real engine; one record per step: admitted / preempted / finished ids, blocks used, queue sizes.
    Its KV-cache groups are the model's (``app.cache.spec``): a sliding-window model's local layers give blocks back."""
    engine = PagedEngine(lm, num_blocks=num_blocks, block_size=block_size, max_sequences=len(requests) + 1,
                         preemption="auto", max_num_seqs=max_num_seqs, ignore_eos=True, lock=lock)
    prompts = _prompts(lm, requests)
    pending = sorted(requests, key=lambda r: (r.arrival, r.rid))
    seq_of: dict[int, int] = {}  # engine seq id -> request id
    records: list[dict] = []
    now = 0.0

    def live() -> bool:
        return any(s.status in (RUNNING, WAITING) for s in engine.sequences.values())

    while pending or live():
        if not live() and pending[0].arrival > now:
            now = pending[0].arrival
        while pending and pending[0].arrival <= now:
            r = pending.pop(0)
            seq_of[engine.add(prompts[r.rid], r.output_len, admit=False).seq_id] = r.rid
        before = {i: (s.status, s.preemptions) for i, s in engine.sequences.items()}
        engine.step()
        moved: dict[str, list[int]] = {"admitted": [], "preempted": [], "finished": []}
        for i, s in engine.sequences.items():
            status, preemptions = before[i]
            if s.preemptions > preemptions:
                moved["preempted"].append(seq_of[i])
            if status == WAITING and s.status in (RUNNING, FINISHED) and s.preemptions == preemptions:
                moved["admitted"].append(seq_of[i])
            if status != FINISHED and s.status == FINISHED:
                moved["finished"].append(seq_of[i])
        rec: dict[str, object] = {k: sorted(v) for k, v in moved.items()}
        rec["blocks_used"] = engine.cache.num_used_blocks
        rec["running"] = sum(s.status == RUNNING for s in engine.sequences.values())
        rec["waiting"] = len(engine.waiting)
        records.append(rec)
        now += 1
    return records


def run_simulator(requests: list[Request], *, num_blocks: int, block_size: int, max_num_seqs: int,
                  groups: tuple[KVCacheSpec, ...] = ()) -> list[dict]:
    """The simulator over the same budgets and KV-cache groups (``groups``: each group's spec, the engine's)."""
    budget = sum(r.prompt_len + r.output_len for r in requests) + 1  # never binding: the engine has no token budget
    cfg = SimConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                    max_num_seqs=max_num_seqs, chunked_prefill=False, prefix_caching=False, groups=groups)
    sim = Simulator(cfg, requests).run()
    return [{"admitted": sorted(s.admitted), "preempted": sorted(s.preempted), "finished": sorted(s.finished),
             "blocks_used": s.blocks_used, "running": s.running, "waiting": s.waiting} for s in sim.steps]


def compare(lm: LoadedModel, requests: list[Request], *, num_blocks: int, block_size: int, max_num_seqs: int,
            max_requests: int, max_prompt: int, max_output: int, lock=None) -> dict:
    """Both sides, step by step, and where (if anywhere) they first differ. At most ``max_requests`` requests of
    at most ``max_prompt`` prompt and ``max_output`` output tokens (``Settings.capacity_check_*``)."""
    if not 1 <= len(requests) <= max_requests:
        raise BadInput("err.capacity.check_requests", limit=max_requests)
    for r in requests:
        if r.prompt_len > max_prompt or r.output_len > max_output:
            raise BadInput("err.capacity.check_sizes", prompt=max_prompt, output=max_output)
        if r.prompt_len + r.output_len > lm.max_positions:
            raise BadInput("err.capacity.check_positions", model=lm.name, positions=lm.max_positions)
    requests = [Request(i, r.arrival, r.prompt_len, r.output_len) for i, r in
                enumerate(sorted(requests, key=lambda r: (r.arrival, r.rid)))]
    groups = tuple(g.spec for g in kv_cache_groups(from_adapter(lm.adapter)))  # the engine's groups, from the specs
    sim = run_simulator(requests, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                        groups=groups)
    real = run_engine(lm, requests, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                      lock=lock)
    rows = []
    first = None
    for k in range(max(len(sim), len(real))):
        a = sim[k] if k < len(sim) else None
        b = real[k] if k < len(real) else None
        same = a == b
        if not same and first is None:
            first = k
        rows.append({"step": k, "simulator": a, "engine": b, "same": same})
    return {"model": lm.name, "num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": max_num_seqs,
            "requests": [r.__dict__ for r in requests], "rows": rows, "first_difference": first,
            "equal": first is None, "preemptions": sum(len(r["preempted"]) for r in real)}
