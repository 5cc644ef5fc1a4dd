"""A test publisher with pyzmq in vLLM's shape: PUB on one port, a ROUTER on the next answering replay requests
from its buffer (``ZmqEventPublisher._service_replay``: (id, b"", start) -> (id, b"", topic, seq, payload) per batch,
then the end marker with seq -1). It can also send garbage, skip batches (a gap) or restart its sequence."""

from __future__ import annotations

import threading
import time

import zmq

from app.engine.launch import free_port_pair
from tests.engine.frames import frames

END = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    def __init__(self) -> None:
        self.port = free_port_pair()
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)  # as vLLM's ZmqEventPublisher (hwm=100_000): pyzmq's 1 000 drops bursts
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.port + 1}")
        self.buffer: list[list[bytes]] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.replays = 0
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.port + 1}"

    def publish(self, seq: int, events: list, *, send: bool = True, ts: float | None = None) -> None:
        """Buffer a batch for replay and (unless ``send`` is False: lost on the way) publish it."""
        msg = frames(seq, events, ts=ts)
        with self.lock:
            self.buffer.append(msg)
            if send:
                self.pub.send_multipart(msg)

    def send_raw(self, parts: list[bytes]) -> None:
        with self.lock:
            self.pub.send_multipart(parts)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            with self.lock:
                self.replays += 1
                for msg in self.buffer:
                    if int.from_bytes(msg[1], "big") >= start_seq:
                        self.router.send_multipart([client, b"", *msg])
                self.router.send_multipart([client, b"", b"", END, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def wait_for(cond, timeout=10.0, step=0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


class GarbageRelay:
    """A second publisher on the link's socket kind (a PUB we bind), for a real engine: it relays every message of
    the engine's PUB unchanged and publishes ``garbage`` (a list of messages, sent round-robin) between them and
    every ``every_s`` while the engine is quiet. A SUB that connects to it hears what a SUB connected to the engine
    and to a second, broken publisher hears: both streams fair-queued into one."""

    def __init__(self, events: str, garbage: list[list[bytes]], every_s: float = 0.05) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(events)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.garbage, self.every_s = garbage, every_s
        self.relayed = self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _junk(self) -> None:
        self.pub.send_multipart(self.garbage[self.sent % len(self.garbage)])
        self.sent += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(int(self.every_s * 1000)):
                self.pub.send_multipart(self.sub.recv_multipart())
                self.relayed += 1
            self._junk()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sub.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()
