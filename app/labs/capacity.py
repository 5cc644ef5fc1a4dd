"""The capacity lab (/capacity): the calculator, the scheduler simulator and the check against the real engine.

``CapacityLab`` owns the lab's pieces, handed in by ``app/state.py``: the served models (for ``loaded:<name>``
choices, measured step costs and the engine check), the model gate and the limits (``Settings.capacity_*``). The
arithmetic is ``app/capacity/``'s (calculator, simulator, step costs, check); this module turns a request's
choices into their inputs, bounds them and assembles the view.

    models()                        the catalog, the served models and the GPUs
    calculate(**choices)            bytes per token, per request, per batch; memory -> blocks -> concurrency
    simulate(cancel, **choices)     continuous batching over a workload, bounded (app/capacity/bounds.py)
    check(**choices)                the simulator against the real paged engine, step by step
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from app import catalog
from app.admission import ModelGate
from app.cache import spec as kv_spec
from app.cache.spec import kv_cache_groups
from app.capacity import check, stepcost
from app.capacity.bounds import SimLimits, run_bounded, stopped_view
from app.capacity.calculator import WEIGHT_BYTES, CalcInput, calculate
from app.capacity.simulator import SimConfig, parse_requests, synthetic_workload
from app.errors import BadInput
from app.labs.limits import Limits, in_range
from app.model.loading import ModelRegistry
from app.viz.capacity import simulation_view

LOADED = "loaded:"  # a model choice naming a model this server runs
DEFAULT_MEASURED_BLOCKS = 512  # the measured cost's pool when the form leaves it empty (a served model is small)


@dataclass(frozen=True)
class CapacityLimits(Limits):
    GROUP = "capacity"
    capacity_sim_max_blocks: int
    capacity_sim_max_requests: int
    capacity_sim_max_tokens: int
    capacity_sim_max_steps: int
    capacity_sim_max_s: float
    capacity_check_max_requests: int
    capacity_check_max_prompt: int
    capacity_check_max_output: int
    capacity_check_max_blocks: int
    capacity_check_max_block_size: int
    capacity_check_max_seqs: int


class CapacityLab:
    def __init__(self, *, registry: ModelRegistry, gate: ModelGate, limits: CapacityLimits) -> None:
        self.registry = registry
        self.gate = gate
        self.limits = limits

    def model_config(self, model: str, config_json: str | None = None, custom: dict | None = None
                     ) -> catalog.ModelConfig:
        """A catalog key, ``loaded:<name>``, ``config`` (a config.json's text) or ``custom`` (numbers)."""
        if model.startswith(LOADED):
            lm = self.registry.pick(model.removeprefix(LOADED))
            return catalog.from_adapter(lm.name, lm.adapter)
        if model == "config":
            if not config_json:
                raise BadInput("err.capacity.config_empty")
            return catalog.from_config_json(config_json)
        if model == "custom":
            if custom is None:
                raise BadInput("err.capacity.custom_missing")
            return catalog.from_numbers(**custom)
        return catalog.get(model)

    # --- views ----------------------------------------------------------------------------------------------
    def page(self) -> dict:
        return {"models": [m.view() for m in catalog.CATALOG.values()],
                "loaded": [{"key": f"{LOADED}{name}", "name": name} for name in self.registry.names],
                "gpus": [g.__dict__ for g in stepcost.GPUS.values()], "limits": self.limits}

    def models(self) -> dict:
        """The catalog of real configs, the models this server runs, and the GPUs the roofline knows."""
        loaded = [catalog.from_adapter(n, self.registry.pick(n).adapter).view() for n in self.registry.names]
        return {"catalog": [m.view() for m in catalog.CATALOG.values()], "loaded": loaded,
                "gpus": [g.__dict__ for g in stepcost.GPUS.values()], "limits": self.limits}

    def calculate(self, *, model: str, config_json: str | None = None, custom: dict | None = None,
                  **inputs) -> dict:
        result = calculate(self.model_config(model, config_json, custom), CalcInput(**inputs))
        if model.startswith(LOADED):
            result["paged_link"] = f"/paged?model={model.removeprefix(LOADED)}"
        return result

    def simulate(self, cancel: threading.Event, *, model: str, config_json: str | None = None,
                 custom: dict | None = None, cost: str, gpu: str, tp: int, dtype: str, block_size: int,
                 utilization: float, num_blocks: int | None, max_num_batched_tokens: int, max_num_seqs: int,
                 chunked_prefill: bool, prefix_caching: bool, workload: str, n: int, rate: float, prompt_min: int,
                 prompt_max: int, output_min: int, output_max: int, shared_prefix_fraction: float, prefix_len: int,
                 seed: int, requests_text: str | None, weight_gib: float | None) -> dict:
        """Continuous batching as vLLM schedules it; refused before it starts when too big, stopped at the step or
        time limit or when ``cancel`` is set (the view says so and shows what ran)."""
        if workload == "list":
            requests = parse_requests(requests_text or "", max_requests=self.limits.capacity_sim_max_requests)
        else:
            requests = synthetic_workload(n=n, rate=rate, prompt_min=prompt_min,
                                          prompt_max=max(prompt_min, prompt_max), output_min=output_min,
                                          output_max=max(output_min, output_max),
                                          shared_prefix_fraction=shared_prefix_fraction, prefix_len=prefix_len,
                                          seed=seed, max_requests=self.limits.capacity_sim_max_requests)
        config = self.model_config(model, config_json, custom)
        if gpu not in stepcost.GPUS:
            raise BadInput("err.capacity.gpu", gpu=gpu, known=", ".join(stepcost.GPUS))
        card = stepcost.GPUS[gpu]
        if cost == "roofline" and not config.parameters and weight_gib is None:
            raise BadInput("err.capacity.sim_weights_unknown", model=config.name)  # hand-entered numbers, MoE config
        calc = calculate(config, CalcInput(dtype=dtype, block_size=block_size, tp=tp, gpu_memory_gib=card.memory_gib,
                                           utilization=utilization, weight_gib=weight_gib,
                                           context=max(r.prompt_len + r.output_len for r in requests)))
        if cost == "measured":
            if not model.startswith(LOADED):
                raise BadInput("err.capacity.measured_needs_loaded")
            lm = self.registry.pick(model.removeprefix(LOADED))
            step_cost: stepcost.Measured | stepcost.Roofline = stepcost.measure(lm, lock=self.gate)
            cost_info = {"kind": "measured"} | step_cost.limits()
            blocks = num_blocks or DEFAULT_MEASURED_BLOCKS
        else:
            # A model without a parameter count multiplies by about as many parameters as its weights hold.
            params = config.parameters or calc["weight_bytes"] / WEIGHT_BYTES[calc["input"]["weight_dtype"]]
            step_cost = stepcost.Roofline.for_model(card, config, weight_bytes=calc["weight_bytes"],
                                                    kv_bytes_per_token=calc["bytes_per_token"], tp=tp, params=params)
            cost_info = {"kind": "roofline"} | step_cost.limits()
            blocks = num_blocks or calc["num_blocks"]  # vLLM's: blocks of group_size layers (all layers: one group)
        if blocks < 1:
            fit = calc["tp_fit"]
            if fit is None:
                raise BadInput("err.capacity.no_kv_memory", model=config.name, gpu=card.name)
            raise BadInput("err.capacity.no_kv_memory_tp", model=config.name, gpu=card.name, tp=fit["tp"])
        # The model's KV-cache groups, from its layers' specs: a sliding-window layer is counted at its window.
        groups = tuple(g.spec for g in kv_cache_groups(kv_spec.from_config(config)))
        cfg = SimConfig(num_blocks=blocks, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                        max_num_seqs=max_num_seqs, chunked_prefill=chunked_prefill, prefix_caching=prefix_caching,
                        groups=groups if len(groups) > 1 or groups[0].sliding_window else ())
        limits = SimLimits.from_settings(self.limits)
        sim = run_bounded(cfg, requests, step_cost, limits=limits, cancel=cancel)
        view = simulation_view(sim, cost=cost_info)
        view["stopped"] = stopped_view(sim, limits)
        view["model"] = config.name
        view["bytes_per_token"] = calc["bytes_per_token"]
        return view

    def check(self, *, model: str | None, num_blocks: int, block_size: int, max_num_seqs: int,
              requests_text: str) -> dict:
        """The same requests and budgets through the simulator and the real paged engine, step by step."""
        s = self.limits
        lm = self.registry.pick(model)
        in_range("num_blocks", num_blocks, 1, s.capacity_check_max_blocks)
        sizes = s.block_sizes(s.capacity_check_max_block_size)
        if block_size not in sizes:
            raise BadInput("err.block_size", sizes=", ".join(map(str, sizes)))
        in_range("max_num_seqs", max_num_seqs, 1, s.capacity_check_max_seqs)
        requests = parse_requests(requests_text, max_requests=self.limits.capacity_sim_max_requests)
        return check.compare(lm, requests, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                             max_requests=s.capacity_check_max_requests, max_prompt=s.capacity_check_max_prompt,
                             max_output=s.capacity_check_max_output, lock=self.gate)
