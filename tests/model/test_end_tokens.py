"""Decoding stops where the answer stops: the model's end tokens (``LoadedModel.end_ids``), read from its generation
config and tokenizer, end plain decoding, speculative decoding with every draft, the decode studio's sessions and the
compression arena's continuation — unless the learner asks to go on past them."""

from __future__ import annotations

import pytest

from app.cache.arena import run_arena
from app.model.speculative import PromptLookup, Runner, make_draft, plain_decode, speculate
from tests.shaped_model import ending_at, with_an_end

PROMPT = "the cat sat on the mat and the dog sat on the"


def test_the_end_tokens_are_the_generation_configs_and_the_tokenizers(distil, tiny, llama):
    assert distil.end_ids == {50256} and distil.end_text() == "<|endoftext|>"  # GPT-2's <|endoftext|>
    assert llama.end_ids == {llama.adapter.vocab_size - 1}  # the tiny checkpoints' config and tokenizer agree
    # The built-in model's config names its <unk> (id 0) as eos, its tokenizer has none: no end token.
    assert tiny.model.generation_config.eos_token_id == 0 and tiny.end_ids == frozenset()
    listed = ending_at(llama, [5, 7])  # a list of ids, as transformers' generation configs may hold
    assert listed.end_ids == {5, 7, llama.adapter.vocab_size - 1} and listed.end_text().count(" / ") == 2


@pytest.mark.heavy
def test_smollm2_ends_its_turn_at_im_end(smol):
    assert smol.end_ids == {2} and smol.end_text() == "<|im_end|>"


def test_plain_and_speculative_decoding_stop_at_the_end_token_with_every_draft(any_model, family_models):
    ids = any_model.encode(PROMPT)
    lm, free, at = with_an_end(any_model, ids)
    plain, _ = plain_decode(Runner(lm), ids, max_new_tokens=12, stop=lm.end_ids)
    assert plain == free[: at + 1]
    drafts = {"lookup": lambda: PromptLookup(3), "early": lambda: make_draft(lm, kind="early", exit_layer=1)}
    if any_model is family_models["llama"]:
        drafts["model"] = lambda: make_draft(lm, kind="model", other=family_models["qwen2"])
    for kind, make in drafts.items():
        for gamma in (1, 4):
            r = speculate(Runner(lm), make(), ids, gamma=gamma, max_new_tokens=12, stop=lm.end_ids)
            assert r.output == free[: at + 1] and r.ended, (kind, gamma)
            # Asked to go on, it decodes past the end token, to the length asked for, as plain decoding does.
            on = speculate(Runner(lm), make(), ids, gamma=gamma, max_new_tokens=12)
            assert on.output == free and not on.ended, (kind, gamma)


def test_the_arenas_continuation_ends_at_the_end_token_unless_asked_to_go_on(distil):
    ids = distil.encode(PROMPT)
    lm, free, at = with_an_end(distil, ids, n=8)
    ended = run_arena(lm, ids, steps=8, budget=8, policies=["window"], stop=lm.end_ids)
    assert ended["steps"] == at + 1 and ended["reference"] == free[: at + 1]
    assert all(len(r["greedy"]) == len(r["kl"]) == at + 1 for r in ended["runs"])
    went_on = run_arena(lm, ids, steps=8, budget=8, policies=["window"])
    assert went_on["steps"] == 8 and went_on["reference"] == free[:8]
