"""A bounded schemathesis run over /openapi.json against both models: no input may cause a 5xx.

Every operation gets ``KVSCOPE_FUZZ_EXAMPLES`` generated requests (default 4) on each of two servers:
DistilGPT-2-shaped + built-in, and the built-in model alone. A generated request that names a model gets
one of the served names half of the time, so the model code is reached and not only the validation.
Prompts are capped at 300 characters here so the run stays bounded (longer prompts are tested elsewhere).

The fuzzer sends one request at a time, so the server is never busy. Training runs are stopped after each
training request (a run waiting in line is the state of the server, not an answer to the input; the lines have
their own tests), and may train for 2 s at most: a streamed run (/api/train/jobs) answers until its run ends.
"""

from __future__ import annotations

import os
import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from app.web.main import create_app
from tests.conftest import make_state

EXAMPLES = int(os.environ.get("KVSCOPE_FUZZ_EXAMPLES", "4"))


def _stop_training(state) -> None:
    state.training.line.close()
    state.training.wait(timeout=120)


@pytest.mark.parametrize("served", ["distilgpt2+builtin", "builtin"])
def test_no_input_causes_a_server_error(served, settings, distil, tiny):
    models = (distil, tiny) if served == "distilgpt2+builtin" else (tiny,)
    state = make_state(settings.with_(max_prompt_chars=300, train_max_s=2.0), *models)
    app = create_app(state=state)
    names = [m.name for m in models]
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    calls = 0

    def check(case) -> None:
        nonlocal calls
        pick = zlib.crc32(repr((case.path, case.body, case.query)).encode())
        for part in (case.body, case.query):
            if isinstance(part, dict) and "model" in part and pick % 2:
                part["model"] = names[pick % len(names)]
        response = case.call(timeout=600)
        calls += 1
        if case.path.startswith("/api/train/"):
            _stop_training(state)
        assert response.status_code < 500, (case.method, case.formatted_path, case.body, case.query,
                                            response.text[:300])

    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            run = settings_for(given(case=operation.as_strategy())(check))
            run()
    finally:
        _stop_training(state)
    assert calls >= 2 * len(list(schema.get_all_operations()))


def settings_for(test):
    return settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))(test)
