"""Parameter, optimizer-state and memory views, each checked against a second, independent computation."""

from __future__ import annotations

import pytest
import torch

from app.errors import BadInput
from app.labs.train import TrainingJob, make_spec
from app.model.builtin import article_corpus_text
from app.training.inspect import cached_vs_full, memory_view, param_view, parameter_names
from app.training.trainer import TrainConfig, train

QKV = "transformer.h.0.attn.c_attn.weight"


def test_adam_state_appears_at_the_first_step_with_the_parameters_shapes():
    job = TrainingJob(1, make_spec(steps=1))
    before = param_view(job.model, job.optimizer, QKV, "q")
    assert before["step"] == 0 and not before["has_grad"] and not before["has_state"]
    assert before["shapes"] == {"value": [32, 96], "grad": None, "exp_avg": None, "exp_avg_sq": None}
    assert before["matrices"]["exp_avg"] is None and len(job.optimizer.state) == 0

    train(job.model, job.data, job.spec.config, optimizer=job.optimizer)

    after = param_view(job.model, job.optimizer, QKV, "q")
    assert after["step"] == 1 and after["has_grad"] and after["has_state"]
    assert after["view_shape"] == [32, 32] and after["slice"] == "[..., 0:32]"
    assert all(s == [32, 96] for s in after["shapes"].values())
    # Every parameter, not only the one shown: m and v have exactly the parameter's shape.
    params = list(job.model.parameters())
    assert len(job.optimizer.state) == len(params)
    for p in params:
        st = job.optimizer.state[p]
        assert st["exp_avg"].shape == p.shape == st["exp_avg_sq"].shape
        assert int(st["step"]) == 1
    # After one step Adam's moments are (1 - beta1) g and (1 - beta2) g^2 (they start at zero).
    p = dict(job.model.named_parameters())[QKV]
    g = p.grad[:, :32]
    assert torch.allclose(torch.tensor(after["matrices"]["grad"]), g, atol=1e-6)
    assert torch.allclose(torch.tensor(after["matrices"]["exp_avg"]), 0.1 * g, atol=1e-6)
    assert torch.allclose(torch.tensor(after["matrices"]["exp_avg_sq"]), 0.001 * g * g, atol=1e-6)


def test_query_slice_is_what_the_model_uses_as_q(tiny):
    view = param_view(tiny.model, torch.optim.AdamW(tiny.model.parameters()), QKV, "q")
    bias = param_view(tiny.model, torch.optim.AdamW(tiny.model.parameters()), "transformer.h.0.attn.c_attn.bias", "q")
    w_q, b_q = torch.tensor(view["matrices"]["value"]), torch.tensor(bias["matrices"]["value"][0])
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, _k, _v = tiny.model.transformer.h[0].attn.c_attn(x).split(32, dim=2)  # (1, 5, 32) each
    assert torch.allclose(x @ w_q + b_q, q, atol=1e-5)
    whole = param_view(tiny.model, torch.optim.AdamW(tiny.model.parameters()), QKV, "all")
    assert whole["view_shape"] == [32, 96] and whole["slice"] is None


def test_unknown_parameter_or_part_is_a_clear_error(tiny):
    opt = torch.optim.AdamW(tiny.model.parameters())
    with pytest.raises(BadInput, match="Unknown parameter"):
        param_view(tiny.model, opt, "transformer.h.9.attn.c_attn.weight")
    with pytest.raises(BadInput, match="Unknown part"):
        param_view(tiny.model, opt, QKV, "z")
    # A parameter that is not fused ignores the part.
    assert param_view(tiny.model, opt, "transformer.wpe.weight", "q")["view_shape"] == [128, 32]


def test_memory_is_16_bytes_per_distinct_parameter(tiny):
    view = memory_view(tiny.model)
    # Count another way: unique storages of the state dict (lm_head.weight shares wte's).
    seen, n = set(), 0
    for t in tiny.model.state_dict().values():
        if t.is_floating_point() and t.data_ptr() not in seen and t.requires_grad is False:
            seen.add(t.data_ptr())
            n += t.numel()
    assert view["parameters"] == n == 29_568 + 32 * len(tiny.tokenizer)  # wpe + blocks + ln_f, and wte: 32 per token
    assert view["per_param_total"] == 16 and [r["bytes"] for r in view["per_param"]] == [4, 4, 4, 4]
    assert view["training_bytes"] == 16 * n and view["weights_bytes"] == 4 * n


