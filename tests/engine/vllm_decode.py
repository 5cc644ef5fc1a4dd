"""Run in the engine's venv: decode captured KV-event frames with vLLM's own msgspec classes.

stdin: a msgpack list of [topic, seq bytes, payload] frames; stdout: JSON, one entry per frame:
{"seq": int, "ts": float, "rank": int | None, "events": [msgspec.to_builtins(event) + {"type": name}]}.
"""

import json
import sys

import msgspec
from vllm.distributed.kv_events import KVEventBatch

decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
for _topic, seq, payload in msgspec.msgpack.decode(sys.stdin.buffer.read()):
    batch = decoder.decode(payload)
    events = []
    for ev in batch.events:
        d = {f: getattr(ev, f) for f in ev.__struct_fields__}
        d["type"] = type(ev).__name__
        events.append(msgspec.to_builtins(d))
    out.append({"seq": int.from_bytes(seq, "big"), "ts": batch.ts, "rank": batch.data_parallel_rank,
                "events": events})
json.dump(out, sys.stdout)
