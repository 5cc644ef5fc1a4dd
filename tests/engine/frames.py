"""KV-event frames built by hand in vLLM 0.32's layout (msgspec: the batch an array, each event a map tagged by
"type", defaults omitted), for a test publisher. ``test_real_engine.py`` decodes these with vLLM's own classes too,
so the layout here is checked against the real one, not assumed."""

from __future__ import annotations

import msgpack

TOPIC = b"kv-events"


def stored(hashes, parent, tokens, block_size=4, group=0, medium="GPU", kind="full_attention", window=None, **extra):
    ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, "token_ids": list(tokens),
          "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None,
          "extra_keys": [None] * len(hashes), "group_idx": group, "kv_cache_spec_kind": kind}
    if window is not None:
        ev["kv_cache_spec_sliding_window"] = window
    ev.update(extra)
    return ev


def removed(hashes, group=0, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group}


def cleared():
    return {"type": "AllBlocksCleared"}


def payload(events, ts=1.0, rank=0) -> bytes:
    return msgpack.packb([ts, events, rank])


def frames(seq, events, ts=None, rank=0, topic=TOPIC) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload(events, float(seq) if ts is None else ts, rank)]
