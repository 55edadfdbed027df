"""Every failure becomes one JSON shape: {"error": {"message", "type", "param", "code"}}.

`param` names the request field at fault (dotted path for nested fields), or null. Mapping:
validation error / bad JSON / InvalidRequestError -> 400, bad key -> 401, a non-admin key on
an admin route -> 403, unknown route -> 404, body too large -> 413, EngineStateError (wrong
state: asleep, no weights, not paused, no update in progress) -> 409, EngineDeadError -> 503,
a timeout -> 504, anything else -> 500.

Errors raised inside the engine-core process arrive here with their own type again
(engine.errors.remote_error), so the mapping is by class, never by message text.
"""
import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, EngineStartError, EngineStateError, InvalidRequestError
from weight_sync.group import WeightGroupError, WeightPushRefused, WeightTransferError

logger = logging.getLogger("rollout")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "method_not_allowed", 409: "engine_state_error",
          413: "request_too_large", 500: "internal_error", 503: "engine_dead_error", 504: "timeout_error"}
# bad input found by the engine (ValueError covers InvalidRequestError / UnsupportedModelError;
# TypeError: wrong arguments to a collective_rpc method; OSError kinds: a bad checkpoint path)
_BAD_INPUT = (ValueError, TypeError, KeyError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


class APIError(Exception):
    """`extra`: more fields of the error object (a weight update's failed `phase`, ...)."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or _TYPES.get(status, "error")
        self.extra = extra or {}


def error_body(status: int, message: str, param: str | None = None, type: str | None = None,
               extra: dict | None = None) -> dict:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "error"), "param": param,
                      "code": status, **(extra or {})}}


def error_response(status: int, message: str, param: str | None = None, type: str | None = None,
                   headers: dict | None = None, extra: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, type, extra), status_code=status, headers=headers)


def engine_error(e: BaseException, param: str | None = None) -> APIError:
    """The APIError for an exception raised by an engine call."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is dead: {e}")
    if isinstance(e, EngineStartError):  # a scale-up whose new replicas failed: the others serve on
        return APIError(503, f"new engine replicas failed to start: {e}")
    if isinstance(e, TimeoutError):
        return APIError(504, str(e) or "the engine did not answer in time")
    text = str(e)
    if isinstance(e, EngineStateError):  # the field only where the engine names one
        return APIError(409, text, e.param)
    if isinstance(e, WeightPushRefused):  # names / shapes / dtypes did not match
        return APIError(400, text, param or "update_info", type="weight_transfer_error")
    if isinstance(e, WeightGroupError):  # no trainer joined at that address in time
        return APIError(400, text, param or "init_info", type="weight_transfer_error")
    if isinstance(e, WeightTransferError):
        return APIError(500, text, type="weight_transfer_error")
    if isinstance(e, _BAD_INPUT):  # the field the engine names, else the one the route expects
        return APIError(400, text, getattr(e, "param", None) or param)
    logger.exception("unexpected error", exc_info=e)
    return APIError(500, f"{type(e).__name__}: {e}")


_UNION_TAG = re.compile(r"[a-z_]+\[.*\]|str|int|float|bool|none|function-.*|literal\[.*\]")


def validation_param(loc) -> str | None:
    """FastAPI's error location ("body", "sampling_params", "top_p") -> "sampling_params.top_p"."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    # drop pydantic's union-member tags such as "str" or "list[int]"; list positions as [i]
    out = ""
    for p in parts:
        if _UNION_TAG.fullmatch(p):
            continue
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def validation_message(first: dict, param: str | None) -> str:
    kind, got = first.get("type", ""), first.get("input")
    if param is None:
        return "the body must be a JSON object (send Content-Type: application/json)"
    if kind == "missing":
        return f"the field {param!r} is required"
    if kind == "extra_forbidden":
        return f"unknown field {param!r}"
    shown = "" if got is None or isinstance(got, dict) else f" (got {json.dumps(got, default=str)[:80]})"
    if any(_UNION_TAG.fullmatch(str(p)) for p in first.get("loc", ())):
        return f"{param} has the wrong type{shown}"
    return f"{param}: {first.get('msg', 'invalid value')}{shown}"


ERROR_SCOPE_KEY = "rollout.error"  # the error's message, in the request's scope, for the request's log line


def _answered(request: Request, status: int, message: str, param: str | None = None, type: str | None = None,
              headers: dict | None = None, extra: dict | None = None) -> JSONResponse:
    """error_response, with the message left in the scope for the request's log line (server.py)."""
    request.scope[ERROR_SCOPE_KEY] = message + (f" (param: {param})" if param else "")
    return error_response(status, message, param, type, headers=headers, extra=extra)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _answered(request, e.status, e.message, e.param, e.type, extra=e.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx", {})
            return _answered(request, 400, f"the body is not valid JSON: {ctx.get('error', 'parse error')}", None)
        param = validation_param(first.get("loc", ()))
        msg = validation_message(first, param)
        others = {validation_param(x.get("loc", ())) for x in errors} - {param}
        inner = sorted(o for o in others if o and param and o.startswith((param + "[", param + ".")))
        if inner:  # a union refused as a whole: name the element at fault (stop[1], not stop)
            others = others - {inner[0]} | {param}
            param = inner[0]
        more = f" (and problems with {', '.join(sorted(map(str, others)))})" if others else ""
        return _answered(request, 400, msg + more, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return _answered(request, 404, f"no route {request.method} {request.url.path}")
        if e.status_code == 405:  # Allow: the methods the route takes (RFC 9110)
            allow = (e.headers or {}).get("Allow", "")
            return _answered(request, 405, f"{request.method} is not allowed on {request.url.path} (allowed: {allow})",
                                  headers=e.headers)
        return _answered(request, e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        err = engine_error(e)
        return _answered(request, err.status, err.message, err.param, err.type)

    @app.exception_handler(Exception)
    async def _any(request: Request, e: Exception):
        err = engine_error(e)
        return _answered(request, err.status, err.message, err.param, err.type)


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "integer"}}}}}


def document_errors(app: FastAPI) -> None:
    """Make the OpenAPI document say what the server sends: a validation error is a 400 with
    our error body (FastAPI documents a 422 with its own body, which this server never sends)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)
                    responses["400"] = {"description": "Bad request (the message and `param` name the field)",
                                        "content": {"application/json": {
                                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            schemas["ErrorResponse"] = _ERROR_SCHEMA
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