def test_cached_decoding_matches_full_recompute(tiny):
    prompt = tiny.encode(article_corpus_text()[:40])
    result = cached_vs_full(tiny.model, prompt, 8)
    # An independent greedy loop, full prefix each time.
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(tiny.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert result["new_ids"] == ids[len(prompt):]
    assert result["same_tokens"] and result["max_abs_diff"] < 1e-4
    assert result["cache_shape"] == [1, 4, 48, 8]  # 40 prompt + 8 new tokens, each fed back
    assert result["cache_layers"] == 2
    with pytest.raises(BadInput):
        cached_vs_full(tiny.model, prompt * 4, 8)


def test_resume_replays_the_same_batches_as_an_uninterrupted_run():
    spec = make_spec(steps=6)
    whole = TrainingJob(1, spec)
    full = train(whole.model, whole.data, spec.config, optimizer=whole.optimizer)
    split = TrainingJob(2, spec)
    three = TrainConfig(**{**spec.config.__dict__, "steps": 3})
    first = train(split.model, split.data, three, optimizer=split.optimizer)
    rest = train(split.model, split.data, spec.config, optimizer=split.optimizer, start_step=3)
    assert [h.step for h in first + rest] == list(range(6))
    assert torch.allclose(torch.tensor([h.loss for h in first + rest]), torch.tensor([h.loss for h in full]), atol=1e-5)


def test_the_page_opens_on_the_fused_query_projection_of_layer_0(tiny):
    """The default the training lab shows comes from the adapter and is what it always was on the built-in model."""
    opt = torch.optim.AdamW(tiny.model.parameters())
    names = parameter_names(tiny.model)
    assert [p["name"] for p in names if p["default"]] == [QKV]
    assert param_view(tiny.model, opt, None, "q") == param_view(tiny.model, opt, QKV, "q")
    assert param_view(tiny.model, opt, QKV, "v")["slice"] == "[..., 64:96]"


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool) -> torch.Tensor:
    y = x @ weight if conv1d else x @ weight.T  # GPT-2's Conv1D stores (in, out), nn.Linear (out, in)
    return y + bias if bias is not None else y


def test_each_familys_qkv_parameters_make_the_captured_q_k_v(any_model):
    """The parameters the adapter names as a layer's q/k/v projections (sliced where fused) reproduce the q/k/v the
    model computed: the captured ``attn.v`` (and q, k before rotation where no q/k norm follows the projection)."""
    from app.model.adapters import adapter_class
    from app.model.capture import run_traced

    lm = any_model
    cls, config, a = adapter_class(lm.model.config.model_type), lm.model.config, lm.adapter
    params = dict(lm.model.named_parameters())
    ids = lm.encode("The cat sat on the mat")
    trace = run_traced(lm.model, a, ids, lm.token_texts(ids))
    assert cls.default_parameter(config) in params
    for layer in range(a.n_layer):
        names = cls.qkv_parameters(config, layer)
        x = trace[f"blocks.{layer}.ln_1"]  # (1, T, D)
        parts = ["v"] if a.qk_norm else ["q", "k", "v"]
        for part in parts:
            if "qkv" in names:
                fused = cls.fused_qkv(config, names["qkv"])
                bias = params.get(names["qkv"].replace(".weight", ".bias"))
                assert fused is not None and cls.fused_qkv(config, names["qkv"].replace(".weight", ".bias")) == fused
                y = _linear(x, params[names["qkv"]][fused.index(part)],
                            None if bias is None else bias[fused.index(part)], conv1d=True)
            else:
                assert cls.fused_qkv(config, names[part]) is None
                y = _linear(x, params[names[part]], params.get(names[part].replace(".weight", ".bias")), conv1d=False)
            heads = a.n_head if part == "q" else a.n_kv_head
            name = f"{part}_prerope" if a.rotary and part != "v" else part  # before rotation
            want = trace[f"blocks.{layer}.attn.{name}"]
            assert torch.allclose(a.split_heads(y, heads), want, atol=1e-5), (layer, part)
