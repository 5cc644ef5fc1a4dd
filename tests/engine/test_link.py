"""The link to an engine's sockets, against a pyzmq publisher of vLLM's shape (tests/engine/publisher.py): catching
up through replay on connect, a gap filled by replay, a restart, garbage on the socket, an endpoint where nothing
listens. The same link against a real vLLM, killed and started again, is in test_real_engine.py."""

from __future__ import annotations

import pytest

from app.engine.launch import free_port, free_port_pair
from app.engine.link import EngineLink, LinkLimits
from tests.engine.frames import removed, stored
from tests.engine.publisher import Publisher, wait_for

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
