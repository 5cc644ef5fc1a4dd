"""A long capture lets short work through between its layers (``layer_pauses``, ``ModelGate.yield_turn``), and
neither run is changed by the other: the capture's hooks fire for its own thread only, its attention switch is
undone around the hand-over.

The second thread's work (a decode step, an ablated-head forward, a plain forward returning eager attention
weights) runs while the capture is suspended between two layers: the events' order proves it. Both results are
compared with the same work run alone: the capture (main thread both times) exactly, the same ops on the same
shapes in the same thread; the short work, which runs on a worker thread, with its run alone on a fresh thread too
and within fp32 reordering noise (tests/numerics.py: another thread may split a BLAS sum differently).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from app.admission import ModelGate
from app.model.ablation import ablated_last_logits
from app.model.capture import fill_cache, hook_count, run_traced
from tests.live import in_fresh_thread
from tests.numerics import thread_close

LONG_PROMPT = "The cat sat on the mat because the mat was warm and the cat was tired after a long day of play"
SHORT_PREFIX = "Once upon a time"
ABLATE = {1: [0, 2]}


def short_work(lm, cache) -> dict[str, torch.Tensor]:
    """What another browser does: one decode step after its prompt, an ablated-head run, a plain forward."""
    ids = lm.encode(SHORT_PREFIX)
    with torch.no_grad():
        step = run_traced(lm.model, lm.adapter, ids[-1:], lm.token_texts(ids[-1:]), cache=cache, all_logits=False)
        ablated = ablated_last_logits(lm, ids, ABLATE)
        plain = lm.model(input_ids=torch.tensor([ids]), output_attentions=True)
    out = {f"step.{k}": v for k, v in step.tensors.items()}
    out["ablated"] = ablated
    out["plain.logits"] = plain.logits
    for i, a in enumerate(plain.attentions or ()):
        out[f"plain.attn.{i}"] = a  # eager weights (B, H, T, T) where the model attends eagerly
    return out


def prefilled(lm):
    ids = lm.encode(SHORT_PREFIX)
    return fill_cache(lm.model, ids[:-1])


def capture_alone(lm):
    ids = lm.encode(LONG_PROMPT)
    return run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids), keep_cache=False)


def interleaved(lm, gate: ModelGate):
    """The capture holds ``gate`` for long work; at the end of layer 0 it starts the short work and waits until it
    queues; the pause before layer 1 lets it through. Returns (capture, short results, order of events)."""
    ids = lm.encode(LONG_PROMPT)
    order: list[str] = []
    results: dict = {}
    cache = prefilled(lm)

    def other() -> None:
        with gate.short():
            results.update(short_work(lm, cache))
        order.append("short done")

    started: list[threading.Thread] = []

    def at_layer_0(_x):
        if not started:
            t = threading.Thread(target=other)
            started.append(t)
            t.start()
            deadline = time.monotonic() + 30
            while gate.waiting() < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        return None  # read only: the capture's tensors are untouched

    def at_last_layer(_x):
        order.append("capture last layer")
        return None

    last = lm.adapter.n_layer - 1
    assert last >= 1
    edits = [(lm.adapter.patch_point("resid", 0), at_layer_0), (lm.adapter.patch_point("resid", last), at_last_layer)]
    with gate, lm.adapter.intervene(edits):
        trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids), keep_cache=False)
    order.append("capture done")
    started[0].join(timeout=60)
    return trace, results, order


@pytest.fixture(params=["distil", "llama"])
def lm(request):
    return request.getfixturevalue(request.param)


def test_short_work_runs_between_layers_and_both_equal_their_runs_alone(lm):
    alone_capture = capture_alone(lm)
    cache = prefilled(lm)
    alone_short = in_fresh_thread(lambda: short_work(lm, cache))
    hooks = hook_count(lm.model)
    impl = lm.model.config._attn_implementation
    gate = ModelGate(max_wait_s=60)

    trace, results, order = interleaved(lm, gate)

    assert order == ["short done", "capture last layer", "capture done"]  # it ran while the capture was suspended
    assert gate.yields == 1
    assert hook_count(lm.model) == hooks and lm.model.config._attn_implementation == impl
    # the capture: same ops, same shapes, same order, same (main) thread as alone: equal exactly
    assert trace.tensors.keys() == alone_capture.tensors.keys()
    for name, t in alone_capture.tensors.items():
        assert torch.equal(trace.tensors[name], t), name
    assert results.keys() == alone_short.keys()
    for name, t in alone_short.items():  # worker thread vs fresh thread: within reordering noise
        assert thread_close(results[name], t), name
    if impl == "eager":  # the plain forward in between got eager weights, not the capture's log-sum-exps
        assert results["plain.attn.0"].dim() == 4


def test_without_yielding_short_work_waits_for_the_whole_capture(lm):
    """``yield_long=False`` (the behaviour before, the bench's baseline): the short work runs after the capture."""
    gate = ModelGate(max_wait_s=60, yield_long=False)
    _, results, order = interleaved(lm, gate)
    assert order == ["capture last layer", "capture done", "short done"]
    assert gate.yields == 0 and results


def test_a_capture_outside_the_gate_or_under_short_work_never_pauses(distil):
    gate = ModelGate()
    with gate.short():  # short work holding the gate does not hand it to other short work mid-forward
        before = gate.served
        capture_alone(distil)
    assert gate.yields == 0 and gate.served == before
    capture_alone(distil)  # no gate held at all: the pause points are no-ops
    assert gate.yields == 0


# --- a steady stream of short work: the capture still progresses within the bound, and Stop stops it -------------

def parts_per_layer(lm) -> int:
    """The pause points one layer's forward passes (``layer_pauses``: one per distinct module of the block)."""
    return len({id(p.module) for p in lm.adapter.hook_points() if p.name.startswith("blocks.0.")})


def stepping_browsers(lm, gate: ModelGate, n: int, done: threading.Event) -> tuple[list[threading.Thread], list[int]]:
    """``n`` browsers each running a short forward as short work again as soon as the last one ended."""
    served = [0]
    lock = threading.Lock()
    ids = torch.tensor([lm.encode(SHORT_PREFIX)])

    def browser():
        while not done.is_set():
            with gate.short(), torch.no_grad():
                lm.model(input_ids=ids)
                with lock:
                    served[0] += 1

    ts = [threading.Thread(target=browser) for _ in range(n)]
    for t in ts:
        t.start()
    return ts, served


def capture_in_line(lm, gate: ModelGate, served: list[int], *, stop_at_layer: int | None = None):
    """The long capture as the long-prompt lab runs it: a job in a line, holding the gate with its cancel flag.
    Returns the job, the line and the short requests served when each layer began."""
    from app.labs.queue import LabQueue

    line = LabQueue(name="long", gate=gate, max_queued=4, max_wait_s=600, max_run_s=600)
    ids = lm.encode(LONG_PROMPT)
    at_layer: list[int] = []

    def on_layer(layer: int):
        def hook(*_):
            at_layer.append(served[0])
            if stop_at_layer is not None and layer == stop_at_layer:
                line.stop(line.running().id, None)  # Stop, pressed while the browsers keep stepping

        return hook

    from app.model.adapters import for_this_thread

    first: dict[int, torch.nn.Module] = {}  # each layer's first hooked module (as the long lab's progress reads it)
    for p in lm.adapter.hook_points():
        if p.name.startswith("blocks."):
            first.setdefault(int(p.name.split(".")[1]), p.module)

    def work(pace):
        # In the line's worker thread, before the capture's own pause hooks: on a layer's first module this fires
        # first, for this thread's forward only (not the browsers' in between).
        handles = [m.register_forward_pre_hook(for_this_thread(on_layer(i))) for i, m in first.items()]
        try:
            with pace.piece():
                return run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids), keep_cache=False)
        finally:
            for h in handles:
                h.remove()

    job = line.submit(work, units=1)
    assert line.wait_idle(120)
    return job, at_layer


