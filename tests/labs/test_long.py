"""The long capture's climb in the lab: each layer's overview kept under the job for the browsers that asked, the
zoom lab's pyramids seeded with them once done (the tiles a fresh pyramid pools), none of it left by a stop."""

from __future__ import annotations

import pytest
import torch

from app.errors import BadInput, NotFound
from app.labs.queue import DONE
from app.quota import Requester
from app.viz.attention import sqrt_u8
from app.viz.zoom import HeadPyramid
from tests.conftest import long_capture_stopped_at, make_state

PROMPT = " ".join(f"word{i} and the cat sat on the mat" for i in range(80))  # ~620 GPT-2 tokens


@pytest.fixture
def st(settings, distil):
    st = make_state(settings, distil)
    yield st
    st.stop_labs()


def test_a_done_capture_keeps_each_layer_and_seeds_the_zoom_pyramids(st, distil):
    a = Requester("a", "1")
    job = st.long.submit(distil, distil.encode(PROMPT), who=a)
    result = st.long.line.wait(job, "a")
    assert job.status == DONE and job.progress["climbed"] == distil.adapter.n_layer
    _, trace = st.trace_by_key(result["key"])
    for layer in range(distil.adapter.n_layer):
        meta, cells = st.long.climbed(job.id, layer, owner="a")
        head = meta["head"]
        seeded = st.zoom.tile(result["key"], layer=layer, head=head, level=0, row=0, col=0, pool="max", who=a)
        assert cells == sqrt_u8(seeded).numpy().tobytes()  # the page draws what the zoom page opens with
        fresh = HeadPyramid(trace.n_tokens, trace.total_length).tile(
            lambda r, c, layer=layer, head=head: trace.attention_block(layer, head, r, c), 0, 0, 0, "max")
        # the part's q, k and lse are the finished trace's (layer_part); the pooled max is one exp per cell
        # against the max of the block's exps: an ulp of exp (~1.2e-7 relative) at most
        torch.testing.assert_close(seeded, fresh, rtol=1e-6, atol=0)
    assert st.zoom.pyramid_bases(result["key"]) == {}  # the opening tiles came from the climb: no pass was made
    with pytest.raises(BadInput):
        st.long.climbed(job.id, distil.adapter.n_layer, owner="a")
    with pytest.raises(NotFound):  # another browser's capture
        st.long.climbed(job.id, 0, owner="b")
    with pytest.raises(NotFound):
        st.long.climbed("nope", 0, owner="a")


def test_a_browser_joining_a_running_capture_sees_its_climb(st, distil):
    st.model_lock.acquire()  # both ask while the first waits at the gate: the second joins the same run
    try:
        one = st.long.submit(distil, distil.encode(PROMPT), who=Requester("a", "1"))
        two = st.long.submit(distil, distil.encode(PROMPT), who=Requester("b", "2"))
    finally:
        st.model_lock.release()
    assert one is two
    st.long.line.wait(one, "a")
    st.long.line.wait(two, "b")
    assert st.long.climbed(one.id, 0, owner="b") == st.long.climbed(one.id, 0, owner="a")


def test_a_stopped_capture_keeps_no_climb(st, distil):
    job = long_capture_stopped_at(st, distil, distil.encode(PROMPT), 2)
    assert job.status == "stopped" and job.progress["climbed"] == 2  # two layers were drawn before the stop
    with pytest.raises(NotFound):
        st.long.climbed(job.id, 0, owner="a")
    assert len(st.traces) == 0 and st.zoom.nbytes() == 0  # nothing was seeded
