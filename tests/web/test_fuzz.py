"""A bounded schemathesis run over /openapi.json against both models: no input causes a 5xx, every answer is one
the schema documents (its status code, media type, headers and body), and invalid input is refused.

Every operation gets ``KVSCOPE_FUZZ_EXAMPLES`` generated requests (default 3) of valid data on each of two
servers, DistilGPT-2-shaped + built-in and the built-in model alone, and as many of invalid data (schemathesis's
negative mode: wrong types, missing fields, values out of bounds) on the first. Invalid data is refused by the
request's validation, which the schema defines; both servers publish the same schema (checked below), so the
derandomized fuzzer would send the second one the same invalid requests again. A generated request that names a
model gets one of the served names half of the time, so the model code is reached and not only the validation.
Prompts are capped at 300 characters, arena runs at 4 steps of 64 tokens, the decode timing at 1 repeat on 32
tokens, speculative runs at 8 new tokens of a 64-token prompt, the roofline at 128 tokens and batches of 4, the
capacity check at 4 requests of 16 + 8 tokens and training runs at 0.5 s, so the run stays bounded: these limits
move where a request is refused, not which code a request reaches (longer runs are tested elsewhere).

The fuzzer sends one request at a time, so the server is never busy. Training runs are stopped after each
training request (a run waiting in line is the state of the server, not an answer to the input; the lines have
their own tests), and may train for 0.5 s at most: a streamed run (/api/train/jobs) answers until its run ends.
"""

from __future__ import annotations

import os
import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.web.main import create_app
from tests.conftest import make_state

EXAMPLES = int(os.environ.get("KVSCOPE_FUZZ_EXAMPLES", "3"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
NEGATIVE_CHECKS = [*CHECKS, negative_data_rejection]  # invalid data is refused (a 4xx), never taken


def _stop_training(state) -> None:
    state.training.line.close()
    state.training.wait(timeout=120)


def _fuzzed_settings(settings):
    return settings.with_(max_prompt_chars=300, arena_max_steps=4, arena_max_prompt_tokens=64, train_max_s=0.5,
                          decode_timing_repeats=1, decode_timing_tokens=32, spec_max_new_tokens=8,
                          spec_max_prompt_tokens=64, roofline_max_context=128, roofline_max_batch=4,
                          capacity_check_max_requests=4, capacity_check_max_prompt=16, capacity_check_max_output=8)


def test_both_servers_publish_the_same_schema(settings, distil, tiny):
    """What lets the invalid requests be sent to one of them only."""
    one, both = (create_app(state=make_state(_fuzzed_settings(settings), *m)) for m in ((tiny,), (distil, tiny)))
    assert one.openapi() == both.openapi()


@pytest.mark.parametrize("served, modes", [("distilgpt2+builtin", tuple(GenerationMode)),
                                           ("builtin", (GenerationMode.POSITIVE,))])
def test_every_answer_is_documented_and_none_is_a_server_error(served, modes, settings, distil, tiny):
    models = (distil, tiny) if served == "distilgpt2+builtin" else (tiny,)
    state = make_state(_fuzzed_settings(settings), *models)
    app = create_app(state=state)
    names = [m.name for m in models]
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    calls: dict[GenerationMode, int] = dict.fromkeys(GenerationMode, 0)
    failures: list[str] = []

    def check(case, mode: GenerationMode) -> None:
        pick = zlib.crc32(repr((case.path, case.body, case.query)).encode())
        for part in (case.body, case.query):
            if isinstance(part, dict) and "model" in part and pick % 2 and mode is GenerationMode.POSITIVE:
                part["model"] = names[pick % len(names)]
        response = case.call(timeout=600)
        calls[mode] += 1
        if case.path.startswith("/api/train/"):
            _stop_training(state)
        try:
            case.validate_response(response, checks=CHECKS if mode is GenerationMode.POSITIVE else NEGATIVE_CHECKS)
        except (Failure, FailureGroup) as failure:  # collected: one run reports every operation that fails
            failures.append(f"{mode.value} {case.method} {case.formatted_path} body={case.body!r:.200} "
                            f"query={case.query!r:.200} -> {response.status_code}: {failure}"[:1500])

    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            raw = operation.definition.raw
            takes_input = bool(raw.get("parameters") or raw.get("requestBody"))
            for mode in modes if takes_input else [GenerationMode.POSITIVE]:  # nothing to get wrong
                run = settings_for(given(case=operation.as_strategy(generation_mode=mode))(check))
                try:
                    run(mode=mode)
                except Unsatisfiable:  # every input it takes is valid (free strings): no invalid request exists
                    assert mode is GenerationMode.NEGATIVE, operation.label
    finally:
        _stop_training(state)
    assert not failures, "\n\n".join(failures)
    n_ops = len(list(schema.get_all_operations()))
    assert calls[GenerationMode.POSITIVE] >= 2 * n_ops
    if GenerationMode.NEGATIVE in modes:
        assert calls[GenerationMode.NEGATIVE] >= n_ops // 2


def settings_for(test):
    return settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))(test)
