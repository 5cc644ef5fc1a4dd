"""Hypothesis strategies for what an engine's KV-event socket may carry: valid events and batches in vLLM's layout
(``frames.py``), the same with fields replaced by junk, dropped or added, truncated payloads, messages of the wrong
number of frames, sequence numbers out of order or out of range."""

from __future__ import annotations

import msgpack
from hypothesis import strategies as st

from tests.engine.frames import cleared, removed, stored

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=12), st.binary(max_size=12))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=4), max_leaves=12)


@st.composite
def events(draw) -> dict:
    """A valid event, or one whose fields were replaced, dropped or added at random."""
    n, size = draw(st.integers(0, 3)), draw(st.sampled_from([1, 2, 4, 16]))
    hashes = draw(st.lists(st.integers(0, 2**64 - 1) | st.binary(min_size=1, max_size=40), min_size=n, max_size=n))
    ev = draw(st.sampled_from([
        stored(hashes, draw(st.none() | st.integers(0, 2**64 - 1)),
               draw(st.lists(st.integers(0, 50_000), min_size=n * size, max_size=n * size)), block_size=size,
               group=draw(st.integers(0, 3)), medium=draw(st.sampled_from(["GPU", "CPU", None])),
               kind=draw(st.sampled_from(["full_attention", "sliding_window", None])),
               window=draw(st.none() | st.integers(1, 4096))),
        removed(hashes, group=draw(st.integers(0, 3))), cleared(), {"type": draw(st.text(max_size=10))}]))
    mutations = st.lists(st.sampled_from(sorted(ev) + ["extra_keys", "lora_id", "zz"]), max_size=2)
    for key in draw(st.just([]) | mutations):
        if draw(st.booleans()):
            ev[key] = draw(JUNK)
        else:
            ev.pop(key, None)
    return ev


@st.composite
def messages(draw) -> list[bytes]:
    """One ZMQ message: valid, badly typed, truncated, huge, out of order or not one at all."""
    seq = draw(st.integers(0, 20) | st.integers(0, 20) | st.integers(-3, 2**63 - 1))
    batch = st.builds(lambda evs, ts, rank: [ts, evs, rank], st.lists(events(), max_size=4),
                      st.floats(0, 1e10) | st.floats(0, 1e10) | SCALARS, st.none() | st.integers(0, 7) | SCALARS)
    body = draw(st.one_of(batch, batch, batch, JUNK))
    payload = msgpack.packb(body, use_bin_type=True)
    cut = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, max(0, len(payload) - 1))))
    if cut is not None:  # truncated on the way
        payload = payload[:cut]
    parts = [b"kv-events", seq.to_bytes(8, "big", signed=True) if -2**63 <= seq < 2**63 else b"", payload]
    shape = draw(st.sampled_from(["three"] * 7 + ["fewer", "more", "short-seq"]))
    if shape == "fewer":
        parts = parts[:draw(st.integers(0, 2))]
    elif shape == "more":
        parts.append(draw(st.binary(max_size=8)))
    elif shape == "short-seq":
        parts[1] = parts[1][:draw(st.integers(0, 7))]
    return parts
