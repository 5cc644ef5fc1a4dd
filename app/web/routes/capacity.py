"""The capacity lab: /capacity, and its JSON API under /api/capacity/ (calculator, simulator, engine check)."""

from __future__ import annotations

import threading
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from app import catalog
from app.capacity import check, stepcost
from app.capacity.bounds import SimLimits, run_bounded, stopped_view
from app.capacity.calculator import TP_DEGREES, WEIGHT_BYTES, CalcInput, calculate
from app.capacity.simulator import SimConfig, parse_requests, synthetic_workload
from app.errors import BadInput
from app.kv_bytes import DTYPE_BYTES, SCALES
from app.state import AppState
from app.viz.capacity import simulation_view
from app.web.cancel import run_until_disconnected
from app.web.deps import StateDep
from app.web.openapi import errors
from app.web.render import render

router = APIRouter()

Dtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"]
Scales = Literal["head-token", "head-block", "tensor"]
BlockSize = Literal[1, 2, 4, 8, 16, 32, 64, 128]
TP = Literal[1, 2, 4, 8, 16, 32, 64]
MAX_TEXT = 60_000
assert set(Dtype.__args__) == set(DTYPE_BYTES) and set(Scales.__args__) == set(SCALES)  # type: ignore[attr-defined]
assert TP.__args__ == TP_DEGREES  # type: ignore[attr-defined]


class Custom(BaseModel):
    n_layer: int = Field(..., ge=1, le=1024)
    n_head: int = Field(..., ge=1, le=4096)
    n_kv_head: int = Field(..., ge=1, le=4096)
    head_dim: int = Field(..., ge=1, le=16384)
    kv_lora_rank: int | None = Field(None, ge=1, le=65536)
    qk_rope_head_dim: int | None = Field(None, ge=0, le=16384)


class ModelChoice(BaseModel):
    model: str = Field("llama-3-8b", max_length=120,
                       description="a catalog key, loaded:<name> (a model this server runs), config or custom")
    config_json: str | None = Field(None, max_length=MAX_TEXT, description="the text of a config.json (model=config)")
    custom: Custom | None = None


class CalcBody(ModelChoice):
    dtype: Dtype = "bf16"
    scales: Scales = "head-token"
    block_size: BlockSize = 16
    tp: TP = 1
    batch: int = Field(1, ge=1, le=100_000)
    context: int = Field(8192, ge=1, le=10_000_000)
    gpu_memory_gib: float = Field(80.0, gt=0, le=4096)
    utilization: float = Field(0.9, gt=0, le=1)
    weight_dtype: Dtype = "bf16"
    weight_gib: float | None = Field(None, ge=0, le=100_000)
    other_gib: float = Field(0.0, ge=0, le=4096)
    kv_memory_gib: float | None = Field(None, gt=0, le=100_000)
    attention: Literal["MHA", "GQA", "MQA", "MLA"] | None = None


class SimBody(ModelChoice):
    cost: Literal["roofline", "measured"] = "roofline"
    gpu: str = Field("a100-80gb", max_length=40)
    tp: TP = 1
    dtype: Dtype = "bf16"
    block_size: BlockSize = 16
    utilization: float = Field(0.9, gt=0, le=1)
    num_blocks: int | None = Field(None, ge=1, le=4_000_000, description="omit: what the GPU's memory holds")
    max_num_batched_tokens: int = Field(2048, ge=1, le=1_000_000)
    max_num_seqs: int = Field(256, ge=1, le=4096)
    chunked_prefill: bool = True
    prefix_caching: bool = True
    workload: Literal["synthetic", "list"] = "synthetic"
    n: int = Field(1000, ge=1, le=20_000)
    rate: float = Field(10.0, ge=0, le=1e6, description="requests per second (0: all at once)")
    prompt_min: int = Field(128, ge=1, le=1_000_000)
    prompt_max: int = Field(1024, ge=1, le=1_000_000)
    output_min: int = Field(32, ge=1, le=1_000_000)
    output_max: int = Field(256, ge=1, le=1_000_000)
    shared_prefix_fraction: float = Field(0.5, ge=0, le=1)
    prefix_len: int = Field(256, ge=0, le=1_000_000)
    seed: int = Field(0, ge=0, le=2**31)
    requests_text: str | None = Field(None, max_length=MAX_TEXT)
    weight_gib: float | None = Field(None, gt=0, le=100_000,
                                     description="omit: parameters × 2 bytes (needed for model=custom)")


class CheckBody(BaseModel):
    model: str | None = Field(None, max_length=120, description="a model this server runs")
    num_blocks: int = Field(9, ge=1, le=64)
    block_size: Literal[1, 2, 4, 8, 16] = 4
    max_num_seqs: int = Field(3, ge=1, le=12)
    requests_text: str = Field("0 7 12\n0 9 10\n1 5 14\n3 12 6\n4 3 9", max_length=2000)


def _model(state: AppState, body: ModelChoice) -> catalog.ModelConfig:
    if body.model.startswith("loaded:"):
        lm = state.model(body.model.removeprefix("loaded:"))
        return catalog.from_adapter(lm.name, lm.adapter)
    if body.model == "config":
        if not body.config_json:
            raise BadInput("err.capacity.config_empty")
        return catalog.from_config_json(body.config_json)
    if body.model == "custom":
        if body.custom is None:
            raise BadInput("err.capacity.custom_missing")
        return catalog.from_numbers(**body.custom.model_dump())
    return catalog.get(body.model)


def _calc_input(body: CalcBody) -> CalcInput:
    return CalcInput(**body.model_dump(exclude={"model", "config_json", "custom"}))