def test_a_capture_under_steady_decode_steps_runs_a_part_per_n_steps(lm):
    n = 2
    gate = ModelGate(max_waiting=64, per_owner=64, short_per_long=n)
    done = threading.Event()
    browsers, served = stepping_browsers(lm, gate, 3, done)
    try:
        job, at_layer = capture_in_line(lm, gate, served)
    finally:
        done.set()
        for t in browsers:
            t.join(30)
    assert job.status == "done" and len(at_layer) == lm.adapter.n_layer
    gaps = [b - a for a, b in zip(at_layer, at_layer[1:], strict=False)]
    assert max(gaps) <= n * parts_per_layer(lm)  # short requests between two layers' starts: within the bound
    assert served[0] > at_layer[-1]  # the browsers stepped all along


def test_stop_ends_a_capture_at_its_next_pause_point_under_steady_steps(lm):
    gate = ModelGate(max_waiting=64, per_owner=64, short_per_long=2)
    done = threading.Event()
    browsers, served = stepping_browsers(lm, gate, 3, done)
    try:
        job, at_layer = capture_in_line(lm, gate, served, stop_at_layer=1)
    finally:
        done.set()
        for t in browsers:
            t.join(30)
    assert job.status == "stopped" and len(at_layer) == 2  # layer 1 began, its first part never ran
    assert gate._holder is None
