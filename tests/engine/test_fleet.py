"""The fleet's logic on indexes fed by events: chains per engine and merged, a prompt's score, the router's pick.
(Against two real vLLMs: test_real_engine.py.)"""

from __future__ import annotations

from app.engine.events import decode_frames
from app.engine.fleet import EngineIndex, IndexBlock, Score, decide, engine_chains, fleet_chains, score
from app.engine.hashing import VllmBlockHasher
from app.engine.mirror import BlockMirror
from tests.engine.frames import frames, removed, stored

BS = 4
HASHER = VllmBlockHasher()


def index_of(i: int, *events_per_batch: list, usage: float | None = None) -> EngineIndex:
    """An engine's index as the lab builds it: its events through a real ``BlockMirror``."""
    m = BlockMirror()
    for seq, events in enumerate(events_per_batch):
        m.apply(decode_frames(frames(seq, events)))
    return EngineIndex(index=i, name=f"engine {i}", block_size=BS, hash_algo="sha256", usage=usage,
                       blocks={b.block_hash: IndexBlock(b.block_hash, b.parent, len(b.token_ids), f"<{b.token_ids[0]}>")
                               for b in m.blocks.values()})


def store(tokens: list[int]) -> dict:
    """The BlockStored event an engine sends for a first request of these tokens (full blocks only)."""
    hashes = HASHER.request(tokens, BS)
    return stored(hashes, None, tokens[: len(hashes) * BS], block_size=BS)


SHARED = list(range(100, 108))  # two blocks every prompt below starts with
A = SHARED + list(range(200, 208))  # + two of engine 0's own
B = SHARED + list(range(300, 312))  # + three of engine 1's own


def test_an_engines_index_reads_as_its_root_to_leaf_chains():
    e = index_of(0, [store(A)], [store(SHARED + [9, 9, 9, 9])])
    chains = sorted(engine_chains(e), key=len)
    a, s = HASHER.request(A, BS), HASHER.request(SHARED + [9, 9, 9, 9], BS)
    assert chains == [s, a]  # two leaves; the shared blocks are stored once (same hashes) and lie on both paths
    assert a[:2] == s[:2]


def test_the_fleets_chains_merge_engines_and_say_how_deep_each_holds_them():
    e0 = index_of(0, [store(A)])
    e1 = index_of(1, [store(B)], [store(SHARED)])  # SHARED stored again: the same two hashes, nothing new
    e2 = index_of(2, [store(SHARED)])  # only the shared prefix: inside both chains, so no row of its own
    chains, total = fleet_chains([e0, e1, e2], max_chains=10)
    assert total == 2
    by_leaf = {c.hashes[-1]: c for c in chains}
    ca, cb = by_leaf[HASHER.request(A, BS)[-1]], by_leaf[HASHER.request(B, BS)[-1]]
    assert ca.held == {0: 4, 1: 2, 2: 2} and cb.held == {0: 2, 1: 5, 2: 2}
    assert cb.tokens == len(B) and cb.from_start and len(cb.texts) == 5 and cb.texts[0] == "<100>"
    assert chains[0] is cb  # held by as many engines as the other: the longer first


def test_a_chain_whose_first_blocks_were_evicted_starts_mid_prompt():
    a = HASHER.request(A, BS)
    e0 = index_of(0, [store(A)], [removed(a[:1])])
    (chain,), _ = fleet_chains([e0], max_chains=5)
    assert chain.hashes == a[1:] and not chain.from_start and chain.held == {0: 3}
    # A router cannot use it: the prompt's first block is gone, and a chain is matched from its start.
    assert score(e0, A, a).matched == 0


def test_a_prompt_scores_its_longest_run_of_leading_hashes_and_the_router_picks_the_highest():
    e0, e1 = index_of(0, [store(A)]), index_of(1, [store(B)])
    prompt = B[:12] + [7, 7, 7]  # shared (2 blocks) + engine 1's first block, then 3 new tokens
    h = HASHER.request(prompt, BS)
    s0, s1 = score(e0, prompt, h), score(e1, prompt, h)
    assert (s0.matched, s1.matched) == (2, 3) and (s0.matched_tokens, s1.matched_tokens) == (8, 12)
    d = decide([s0, s1])
    assert d.pick == 1 and d.tied == (1,) and d.best_tokens == 12


def test_the_engine_reuses_at_most_all_but_the_last_token():
    e1 = index_of(1, [store(B)])
    prompt = B[:12]  # exactly three full blocks, all cached: vLLM still computes the last token, in the 3rd block
    s = score(e1, prompt, HASHER.request(prompt, BS))
    assert s.matched == 3 and s.reused == 2 and s.hit_tokens == 8


def test_a_tie_is_named_and_goes_to_the_lower_usage_then_the_lower_index():
    scores = [Score(index=i, tokens=20, blocks=5, matched=2, block_size=BS) for i in range(3)]
    d = decide(scores, {0: 0.5, 1: 0.1, 2: 0.1})
    assert d.tied == (0, 1, 2) and d.pick == 1
    assert decide(scores).pick == 0  # no usage known: the lower index
    assert decide([Score(index=0, tokens=3, blocks=0, matched=0, block_size=BS)]).pick is None


def test_scores_compare_in_tokens_when_engines_have_different_block_sizes():
    small = Score(index=0, tokens=64, blocks=4, matched=3, block_size=16)  # 48 tokens cached
    big = Score(index=1, tokens=64, blocks=2, matched=1, block_size=32)  # 32 tokens cached
    assert decide([small, big]).pick == 0
