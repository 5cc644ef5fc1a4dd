"""KVScope's parser of the capture plugin's answer: synthetic pieces cut from known tensors the way the plugin cuts
them (query heads by tensor rank, layers by pipeline stage), stitched back exactly; every malformed piece a clear
error. (The real engine's answers: tests/engine/test_served_capture.py.)"""

from __future__ import annotations

import base64
import copy

import pytest
import torch

from app.engine.capture import ServedConflict, ServedError, ServedUnknown, parse_served

H, KV, DH, LAYERS = 6, 2, 4, 4


def b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.to(torch.float32).contiguous().numpy().tobytes()).decode()


def pieces(tp=2, pp=1, cached=0, steps=(5, 1, 1), seed=0):
    """The answer a tp × pp engine gives for one request, and the whole q (L, H, Tc, Dh) and k (L, KV, T, Dh)."""
    g = torch.Generator().manual_seed(seed)
    tc = sum(steps)
    q = torch.randn(LAYERS, H, tc, DH, generator=g)
    k = torch.randn(LAYERS, KV, cached + tc, DH, generator=g)
    hl, kvl = H // tp, KV // tp
    starts = [cached + sum(steps[:i]) for i in range(len(steps))]
    per_stage = LAYERS // pp
    workers = []
    for pr in range(pp):
        for tr in range(tp):
            layers = []
            for layer in range(pr * per_stage, (pr + 1) * per_stage):
                ql = q[layer, tr * hl:(tr + 1) * hl].permute(1, 0, 2).reshape(tc, hl * DH)
                kl = k[layer, tr * kvl:(tr + 1) * kvl].permute(1, 0, 2)  # (T, kvl, Dh)
                layers.append({"layer": layer, "starts": starts, "counts": list(steps), "q": b64(ql),
                               "k": b64(kl[cached:].reshape(tc, kvl * DH)),
                               "cached_k": b64(kl[:cached].reshape(cached, kvl * DH))})
            cap = {"request_id": "cmpl-1-0-abc", "label": "x", "finished": True, "over_budget": False,
                   "cached_tokens": cached, "cached_block_ids": [7] if cached else [], "block_size": 32,
                   "prompt_token_ids": list(range(100, 100 + cached + steps[0])),
                   "positions": list(range(cached, cached + tc)), "token_ids": list(range(100 + cached,
                                                                                        100 + cached + tc)),
                   "layers": layers}
            workers.append({"rank": pr * tp + tr, "tp_rank": tr, "tp_size": tp, "pp_rank": pr, "pp_size": pp,
                            "heads": hl, "kv_heads": kvl, "head_dim": DH, "model_layers": LAYERS,
                            "captures": [cap]})
    return {"key": "x", "workers": workers}, q, k


