"""The answers besides 200, as /openapi.json documents them (and /docs shows them).

Every error body has one shape, ``{"detail": "<one sentence for a person, in the request's language>"}``:
request validation included, whose pydantic list the handler in ``app/web/main.py`` turns into one sentence.
So the schema documents that shape (``ErrorBody``), never FastAPI's default list for 422.

Two sources of errors, documented two ways::

    a route's own code     404 NotFound  410 Expired  422 BadInput  429 Throttled  503 Busy
                           the route says which: ``@router.post(..., responses=errors(410, 503))``
    before any route runs  400  a Host not on the allow-list (any request), a body that cannot be read
                           403  a state-changing request sent by another site's page
                           413  a body over ``max_body_bytes`` (checked on any request)
                           422  an operation's parameters or body fail validation
                           the same for every operation, so ``install`` adds them to the generated schema

429 and 503 carry a Retry-After header (seconds) when the server can tell when to try again.

JSON bodies derive from ``Body``: validated strictly, so what the server accepts is what the schema says.
JSON Schema's ``integer`` and ``number`` are not ``true``/``false``, and ``"5"`` is not a number; pydantic's lax
mode would take ``{"seed": false}`` as 0. A ``Literal`` of numbers also needs ``NotBool`` (``True == 1``).
Every text in a body is real Unicode: JSON may spell a lone surrogate (``"\\ud800"``), which Python's parser keeps
and no encoder can write back (the tokenizer, the log, the answer itself); ``Body`` refuses it, naming the field,
before any route sees it.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from app.errors import BadInput

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what is left of one after Python joined every valid pair


class Body(BaseModel):
    """A JSON request body: every field takes exactly its type (no true for 1, no "5" for 5; 5 for 5.0 is fine),
    and every string in it, at any depth, is encodable text (no lone surrogate)."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        _refuse_surrogates(data, ())
        return data


def _refuse_surrogates(value: Any, where: tuple) -> None:
    """``BadInput`` (422, a catalog sentence, not pydantic's list) naming the first string that holds a lone
    surrogate, and where in it; nested bodies are walked too, lists by index."""
    if isinstance(value, str):
        found = _LONE_SURROGATE.search(value)
        if found:
            raise BadInput("err.text_surrogate", field=".".join(map(str, where)) or "body", at=found.start(),
                           code=f"\\u{ord(found.group()):04x}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_surrogates(key, where)
            _refuse_surrogates(item, (*where, key))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _refuse_surrogates(item, (*where, i))


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


NotBool = BeforeValidator(_not_bool)  # for Literal[1, 2, 4]: pydantic matches True to 1 even when strict


class ErrorBody(BaseModel):
    detail: str = Field(description="What went wrong and what to do, for a person, in the request's language")


WHY = {
    400: "Bad request: the Host header is not one this server answers to, or the body cannot be read",
    403: "Refused: a state-changing request sent by another site's page, or a class-kit pin deleted by another browser",
    404: "Not found: the thing named does not exist",
    410: "Gone: what the id names has ended or expired, or belongs to another browser",
    409: "Conflict: the thing named cannot be given as it is (an engine's capture over its budget or still running, or"
         " of a model this server does not run)",
    413: "The request body is larger than the server accepts",
    422: "Invalid input: a wrong type, a value out of bounds, or a name the server does not know",
    429: "This browser has too many requests waiting for the model: retry later",
    502: "The serving engine named by index could not be reached or answered with something KVScope cannot read",
    503: "The server is busy (model queue, caps on sessions or memory, a run in progress): retry later",
}
ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before trying again", "required": False,
                               "schema": {"type": "integer"}}}
UNSAFE = {"post", "put", "patch", "delete"}


def error_response(status: int) -> dict:
    """One documented error answer: its reason, the ``ErrorBody`` JSON, and Retry-After where it applies."""
    response: dict = {"description": WHY[status], "content": {"application/json": {"schema": ERROR_REF}}}
    if status in (429, 503):
        response["headers"] = RETRY_AFTER
    return response


def errors(*statuses: int) -> dict[int | str, dict]:
    """``responses=`` for a route: the errors its own code can answer (the middleware's are added for all)."""
    return {status: error_response(status) for status in statuses}


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` add the errors every operation can get and document 422 as it really is."""
    generate = app.openapi

    def openapi() -> dict:
        schema = app.openapi_schema
        if schema is None:
            schema = generate()  # FastAPI keeps the schema it returns in app.openapi_schema
            document_common_errors(schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema


def document_common_errors(schema: dict) -> dict:
    for path in schema.get("paths", {}).values():
        for method, operation in path.items():
            responses = operation.setdefault("responses", {})
            takes_input = bool(operation.get("parameters") or operation.get("requestBody"))
            common = [400, 413] + ([403] if method in UNSAFE else []) + ([422] if takes_input else [])
            for status in common:
                responses.setdefault(str(status), error_response(status))
            if "422" in responses:  # FastAPI's default says a list; ours is one sentence, like every error
                responses["422"] = error_response(422)
            operation["responses"] = dict(sorted(responses.items()))
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorBody"] = ErrorBody.model_json_schema()
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema
