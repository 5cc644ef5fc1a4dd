"""Prompt lookup beside transformers' own, on the same ids, in one run (the real offline SmolLM2-135M-Instruct).

    .venv/bin/python bench/bench_lookup.py              # 7 interleaved repeats of each
    .venv/bin/python bench/bench_lookup.py --repeats 3

The prompt is REFERENCE.md's copying one: "Copy this text exactly, word for word:\\n\\n" + one sentence, through the
model's chat template. Four ways decode it greedily, each timed whole (prefill included), round-robin so the
machine's drift hits each alike, medians of ``--repeats``:

    kvscope plain      ``app.model.speculative.plain_decode``: one token per forward through a DynamicCache
    kvscope lookup     ``speculate`` with the ``PromptLookup`` draft, γ = 8, n ≤ 3
    hf plain           ``model.generate(ids, do_sample=False)``
    hf lookup          ``model.generate(ids, do_sample=False, prompt_lookup_num_tokens=8, max_matching_ngram_size=3)``

Every one stops at the model's end tokens (``LoadedModel.end_ids``: ``<|im_end|>``; transformers reads the same id
from the generation config). The speed-ups (plain / lookup within each library) are printed side by side, with the
outputs' equality (all four must be the same tokens) and where a KVScope lookup round's time goes: the lookup
itself, the verify forward (the model), the rule and the bookkeeping. Target: KVScope's speed-up ≥ transformers'.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from app.model import speculative as spec
from bench.common import interleaved, machine

NAME = "smollm2-135m-instruct"
HOME = Path(__file__).resolve().parents[1] / "tests" / ".cache" / "kvscope-home"
SENTENCE = ("The key and value vectors of every earlier token are kept in the cache, so each new token computes "
            "only its own and reads the rest.")
PROMPT = "Copy this text exactly, word for word:\n\n" + SENTENCE
GAMMA, NGRAM, MAX_NEW = 8, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from app.model.loading import load_spec

    lm = load_spec(NAME, HOME)
    ids = lm.encode_chat(PROMPT)
    x = torch.tensor([ids])
    ends = sorted(lm.end_ids)
    print(f"{machine()}; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{lm.name}: {len(ids)} prompt tokens, end tokens {lm.end_text()} {ends}, γ = {GAMMA}, n ≤ {NGRAM}, "
          f"at most {MAX_NEW} new tokens", flush=True)
    out: dict[str, list[int]] = {}
    last: dict[str, spec.SpecResult] = {}

    def kv_plain():
        out["kvscope plain"], _ = spec.plain_decode(spec.Runner(lm), ids, max_new_tokens=MAX_NEW, stop=lm.end_ids)

    def kv_lookup():
        r = spec.speculate(spec.Runner(lm), spec.PromptLookup(NGRAM), ids, gamma=GAMMA, max_new_tokens=MAX_NEW,
                           stop=lm.end_ids)
        out["kvscope lookup"], last["r"] = r.output, r

    def hf(name: str, **kw):
        def go():
            with torch.no_grad():
                y = lm.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW,
                                      eos_token_id=ends, pad_token_id=ends[0], **kw)
            out[name] = y[0, len(ids):].tolist()
        return go

    fns = {"kvscope plain": kv_plain, "kvscope lookup": kv_lookup, "hf plain": hf("hf plain"),
           "hf lookup": hf("hf lookup", prompt_lookup_num_tokens=GAMMA, max_matching_ngram_size=NGRAM)}
    times = interleaved(fns, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    greedy = out["kvscope plain"]
    print(f"\noutput ({len(greedy)} tokens, ends with {lm.token_text(greedy[-1])!r}): "
          f"{lm.tokenizer.decode(greedy)!r}")
    for name, toks in out.items():
        print(f"  {name:15s} {len(toks):3d} tokens, identical to kvscope plain: {toks == greedy}")
    print("\n| way | median s | spread s | speed-up over its own plain |\n|---|---|---|---|")
    for name in fns:
        base = med["kvscope plain" if name.startswith("kvscope") else "hf plain"]
        print(f"| {name} | {med[name]:.3f} | {min(times[name]):.3f}–{max(times[name]):.3f} | "
              f"{base / med[name]:.2f}× |")
    kv, hf_ = med["kvscope plain"] / med["kvscope lookup"], med["hf plain"] / med["hf lookup"]
    print(f"\nspeed-up side by side: KVScope {kv:.2f}× vs transformers {hf_:.2f}× (ratio {kv / hf_:.2f}; "
          f"target ≥ 1.00); KVScope lookup / transformers lookup time {med['kvscope lookup'] / med['hf lookup']:.2f}")
    calls: list[int] = []
    hook = lm.model.register_forward_pre_hook(lambda _m, _a: calls.append(1))
    try:  # how many forwards of the model each lookup makes (transformers': its prompt's and its rounds')
        fns["kvscope lookup"]()
        n_kv = len(calls)
        calls.clear()
        fns["hf lookup"]()
        n_hf = len(calls)
    finally:
        hook.remove()
    print(f"model forwards per run: KVScope lookup {n_kv}, transformers lookup {n_hf}")
    r = last["r"]
    verify = r.verify_ms
    draft = r.draft_ms
    total = sum(x.ms for x in r.rounds)
    bare = []
    with torch.no_grad():
        for _ in range(3):
            t0 = time.perf_counter()
            lm.model(input_ids=x[:, : GAMMA + 1], use_cache=False)
            bare.append((time.perf_counter() - t0) * 1000)
    print(f"\nthe last KVScope lookup run: {len(r.rounds)} rounds, {r.tokens} tokens, acceptance "
          f"{r.acceptance_rate:.2f}, {r.tokens_per_forward:.2f} tokens per target forward; per round "
          f"lookup {draft / len(r.rounds):.2f} ms, verify forward + rule {verify / len(r.rounds):.2f} ms, "
          f"the rest (rollback, the round's record) {(total - draft - verify) / len(r.rounds):.2f} ms; "
          f"a bare uncached forward of {GAMMA + 1} tokens {min(bare):.2f} ms")


if __name__ == "__main__":
    main()
