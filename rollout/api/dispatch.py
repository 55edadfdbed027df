"""One route name, two bodies: where a framework's dialect reuses one of our route names with
another body (SGLang's /generate and /update_weights_from_disk, prime-rl's /update_weights), the
route reads the JSON once and picks the dialect by the fields it carries. The body is then
validated against the chosen model with the same 400s as a FastAPI-declared body, and the
OpenAPI document lists every accepted body (`one_of`)."""
import json
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from rollout.api.errors import APIError

# route path -> [(does this body belong to the dialect, its handler(request, body dict), its
# model)]: the dialect modules register here, so rollout/api never imports rollout/compat
_ALTERNATES: dict[str, list[tuple[Callable[[dict], bool], Callable[[Request, dict], Awaitable],
                                  type[BaseModel]]]] = {}


def register(path: str, matches: Callable[[dict], bool], handler: Callable[[Request, dict], Awaitable],
             model: type[BaseModel]) -> None:
    """A dialect's body for the POST route `path`: bodies for which `matches` holds go to
    `handler`; `model` is the body's schema in /openapi.json."""
    _ALTERNATES.setdefault(path, []).append((matches, handler, model))


async def alternate(path: str, request: Request, data: dict):
    """The answer of the dialect whose body this is, or None (the body is the route's own)."""
    for matches, handler, _ in _ALTERNATES.get(path, ()):
        if matches(data):
            return await handler(request, data)
    return None


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


def one_of(*models: type[BaseModel]) -> dict:
    """`openapi_extra` for a route that reads its body itself (it takes `models`, and what the
    dialects register for its path: document_bodies adds those)."""
    _DOCUMENTED.update((m.__name__, m) for m in models)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "oneOf": [_ref(m) for m in models]}}}}}


_DOCUMENTED: dict[str, type[BaseModel]] = {}  # the bodies one_of names, added to /openapi.json's components


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def document_bodies(app) -> None:
    """Put the bodies of one_of routes, and the dialects' bodies for them, into /openapi.json."""
    build = app.openapi

    def openapi() -> dict:
        first = app.openapi_schema is None
        schema = build()
        if first:
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            models = dict(_DOCUMENTED)
            for path, entries in _ALTERNATES.items():
                body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
                body["oneOf"] += [_ref(m) for _, _, m in entries]
                models.update((m.__name__, m) for _, _, m in entries)
            for name, model in models.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(body.pop("$defs", {}))
                schemas.setdefault(name, body)
        return schema

    app.openapi = openapi
