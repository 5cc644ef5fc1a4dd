"""The Engine page's views on real mirror records: a link's mirror fed decoded event batches (vLLM 0.32's frames),
metrics parsed from vLLM-shaped /metrics text, fleet indexes and scores from the same mirrors, a drive's steps from
KVScope's own pool. (The lab that gathers them from live engines: tests/labs/test_engine.py.)"""

from __future__ import annotations

import json
import math

from app.engine.compare import Observed, Predictor, first_difference
from app.engine.drive import Drive, Step
from app.engine.events import decode_frames
from app.engine.fleet import EngineIndex, IndexBlock, fleet_chains, score
from app.engine.hashing import VllmBlockHasher
from app.engine.link import EngineLink, LinkLimits
from app.engine.metrics import EngineMetrics
from app.viz.engine import (
    calculator_line,
    catalog_model,
    drive_view,
    fleet_view,
    hex_id,
    json_line,
    metrics_view,
    route_row,
    route_view,
    scored_row,
    snapshot_view,
    status_lines,
    unroutable,
)
from tests.engine.frames import frames, removed, stored
from tests.engine.hostile import metrics

BS = 4
HASHER = VllmBlockHasher()


def link_with(*batches: list, url: str = "http://127.0.0.1:9", events: str | None = "tcp://127.0.0.1:9") -> EngineLink:
    """A link (never started: no socket, no thread) whose mirror applied ``batches`` in order, as its event thread
    applies them."""
    link = EngineLink(name="engine 0", url=url, events=events, replay=None, limits=LinkLimits())
    link.events_connected = events is not None
    link.http_status = None
    for seq, events_ in enumerate(batches):
        link.mirror.apply(decode_frames(frames(seq, events_)))
    return link


def index_of(i: int, link: EngineLink, usage: float | None = None) -> EngineIndex:
    blocks = {b.block_hash: IndexBlock(b.block_hash, b.parent, len(b.token_ids), b.text)
              for b in link.mirror.blocks.values() if b.group_idx == 0 and b.medium == "GPU"}
    return EngineIndex(index=i, name=f"engine {i}", block_size=BS, hash_algo="sha256", usage=usage, blocks=blocks)


def store(tokens: list[int]) -> dict:
    hashes = HASHER.request(tokens, BS)
    return stored(hashes, None, tokens[: len(hashes) * BS], block_size=BS)


def test_a_snapshot_shows_the_newest_blocks_oldest_first_with_their_ids_groups_and_changes():
    link = link_with([stored([1, 2], None, range(8))],
                     [stored([3], 2, range(4)), stored([9], None, range(4), group=1, kind="sliding_window", window=8)],
                     [removed([1])])
    view = snapshot_view(0, link, "en", streams=2, max_shown=2, most_pending_texts=10)
    assert [b["hash"] for b in view["blocks"]] == ["0000000000000003", "0000000000000009"]  # the newest two
    assert view["blocks"][0]["parent"] == "0000000000000002" and view["blocks"][1]["window"] == 8
    c = view["counts"]
    assert (c["held"], c["shown"], c["stored"], c["removed"], c["batches"], c["next_seq"], c["streams"]) == \
        (3, 2, 4, 1, 3, 3, 2)
    assert view["groups"] == [{"group": 0, "kind": "full_attention", "window": None, "held": 2},
                              {"group": 1, "kind": "sliding_window", "window": 8, "held": 1}]
    assert view["media"] == ["GPU"] and view["gaps"] == [] and view["block_size"] == BS
    ops = [(ch["op"], ch.get("hash")) for ch in view["changes"]]
    assert ops == [("stored", hex_id(1)), ("stored", hex_id(2)), ("stored", hex_id(3)), ("stored", hex_id(9)),
                   ("removed", hex_id(1))]
    assert view["version"] == link.mirror.version == len(ops)


def test_a_healthy_link_says_ok_with_its_counts_and_trouble_comes_first_in_each_language():
    link = link_with([stored([1], None, range(4))], [stored([2], 1, range(4))])
    assert status_lines(link, "en", most_pending_texts=10) == [
        {"level": "ok", "key": "engine.status.ok",
         "text": "Connected: 2 event batches applied (0 of them through the replay socket)."}]
    link.mirror.record_gap(5, 7)
    link.events_connected = False
    en = status_lines(link, "en", most_pending_texts=10)
    assert [s["key"] for s in en] == ["err.engine.events_unreachable", "engine.status.gaps"]
    assert "1 gaps in the event sequence (3 batches lost; first: 5–7)" in en[1]["text"]
    zh = status_lines(link, "zh", most_pending_texts=10)
    assert [s["key"] for s in zh] == [s["key"] for s in en] and "丢失 3 批" in zh[1]["text"]


def test_the_recent_hit_rate_is_the_change_over_the_last_minute_of_scrapes():
    old = EngineMetrics.of(metrics().replace("queries_total{engine=\"0\",model_name=\"smollm2\"} 64.0",
                                             "queries_total{engine=\"0\",model_name=\"smollm2\"} 24.0")
                           .replace("hits_total{engine=\"0\",model_name=\"smollm2\"} 32.0",
                                    "hits_total{engine=\"0\",model_name=\"smollm2\"} 22.0"))
    now = EngineMetrics.of(metrics())  # 64 queries, 32 hits
    view = metrics_view(now, [(100.0, old), (150.0, now)], now=150.0)
    assert view["hit_rate"] == 32 / 64
    assert view["hit_rate_recent"] == (32 - 22) / (64 - 24)  # both scrapes within the minute: from the older
    assert metrics_view(now, [(10.0, old)], now=150.0)["hit_rate_recent"] == 32 / 64  # none within: the lifetime
    assert view["config"]["block_size"] == "4" and view["config"]["sliding_window"] is None
    assert metrics_view(None, [], now=0.0) is None