@router.get("/capacity", include_in_schema=False)
def read_capacity_page(request: Request, state: StateDep):
    models = [m.view() for m in catalog.CATALOG.values()]
    loaded = [{"key": f"loaded:{name}", "name": name} for name in state.registry.names]
    gpus = [g.__dict__ for g in stepcost.GPUS.values()]
    return render(request, "capacity.html", page="capacity", models=models, loaded=loaded, gpus=gpus)


@router.get("/api/capacity/models", tags=["capacity"])
def read_models(state: StateDep) -> dict:
    """The catalog of real configs, the models this server runs, and the GPUs the roofline knows."""
    loaded = [catalog.from_adapter(n, state.model(n).adapter).view() for n in state.registry.names]
    return {"catalog": [m.view() for m in catalog.CATALOG.values()], "loaded": loaded,
            "gpus": [g.__dict__ for g in stepcost.GPUS.values()]}


@router.post("/api/capacity/calculate", tags=["capacity"], responses=errors(422))
def calculate_capacity(state: StateDep, body: CalcBody) -> dict:
    """Bytes per token (formula filled in), per request and batch; KV memory → blocks → tokens → concurrency."""
    result = calculate(_model(state, body), _calc_input(body))
    if body.model.startswith("loaded:"):
        result["paged_link"] = f"/paged?model={body.model.removeprefix('loaded:')}"
    return result


@router.post("/api/capacity/simulate", tags=["capacity"], responses=errors(422, 429, 503))
async def simulate(request: Request, state: StateDep, body: SimBody) -> dict:
    """Continuous batching as vLLM schedules it, over a synthetic workload or a pasted request list.

    Bounded (``app/capacity/bounds.py``): refused before it starts when too big, stopped at the step or time
    limit (the answer says so and shows what ran), and stopped when the client disconnects."""
    return await run_until_disconnected(request, lambda cancel: _simulate(state, body, cancel))


def _simulate(state: AppState, body: SimBody, cancel: threading.Event) -> dict:
    if body.workload == "list":
        requests = parse_requests(body.requests_text or "")
    else:
        requests = synthetic_workload(n=body.n, rate=body.rate, prompt_min=body.prompt_min,
                                      prompt_max=max(body.prompt_min, body.prompt_max), output_min=body.output_min,
                                      output_max=max(body.output_min, body.output_max),
                                      shared_prefix_fraction=body.shared_prefix_fraction, prefix_len=body.prefix_len,
                                      seed=body.seed)
    model = _model(state, body)
    if body.gpu not in stepcost.GPUS:
        raise BadInput("err.capacity.gpu", gpu=body.gpu, known=", ".join(stepcost.GPUS))
    gpu = stepcost.GPUS[body.gpu]
    if body.cost == "roofline" and not model.parameters and body.weight_gib is None:
        raise BadInput("err.capacity.sim_weights_unknown", model=model.name)  # hand-entered numbers, MoE config
    calc = calculate(model, CalcInput(dtype=body.dtype, block_size=body.block_size, tp=body.tp,
                                      gpu_memory_gib=gpu.memory_gib, utilization=body.utilization,
                                      weight_gib=body.weight_gib,
                                      context=max(r.prompt_len + r.output_len for r in requests)))
    if body.cost == "measured":
        if not body.model.startswith("loaded:"):
            raise BadInput("err.capacity.measured_needs_loaded")
        cost = stepcost.measure(state.model(body.model.removeprefix("loaded:")), lock=state.model_lock)
        cost_info = {"kind": "measured"} | cost.limits()
        num_blocks = body.num_blocks or 512
    else:
        # A model without a parameter count multiplies by about as many parameters as its weights hold.
        params = model.parameters or calc["weight_bytes"] / WEIGHT_BYTES[calc["input"]["weight_dtype"]]
        cost = stepcost.Roofline.for_model(gpu, model, weight_bytes=calc["weight_bytes"],
                                           kv_bytes_per_token=calc["bytes_per_token"], tp=body.tp, params=params)
        cost_info = {"kind": "roofline"} | cost.limits()
        num_blocks = body.num_blocks or calc["num_blocks"]
    if num_blocks < 1:
        fit = calc["tp_fit"]
        if fit is None:
            raise BadInput("err.capacity.no_kv_memory", model=model.name, gpu=gpu.name)
        raise BadInput("err.capacity.no_kv_memory_tp", model=model.name, gpu=gpu.name, tp=fit["tp"])
    cfg = SimConfig(num_blocks=num_blocks, block_size=body.block_size,
                    max_num_batched_tokens=body.max_num_batched_tokens, max_num_seqs=body.max_num_seqs,
                    chunked_prefill=body.chunked_prefill, prefix_caching=body.prefix_caching)
    limits = SimLimits.from_settings(state.settings)
    sim = run_bounded(cfg, requests, cost, limits=limits, cancel=cancel)
    view = simulation_view(sim, cost=cost_info)
    view["stopped"] = stopped_view(sim, limits)
    view["model"] = model.name
    view["bytes_per_token"] = calc["bytes_per_token"]
    return view


@router.post("/api/capacity/check", tags=["capacity"], responses=errors(422, 429, 503))
def check_against_engine(state: StateDep, body: CheckBody) -> dict:
    """The same requests and budgets through the simulator and the real paged engine, step by step."""
    lm = state.model(body.model)
    requests = parse_requests(body.requests_text)
    return check.compare(lm, requests, num_blocks=body.num_blocks, block_size=body.block_size,
                         max_num_seqs=body.max_num_seqs, lock=state.model_lock)

