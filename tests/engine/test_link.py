"""The link to an engine's sockets, against a pyzmq publisher of vLLM's shape (tests/engine/publisher.py): catching
up through replay on connect, a gap filled by replay, a restart, garbage on the socket, an endpoint where nothing
listens. The same link against a real vLLM, killed and started again, is in test_real_engine.py."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engine.events import BadEvents
from app.engine.launch import free_port, free_port_pair
from app.engine.link import EngineDown, EngineLink, LinkLimits
from app.errors import Busy
from app.labs.engine import EngineLab, EngineLimits
from app.settings import Settings
from tests.engine.frames import frames, removed, stored
from tests.engine.hostile import HostileEngine, metrics, vllm_answers
from tests.engine.publisher import Publisher, wait_for
from tests.engine.strategies import messages

LIMITS = LinkLimits(poll_s=0.2, http_timeout_s=0.5, replay_timeout_s=2.0)


@pytest.fixture
def publisher():
    p = Publisher()
    yield p
    p.close()


def make_link(events: str, replay: str | None) -> EngineLink:
    # No HTTP API behind this publisher: the metrics say "unreachable", the events are what is tested.
    return EngineLink(name="test", url=f"http://127.0.0.1:{free_port()}", events=events, replay=replay, limits=LIMITS)


def block(seq: int) -> list:
    return [stored([1000 + seq], None, range(4))]


def test_catch_up_on_connect_then_live_then_a_gap_filled_by_replay(publisher):
    for seq in range(3):  # published before KVScope connected: only replay has them
        publisher.publish(seq, block(seq))
    link = make_link(publisher.events, publisher.replay)
    link.start()
    try:
        assert wait_for(lambda: link.mirror.batches == 3)
        assert link.mirror.replayed == 3 and link.events_connected
        publisher.publish(3, block(3))
        assert wait_for(lambda: link.mirror.batches == 4)
        publisher.publish(4, block(4), send=False)  # lost on the way
        publisher.publish(5, block(5), send=False)
        publisher.publish(6, block(6) + [removed([1000])])
        assert wait_for(lambda: link.mirror.batches == 7)
        m = link.mirror
        assert m.gaps == [] and m.next_seq == 7
        assert m.hashes() == {1001, 1002, 1003, 1004, 1005, 1006}  # 1000 stored, then removed: order kept
        assert m.replayed == 5  # 0-2 on connect, 4-5 for the gap
    finally:
        link.stop()


def test_a_gap_replay_cannot_fill_is_recorded(publisher):
    link = make_link(publisher.events, None)  # no replay socket
    link.start()
    try:
        assert wait_for(lambda: link.events_connected)
        assert wait_for(lambda: (publisher.publish(0, block(0)), link.mirror.batches >= 1)[1], timeout=5)
        first = link.mirror.next_seq
        publisher.publish(first + 3, block(first + 3))
        assert wait_for(lambda: link.mirror.gaps == [(first, first + 2)])
    finally:
        link.stop()


def test_a_restarted_engine_empties_the_mirror(publisher):
    link = make_link(publisher.events, publisher.replay)
    link.start()
    try:
        assert wait_for(lambda: link.events_connected)
        for seq in range(3):
            publisher.publish(seq, block(seq))
        assert wait_for(lambda: link.mirror.batches == 3)
        publisher.buffer.clear()  # a new process: an empty replay buffer, sequence numbers from 0
        publisher.publish(0, [stored([42], None, range(4))], ts=100.0)  # batch 0 again, at another time
        assert wait_for(lambda: link.mirror.restarts == 1 and link.mirror.hashes() == {42})
    finally:
        link.stop()


def test_garbage_on_the_socket_is_counted_and_named_and_the_stream_goes_on(publisher):
    link = make_link(publisher.events, publisher.replay)
    link.start()
    try:
        assert wait_for(lambda: link.events_connected)
        # A PUB drops what it sends before the SUB's subscription reaches it (connected is not yet subscribed):
        # batches until one is heard live prove the subscription; then the garbage cannot be lost on the way.
        seq = 0
        while link.mirror.batches == link.mirror.replayed and seq < 100:
            publisher.publish(seq, block(seq))
            seq += 1
            wait_for(lambda: link.mirror.batches > link.mirror.replayed, timeout=0.2)
        assert link.mirror.batches > link.mirror.replayed
        publisher.send_raw([b"kv-events", seq.to_bytes(8, "big"), b"\xc1\xc1 not msgpack"])
        publisher.send_raw([b"only one frame"])
        assert wait_for(lambda: link.event_errors == 2)
        assert link.last_event_error[0] == "err.engine.frames"
        publisher.publish(seq, block(seq))
        assert wait_for(lambda: link.mirror.hashes() == {1000 + s for s in range(seq + 1)})
    finally:
        link.stop()


def test_an_endpoint_where_nothing_listens_says_so():
    port = free_port_pair()
    link = make_link(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    link.start()
    try:
        assert wait_for(lambda: link.http_status is not None and link.http_status[0] == "err.engine.unreachable")
        assert not link.events_connected and link.mirror.batches == 0
    finally:
        link.stop()


def test_a_batch_the_sub_never_heard_is_fetched_by_the_idle_catch_up(publisher):
    link = make_link(publisher.events, publisher.replay)
    link.start()
    try:
        assert wait_for(lambda: link.events_connected and publisher.replays == 1)  # the catch-up on connect: done
        publisher.publish(0, block(0), send=False)  # lost on the way, and no later batch reveals the gap
        assert wait_for(lambda: link.mirror.hashes() == {1000}, timeout=10)
        assert publisher.replays >= 2 and link.mirror.replayed == 1 and link.mirror.gaps == []
    finally:
        link.stop()


# --- whatever the engine sends, the link goes on (issue: one badly typed field ended it for good) -----------------
BAD = [stored([7], None, range(4), medium=["GPU"]), stored([7], None, range(4), group=[0]),
       stored([7], None, ["abc"] * 4), stored([7], None, [0, None, 2, 3]), stored([7], None, range(4), extra_keys=7),
       removed([7], medium=["GPU"])]


def heard_live(publisher: Publisher, link: EngineLink, seq: int) -> int:
    """Publish blocks from ``seq`` until one is heard live (a PUB drops what it sends before the SUB's subscription
    reaches it); the next sequence number."""
    while link.mirror.batches == link.mirror.replayed and seq < 200:
        publisher.publish(seq, block(seq))
        seq += 1
        wait_for(lambda: link.mirror.batches > link.mirror.replayed, timeout=0.2)
    assert link.mirror.batches > link.mirror.replayed
    return seq


def test_badly_typed_batches_are_skipped_and_named_on_catch_up_and_live(publisher):
    publisher.publish(0, block(0))
    for i, ev in enumerate(BAD):  # still in the engine's replay buffer when KVScope (re)starts: its catch-up
        publisher.publish(1 + i, [ev])
    n = 1 + len(BAD)
    publisher.publish(n, block(n))
    link = make_link(publisher.events, publisher.replay)
    link.start()
    try:
        assert wait_for(lambda: link.mirror.hashes() == {1000, 1000 + n})
        assert link.event_errors == len(BAD)
        key, params, seq, event = link.last_event_error
        assert (seq, event) == (n - 1, 0) and "medium" in BadEvents(key, **params).message
        seq = heard_live(publisher, link, n + 1)
        publisher.publish(seq, [stored([5], None, range(4)), stored([6], None, range(4), group="x")])
        publisher.publish(seq + 1, block(seq + 1))
        assert wait_for(lambda: 1000 + seq + 1 in link.mirror.hashes())
        assert 5 not in link.mirror.hashes()  # a bad batch is skipped whole: never half applied
        assert link.last_event_error[2:] == (seq, 1) and link.event_errors == len(BAD) + 1  # replayed: counted once
        assert link.mirror.gaps == [(seq, seq)]  # what that batch did is unknown: a gap, said on the page
        assert link.alive() == {"events": True, "http": True} and not link.thread_failures
    finally:
        link.stop()


def test_a_link_thread_that_fails_anyway_is_started_again_and_says_so(hostile, tmp_path):
    # An endpoint zmq refuses at connect (settings would refuse it too): a real exception inside the events loop.
    link = EngineLink(name="test", url=hostile.url, events="tcp://127.0.0.1:not-a-port", replay=None, limits=LIMITS)
    lab = EngineLab(limits=EngineLimits.of(Settings(home=tmp_path)), links=[link])
    link.start()
    try:
        assert wait_for(lambda: link.thread_failures.get("events", 0) >= 2, timeout=10)
        assert link.last_thread_failure == ("events", "ZMQError")
        assert link.alive() == {"events": True, "http": True}  # the same supervised threads, never ended
        assert polls(hostile, 2) and link.http_status is None  # the metrics poll fine meanwhile, yet the page
        keys = [s["key"] for s in lab.status(link, "en")]  # says what happened, never "connected"
        assert "engine.status.events_restarted" in keys and "engine.status.ok" not in keys
    finally:
        link.stop()
    assert link.alive() == {}


@pytest.fixture
def hostile():
    h = HostileEngine()
    yield h
    h.close()


def polls(h: HostileEngine, n: int) -> bool:
    """Wait for ``n`` more /metrics polls: the HTTP thread is alive and polling."""
    start = h.count("/metrics")
    return wait_for(lambda: h.count("/metrics") >= start + n, timeout=10)


def test_the_http_thread_survives_whatever_the_api_answers(publisher, hostile):
    hostile.answer("/metrics", metrics('vllm:num_requests_waiting{engine="1"} +Inf\n', block_size="inf")
                   .replace("} 0.25", "} NaN"))
    hostile.answer("/v1/models", {"data": []})  # asked once, before the first /detokenize
    link = EngineLink(name="test", url=hostile.url, events=publisher.events, replay=publisher.replay, limits=LIMITS)
    link.start()
    try:
        assert polls(hostile, 3) and link.http_status is None
        assert link.metrics.usage is None and link.metrics.waiting is None
        assert link.metrics.config_int("block_size") is None
        assert wait_for(lambda: link.events_connected)
        seq = heard_live(publisher, link, 0)
        assert wait_for(lambda: link.texts_failed >= 1)
        failed = link.texts_failed
        for models in ([{"id": "m"}], {"data": [{"id": 5}]}):
            hostile.answer("/v1/models", models)
            publisher.publish(seq, block(seq))
            seq += 1
            assert wait_for(lambda f=failed: link.texts_failed > f), models
            failed = link.texts_failed
        hostile.answer("/v1/models", vllm_answers()["/v1/models"][1])
        hostile.answer("/detokenize", ["a list"])
        publisher.publish(seq, block(seq))
        assert wait_for(lambda: link.texts_failed > failed and hostile.count("/detokenize") >= 1)
        hostile.answer("/detokenize", {"prompt": "at last"})
        publisher.publish(seq + 1, block(seq + 1))
        assert wait_for(lambda: getattr(link.mirror.blocks.get((0, "GPU", 1000 + seq + 1)), "text", None) == "at last")
        assert polls(hostile, 2) and link.alive() == {"events": True, "http": True} and not link.thread_failures
    finally:
        link.stop()


def test_one_failed_metrics_poll_is_not_an_engine_restart_and_counters_going_back_are(publisher, hostile):
    link = EngineLink(name="test", url=hostile.url, events=publisher.events, replay=publisher.replay, limits=LIMITS)
    publisher.publish(0, block(0))
    link.start()
    try:
        assert wait_for(lambda: link.mirror.hashes() == {1000} and link.metrics is not None)
        good = vllm_answers()["/metrics"][1]
        hostile.answer("/metrics", "Internal Server Error", status=500)
        assert polls(hostile, 1) and wait_for(lambda: link.http_status is not None)
        assert link.http_status[0] == "err.engine.http_status"
        hostile.answer("/metrics", good)
        assert polls(hostile, 3) and link.http_status is None
        assert link.mirror.restarts == 0 and link.mirror.hashes() == {1000}  # before: emptied and refilled
        publisher.buffer.clear()  # a new engine process: nothing buffered, its counters from 0
        hostile.answer("/metrics", good.decode().replace("} 64.0", "} 0.0").replace("} 32.0", "} 0.0"))
        assert wait_for(lambda: link.mirror.restarts == 1 and not link.mirror.blocks)
    finally:
        link.stop()


def test_the_texts_queue_is_bounded_and_the_newest_blocks_are_decoded_first(publisher, hostile):
    limits = LinkLimits(poll_s=0.2, http_timeout_s=0.5, replay_timeout_s=2.0, max_pending_texts=5, texts_per_loop=2)
    link = EngineLink(name="test", url=hostile.url, events=publisher.events, replay=publisher.replay, limits=limits)
    hashes = list(range(2000, 2050))
    # one batch: 50 blocks stored (45 more than the queue holds), then two of the newest five evicted
    publisher.publish(0, [stored(hashes, None, range(200)), removed(hashes[-2:])])
    link.start()
    try:
        assert wait_for(lambda: len(link.mirror.blocks) == 48)
        # the two evicted left the queue at once; of the 48 held, it kept the 5 newest and counted the others
        assert link.texts_dropped == 48 - 5
        assert wait_for(lambda: hostile.count("/detokenize") == 5)
        assert polls(hostile, 3) and hostile.count("/detokenize") == 5  # no call for a dropped or evicted block
        assert wait_for(lambda: all(b.text for b in list(link.mirror.blocks.values())[43:]))
        texts = {k[2]: b.text for k, b in link.mirror.blocks.items()}
        assert [h for h, t in texts.items() if t is not None] == hashes[43:48]
    finally:
        link.stop()


def test_streams_watching_a_link_are_bounded_and_a_forgotten_one_expires():
    link = EngineLink(name="test", url="http://127.0.0.1:9", events=None, replay=None,
                      limits=LinkLimits(max_streams=2, stream_max_s=-60.5))  # expired as soon as registered
    loop = asyncio.new_event_loop()
    try:
        link.watch(loop, asyncio.Event())
        link.watch(loop, asyncio.Event())  # the first expired already: pruned, not counted
        assert link.streams == 1
        link = EngineLink(name="test", url="http://127.0.0.1:9", events=None, replay=None,
                          limits=LinkLimits(max_streams=2))
        unwatch = link.watch(loop, asyncio.Event())
        link.watch(loop, asyncio.Event())
        with pytest.raises(Busy) as err:
            link.watch(loop, asyncio.Event())
        assert err.value.key == "err.engine.streams"
        unwatch()
        link.watch(loop, asyncio.Event())
        assert link.streams == 2
    finally:
        loop.close()


# --- fuzzing through a real socket: garbage of every kind, then a valid batch, which must be applied -----------------
@pytest.fixture(scope="module")
def fuzzed():
    """One publisher and one link for every example (a link starts in ~0.5 s), the subscription proven live."""
    p = Publisher()
    link = EngineLink(name="fuzz", url=f"http://127.0.0.1:{free_port()}", events=p.events, replay=p.replay,
                      limits=LinkLimits(poll_s=5.0, http_timeout_s=0.2, replay_timeout_s=1.0, max_block_size=64,
                                        max_message_bytes=2**20))
    link.start()
    assert wait_for(lambda: link.events_connected)
    heard_live(p, link, 0)
    yield p, link
    link.stop()
    p.close()


SENTINEL_SEQ = 2**62  # the highest number a batch may carry: after any garbage, a jump forward or a restart
sentinels = iter(range(10**6, 2 * 10**6))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(messages().filter(len), max_size=12), huge=st.booleans())  # zmq has no message of 0 frames
def test_after_any_garbage_on_the_socket_the_next_valid_batch_is_applied(fuzzed, msgs, huge):
    publisher, link = fuzzed
    for msg in msgs:
        publisher.send_raw(msg)
    if huge:  # over max_message_bytes: refused unread (msgpack would build a list of a million zeros)
        zeros = b"\xdd" + (2**20).to_bytes(4, "big") + b"\x00" * 2**20  # msgpack: an array of 2**20 zeros
        publisher.send_raw([b"kv-events", (5).to_bytes(8, "big"), zeros])
    h = next(sentinels)
    sentinel = frames(SENTINEL_SEQ, [stored([h], None, range(4))], ts=float(h))  # a time of its own: never a duplicate
    for _ in range(50):  # sent again until heard: what a PUB sends while the SUB (re)subscribes is lost
        publisher.send_raw(sentinel)
        if wait_for(lambda: h in link.mirror.hashes(), timeout=0.3):
            break
    assert h in link.mirror.hashes()
    assert link.alive() == {"events": True, "http": True} and not link.thread_failures


def test_an_answer_that_is_not_http_is_an_engine_down_not_an_exception():
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:  # answers every connection with bytes that are no HTTP status line
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"\x00\xffNOT HTTP\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    link = EngineLink(name="test", url=f"http://127.0.0.1:{server.getsockname()[1]}", events=None, replay=None,
                      limits=LIMITS)
    try:
        for call in (link.scrape, lambda: link.tokenize("hi")):
            with pytest.raises(EngineDown) as err:  # before: http.client.BadStatusLine escaped (a 500 on a route)
                call()
            assert err.value.key == "err.engine.unreachable"
    finally:
        stop.set()
        thread.join()
        server.close()
