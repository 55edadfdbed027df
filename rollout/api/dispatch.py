"""One route name, two bodies: where a framework's dialect reuses one of our route names with
another body (SGLang's /generate and /update_weights_from_disk, prime-rl's /update_weights), the
route reads the JSON once and picks the dialect by the fields it carries. The body is then
validated against the chosen model with the same 400s as a FastAPI-declared body, and the
OpenAPI document lists every accepted body (`one_of`)."""
import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from rollout.api.errors import APIError


async def json_object(request: Request) -> dict:
    """The body as a JSON object (a 400 in our error shape otherwise)."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object (send Content-Type: application/json)")
    return data


def parse(model: type[BaseModel], data: dict) -> BaseModel:
    """`data` validated as `model`; errors as FastAPI reports a declared body's (located in "body")."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([dict(err, loc=("body", *err["loc"])) for err in e.errors()]) from None


_DOCUMENTED: dict[str, type[BaseModel]] = {}  # the bodies one_of names, added to /openapi.json's components


def one_of(*models: type[BaseModel]) -> dict:
    """`openapi_extra` for a route that takes any of these bodies."""
    _DOCUMENTED.update((m.__name__, m) for m in models)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "oneOf": [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]}}}}}


def document_bodies(app) -> None:
    """Put the bodies of one_of routes into the OpenAPI document's components."""
    build = app.openapi

    def openapi() -> dict:
        first = app.openapi_schema is None
        schema = build()
        if first:
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _DOCUMENTED.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(body.pop("$defs", {}))
                schemas.setdefault(name, body)
        return schema

    app.openapi = openapi