@pytest.mark.parametrize(("tp", "pp", "cached"), [(1, 1, 0), (2, 1, 0), (2, 2, 3), (1, 4, 2)])
def test_pieces_stitch_back_by_head_and_layer_exactly(tp, pp, cached):
    payload, q, k = pieces(tp, pp, cached)
    got = parse_served(payload)
    assert got.layers == list(range(LAYERS)) and got.tp_size == tp and got.pp_size == pp
    assert got.computed_from == cached and got.token_ids == list(range(100, 100 + cached + 7))
    assert got.steps == [(cached, 5), (cached + 5, 1), (cached + 6, 1)]
    group = H // KV
    for layer in range(LAYERS):
        assert torch.equal(got.q[layer], q[layer])  # exact: the same float32 bytes, reordered
        assert torch.equal(got.k[layer], k[layer][torch.arange(H) // group])


def test_rebuilt_rows_are_causal_softmax():
    payload, q, k = pieces(2, 1, 2)
    got = parse_served(payload)
    rows = got.rows(0)
    assert rows.shape == (H, 7, 9)
    assert torch.allclose(rows.sum(-1), torch.ones(H, 7), atol=1e-6)  # fp32 sums of ≤ 9 terms
    assert float(rows[:, 0, 3:].abs().max()) == 0.0  # the first computed row (position 2) sees positions 0…2 only


def broken(edit):
    payload, _, _ = pieces(2, 2, 3)
    payload = copy.deepcopy(payload)
    edit(payload)
    return payload


@pytest.mark.parametrize("edit", [
    lambda p: p["workers"].pop(),                                                        # a worker missing
    lambda p: p["workers"][1]["captures"][0]["layers"][0].update(q="AAAA"),              # short bytes
    lambda p: p["workers"][1]["captures"][0]["layers"][0].update(q="not base64!"),
    lambda p: p["workers"][0]["captures"][0]["layers"][0].update(counts=[5, 1, 2]),      # rows ≠ positions
    lambda p: p["workers"][0]["captures"][0]["layers"][0].update(starts=[3, 9, 10]),     # a gap
    lambda p: p["workers"][2].update(pp_rank=0),                                         # two rank-0 stage-0s
    lambda p: [w["captures"][0]["layers"].pop() for w in p["workers"][2:]],              # a layer nobody sent
    lambda p: p["workers"][0].update(heads=5),
    lambda p: p["workers"][3]["captures"][0].update(token_ids=[1] * 7),
    lambda p: p["workers"][0].update(tp_size=True),
    lambda p: p.update(workers="no"),
])
def test_pieces_that_do_not_fit_are_a_clear_error(edit):
    with pytest.raises(ServedError) as e:
        parse_served(broken(edit))
    assert e.value.key == "err.served.bad_piece" and e.value.status == 502


def test_non_finite_values_are_refused():
    payload, _, _ = pieces(1, 1, 0)
    layer = payload["workers"][0]["captures"][0]["layers"][0]
    raw = bytearray(base64.b64decode(layer["q"]))
    raw[0:4] = b"\x00\x00\xc0\x7f"  # a NaN
    layer["q"] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(ServedError, match="not finite"):
        parse_served(payload)


def test_unknown_over_budget_running_and_half_held_captures_are_named():
    payload, _, _ = pieces(2, 1, 0)
    for w in payload["workers"]:
        w["captures"] = []
    with pytest.raises(ServedUnknown):
        parse_served(payload)
    over = broken(lambda p: p["workers"][0]["captures"][0].update(over_budget=True))
    with pytest.raises(ServedConflict, match="budget"):
        parse_served(over)
    running = broken(lambda p: p["workers"][0]["captures"][0].update(finished=False))
    with pytest.raises(ServedConflict, match="still being served"):
        parse_served(running)
    half = broken(lambda p: p["workers"][1].update(captures=[]))  # a worker restarted mid-capture
    with pytest.raises(ServedConflict) as e:
        parse_served(half)
    assert e.value.key == "err.served.incomplete"


def test_the_bytes_formula_counts_what_the_pieces_hold():
    from app.engine.capture import capture_bytes_per_layer

    for tp in (1, 2):
        payload, _, _ = pieces(tp, 1, 0)
        got = parse_served(payload)  # its nbytes: the byte lengths it decoded, counted there
        per_layer = capture_bytes_per_layer(heads=H, kv_heads=KV, head_dim=DH, tokens=got.n_tokens, tp=tp)
        assert got.nbytes == per_layer["all_ranks"] * LAYERS


def test_the_docs_table_is_the_formula():
    from pathlib import Path

    from app.engine.capture import capture_bytes_per_layer

    doc = (Path(__file__).parents[2] / "docs" / "served-capture.md").read_text()
    mib = capture_bytes_per_layer(heads=64, kv_heads=8, head_dim=128, tokens=32768, tp=8)
    assert mib["per_rank"] == 144 * 2**20 and mib["all_ranks"] == 1152 * 2**20 and mib["weights"] == 256 * 2**30
    assert "| 144 MiB | 1 152 MiB | 256 GiB |" in doc
    small = capture_bytes_per_layer(heads=9, kv_heads=3, head_dim=64, tokens=2048)
    assert small["per_rank"] == 6 * 2**20 and "| 6.0 MiB | 6.0 MiB | 144 MiB |" in doc
