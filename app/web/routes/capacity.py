"""The capacity lab: /capacity, and its JSON API under /api/capacity/ (calculator, simulator, engine check). Each
route parses, calls one method of ``app/labs/capacity.py``, renders."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from fastapi import APIRouter, Request
from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from app.capacity.calculator import TP_DEGREES
from app.kv_bytes import DTYPE_BYTES, SCALES
from app.web.cancel import run_until_disconnected
from app.web.deps import CapacityDep
from app.web.openapi import Body, NotBool, errors
from app.web.render import render

router = APIRouter()

Dtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"]
Scales = Literal["head-token", "head-block", "tensor"]
BlockSizes = Literal[1, 2, 4, 8, 16, 32, 64, 128]
TPs = Literal[1, 2, 4, 8, 16, 32, 64]
BlockSize = Annotated[BlockSizes, NotBool]  # strict bodies still match true to 1 in a Literal of numbers
TP = Annotated[TPs, NotBool]
MAX_TEXT = 60_000
assert set(get_args(Dtype)) == set(DTYPE_BYTES) and set(get_args(Scales)) == set(SCALES)
assert get_args(TPs) == TP_DEGREES
# Smaller positive numbers are not a model or a workload but a float's edge: 5e-324 GiB of weights is 0 bytes once
# multiplied out, and a step time of 0 divides the tokens per second; a rate of 1e-300 requests/s puts arrivals
# past any clock. The bounds are far below any real model (1 KiB of weights) or class demo (a request every
# 1 000 s), far above where float arithmetic breaks.
MIN_WEIGHT_GIB = 1e-6  # about 1 KiB
MIN_RATE = 1e-3


def _zero_or_at_least(low: float):
    def check(value: float) -> float:
        if 0 < value < low:
            raise PydanticCustomError("greater_than_equal", "Input should be 0 or at least {low}", {"low": low})
        return value

    return AfterValidator(check)


class Custom(Body):
    n_layer: int = Field(..., ge=1, le=1024)
    n_head: int = Field(..., ge=1, le=4096)
    n_kv_head: int = Field(..., ge=1, le=4096)
    head_dim: int = Field(..., ge=1, le=16384)
    kv_lora_rank: int | None = Field(None, ge=1, le=65536)
    qk_rope_head_dim: int | None = Field(None, ge=0, le=16384)


class ModelChoice(Body):
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
    n: int = Field(1000, description="requests of the synthetic workload, 1 to KVSCOPE_CAPACITY_SIM_MAX_REQUESTS")
    rate: Annotated[float, _zero_or_at_least(MIN_RATE)] = Field(
        10.0, ge=0, le=1e6, description=f"requests per second (0: all at once; else at least {MIN_RATE})")
    prompt_min: int = Field(128, ge=1, le=1_000_000)
    prompt_max: int = Field(1024, ge=1, le=1_000_000)
    output_min: int = Field(32, ge=1, le=1_000_000)
    output_max: int = Field(256, ge=1, le=1_000_000)
    shared_prefix_fraction: float = Field(0.5, ge=0, le=1)
    prefix_len: int = Field(256, ge=0, le=1_000_000)
    seed: int = Field(0, ge=0, le=2**31)
    requests_text: str | None = Field(None, max_length=MAX_TEXT)
    weight_gib: float | None = Field(None, ge=MIN_WEIGHT_GIB, le=100_000,
                                     description="omit: parameters × 2 bytes (needed for model=custom)")


class CheckBody(Body):
    model: str | None = Field(None, max_length=120, description="a model this server runs")
    num_blocks: int = Field(9, description="1 to KVSCOPE_CAPACITY_CHECK_MAX_BLOCKS")
    block_size: int = Field(4, description="1, 2, 4 … up to KVSCOPE_CAPACITY_CHECK_MAX_BLOCK_SIZE")
    max_num_seqs: int = Field(3, description="1 to KVSCOPE_CAPACITY_CHECK_MAX_SEQS")
    requests_text: str = Field("0 7 12\n0 9 10\n1 5 14\n3 12 6\n4 3 9", max_length=2000,
                               description="one request a line: arrival, prompt tokens, output tokens (at most "
                                           "KVSCOPE_CAPACITY_CHECK_MAX_REQUESTS, _MAX_PROMPT, _MAX_OUTPUT)")


def _choice(body: ModelChoice) -> dict:
    return {"model": body.model, "config_json": body.config_json,
            "custom": body.custom.model_dump() if body.custom is not None else None}


@router.get("/capacity", include_in_schema=False)
def read_capacity_page(request: Request, lab: CapacityDep):
    return render(request, "capacity.html", page="capacity", **lab.page())


@router.get("/api/capacity/models", tags=["capacity"])
def read_models(lab: CapacityDep) -> dict:
    """The catalog of real configs, the models this server runs, and the GPUs the roofline knows."""
    return lab.models()


@router.post("/api/capacity/calculate", tags=["capacity"], responses=errors(422))
def calculate_capacity(lab: CapacityDep, body: CalcBody) -> dict:
    """Bytes per token (formula filled in), per request and batch; KV memory → blocks → tokens → concurrency."""
    return lab.calculate(**_choice(body), **body.model_dump(exclude={"model", "config_json", "custom"}))


@router.post("/api/capacity/simulate", tags=["capacity"], responses=errors(422, 429, 503))
async def simulate(request: Request, lab: CapacityDep, body: SimBody) -> dict:
    """Continuous batching as vLLM schedules it, over a synthetic workload or a pasted request list.

    Bounded (``app/capacity/bounds.py``): refused before it starts when too big, stopped at the step or time
    limit (the answer says so and shows what ran), and stopped when the client disconnects."""
    choices = {**body.model_dump(exclude={"model", "config_json", "custom"}), **_choice(body)}
    return await run_until_disconnected(request, lambda cancel: lab.simulate(cancel, **choices))


@router.post("/api/capacity/check", tags=["capacity"], responses=errors(422, 429, 503))
def check_against_engine(lab: CapacityDep, body: CheckBody) -> dict:
    """The same requests and budgets through the simulator and the real paged engine, step by step."""
    return lab.check(**body.model_dump())