def test_the_calculator_line_names_the_catalog_model_and_refuses_what_it_cannot_count():
    card = {"id": "smollm2", "root": "/models/SmolLM2-135M-Instruct", "max_model_len": 2048}
    model = catalog_model(card)
    assert model is not None and model.name == "SmolLM2-135M-Instruct"
    m = EngineMetrics.of(metrics())
    line = calculator_line(m, model, 2048, max_block_size=1024, batched_tokens=2048)
    assert line["model"] == model.name and line["block_size"] == BS and line["kv_memory_bytes"] == 2**20
    assert line["theirs"] == {"num_blocks": 64, "tokens": None, "max_concurrency": 2.0}  # the engine's labels
    # the blocks KVScope counts: the memory over one block of every layer's K and V, whole blocks only
    assert line["ours"]["num_blocks"] == 2**20 // line["block_bytes"]
    assert calculator_line(m, model, 2048, max_block_size=2, batched_tokens=2048) == {"model": None}
    assert calculator_line(EngineMetrics.of(metrics(cache_dtype="fp4")), model, 2048, max_block_size=1024,
                           batched_tokens=2048) == {"model": None}
    assert calculator_line(m, None, 2048, max_block_size=1024, batched_tokens=2048) == {"model": None}
    assert calculator_line(m, model, None, max_block_size=1024, batched_tokens=2048) == {"model": None}
    assert catalog_model({"id": "nothing-we-know", "root": None}) is None and catalog_model(None) is None


SHARED = list(range(100, 108))
A, B = SHARED + list(range(200, 208)), SHARED + list(range(300, 312))


def test_the_fleet_rows_say_how_deep_each_engine_holds_each_chain():
    links = [link_with([store(A)]), link_with([store(B)])]
    indexes = [(index_of(i, ln), True) for i, ln in enumerate(links)]
    chains, total = fleet_chains([ix for ix, _ in indexes], max_chains=10)
    view = fleet_view(indexes, links, chains, total)
    assert [e["held"] for e in view["engines"]] == [4, 5] and view["total"] == 2
    by_last = {c["last"]: c for c in view["chains"]}
    a, b = HASHER.request(A, BS), HASHER.request(B, BS)
    assert by_last[hex_id(a[-1])]["held"] == [4, 2]  # engine 1 holds the two shared blocks of A's chain
    assert by_last[hex_id(b[-1])]["held"] == [2, 5]
    assert by_last[hex_id(b[-1])]["first"] == hex_id(b[0]) and by_last[hex_id(b[-1])]["tokens"] == len(B)


def test_a_route_picks_the_engine_holding_the_longest_prefix_and_says_so():
    links = [link_with([store(A)]), link_with([store(B)])]
    prompt = B + [1, 2, 3]
    rows, scores = [], []
    for i, ln in enumerate(links):
        ix = index_of(i, ln, usage=0.1)
        row = route_row(i, ln.url, ix, True)
        assert unroutable(ix, "en") is None
        s = score(ix, prompt, HASHER.request(prompt, BS))
        scored_row(row, s)
        rows.append(row)
        scores.append(s)
    view = route_view(rows, scores, ["http://a", "http://b"], "en")
    assert (view["pick"], view["tied"], view["best_tokens"]) == (1, [1], len(B))
    assert [r["matched"] for r in view["rows"]] == [2, 5]
    assert view["verdict"] == ("A KV-aware router sends it to engine 1 (http://b): the first 20 tokens of it are "
                               "cached there.")
    nobody = route_view([], [], [], "zh")
    assert nobody["pick"] is None and nobody["verdict"] == "没有引擎持有这个提示词前缀的任何块：路由器只能按负载来选。"
    other = EngineIndex(index=0, name="e", block_size=BS, hash_algo="xxhash", usage=None, blocks={})
    assert "xxhash" in unroutable(other, "en")


def test_a_drive_view_totals_its_rows_and_words_the_first_difference():
    predictor = Predictor(num_blocks=16, block_size=BS, held=())
    steps = []
    for i, ids in enumerate((A, B)):
        pred = predictor.run(ids)
        obs = Observed(stored=list(pred.stored) if i == 0 else [], removed=0, queries=float(len(ids)),
                       hits=float(pred.hit_tokens))
        steps.append(Step(group="system", text="t", token_ids=ids, completion=" x", latency_s=0.5, predicted=pred,
                          observed=obs, difference=first_difference(i, pred, obs)))
    view = drive_view("system", "http://e", Drive(block_size=BS, num_blocks=16, held_before=0, gaps_before=0,
                                                  steps=steps), "en")
    assert [r["same"] for r in view["rows"]] == [True, False] and not view["same"]
    assert view["first_difference"] == {"key": "engine.diff.stored", "text": (
        "request 2: KVScope stores 3 blocks, the engine's events show 0 (blocks it already held, or events still in "
        "flight)")}
    ours = view["totals"]["ours"]
    assert (ours["stored"], ours["hit_tokens"]) == (4 + 3, 2 * BS)  # B reuses A's two shared blocks
    assert ours["hit_rate"] == 2 * BS / (len(A) + len(B))
    assert view["rows"][0]["ours"]["hashes"] == [hex_id(h) for h in HASHER.request(A, BS)]


def test_a_json_line_never_carries_nan_or_infinity():
    line = json_line({"a": math.nan, "b": [1.0, math.inf], "c": {"d": -math.inf}, "e": "x"})
    assert line.endswith(b"\n") and json.loads(line) == {"a": None, "b": [1.0, None], "c": {"d": None}, "e": "x"}
