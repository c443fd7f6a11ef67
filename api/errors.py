"""The one place that turns errors into HTTP responses.

Every error body is ``{"error": {"code": str, "message": str, ...}}``; validation errors add ``field`` (the
dotted name of the first bad field) and ``details``; a job spec in a body that does not parse is an
``invalid_spec`` with the same message the CLI prints. Domain errors of the coordinator map to a status by
their type, a ``BadInput`` of our own code to 422; anything unexpected becomes a 500 with a fixed message. A
traceback never leaves the process.
"""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from horizon_ray.cluster.errors import (
    CoordinatorUnavailable,
    HorizonError,
    IdempotencyConflict,
    InvalidRequest,
    InvalidSpec,
    InvalidTransition,
    JobNotFound,
    JobRejected,
    QuotaExceeded,
    Unauthorized,
)
from horizon_ray.errors import BadInput
from horizon_ray.jobspec import JobSpec, spec_error

log = logging.getLogger("api")

# Domain error type -> HTTP status. Subclasses resolve through the MRO, HorizonError itself last.
DOMAIN_STATUS: dict[type[HorizonError], int] = {
    InvalidSpec: 422,
    InvalidRequest: 422,
    JobRejected: 422,
    QuotaExceeded: 429,
    JobNotFound: 404,
    InvalidTransition: 409,
    IdempotencyConflict: 409,
    CoordinatorUnavailable: 503,
    # the coordinator's gate refused the API's own credential: its key table differs from the API's
    Unauthorized: 503,
    HorizonError: 400,
}

# Default codes for bare HTTP errors raised by the framework (unknown route, wrong method, ...).
HTTP_CODES: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}


# What a client learns when the coordinator cannot be reached: the cause (Ray actor ids, addresses, processes)
# goes to the server's log, never into a response.
UNAVAILABLE_MESSAGE = "the coordinator is not answering; retry in a few seconds"
UNAVAILABLE_RETRY_S = 5


class SafeJSONResponse(JSONResponse):
    """JSON whose strings are always UTF-8: a lone surrogate (in a record stored before the edge refused them)
    is written as its JSON escape instead of failing the whole answer."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8", "backslashreplace")


class ApiError(Exception):
    """An HTTP-level error raised by the API's own code (bad path in a spec, missing file, ...)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
        **details: Any,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers
        self.details = details


def error_body(code: str, message: str, *, field: str | None = None, details: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        err["field"] = field
    if details:
        err["details"] = jsonable_encoder(details)
    return {"error": err}


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    field: str | None = None,
    details: Any = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return SafeJSONResponse(error_body(code, message, field=field, details=details), status_code=status,
                            headers=headers)


def domain_status(exc: HorizonError) -> int:
    for cls in type(exc).__mro__:
        if cls in DOMAIN_STATUS:
            return DOMAIN_STATUS[cls]
    return 400


def spec_error_field(message: str) -> str | None:
    """Best-effort field name out of a JobSpec ValueError ("training.lr is ...", "unknown key 'x.y'")."""
    if message.startswith("unknown key '"):
        return message[len("unknown key '"):].split("'", 1)[0]
    head = message.split(" ", 1)[0].rstrip(":,;")
    if head and all(part.replace("_", "").replace("[", "").replace("]", "").isalnum()
                    for part in head.split(".")) and ("." in head or "_" in head):
        return head
    return None


def _loc_to_field(loc: tuple | list, kind: str) -> str:
    if kind == "json_invalid":  # loc holds a character offset, not a field
        return "body"
    # the first element says where the parameter is; the rest names it (a parameter may be called "path")
    parts = [str(p) for p in (loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)]
    return ".".join(parts) or ".".join(str(p) for p in loc)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, field=exc.field, details=exc.details,
                          headers=exc.headers)


async def _domain_error(request: Request, exc: HorizonError) -> JSONResponse:
    status = domain_status(exc)
    field = exc.details.get("field") if isinstance(exc.details.get("field"), str) else None
    if isinstance(exc, InvalidRequest) and field is None:
        field = spec_error_field(exc.message)
    if status >= 500:
        log.warning("domain error %s on %s %s: %s", exc.code, request.method, request.url.path, exc.message)
        return error_response(status, exc.code, UNAVAILABLE_MESSAGE,
                              headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})
    return error_response(status, exc.code, exc.message, field=field,
                          details={k: v for k, v in exc.details.items() if k != "field"})


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    inside = [e for e in errors if tuple(e.get("loc", ()))[:1] == ("body",) and len(e.get("loc", ())) > 1
              and e.get("type") != "json_invalid"]
    if inside:  # within the JSON object of a body: a job spec, or another model (a generation request)
        root = _body_model(request)
        bad = spec_error({**inside[0], "loc": tuple(inside[0]["loc"])[1:]}, root)
        return error_response(422, InvalidSpec.code if root is JobSpec else "bad_input", bad.message, field=bad.field)
    details = [
        {"field": _loc_to_field(e.get("loc", ()), e.get("type", "")), "message": e.get("msg", ""),
         "type": e.get("type", "")}
        for e in errors
    ]
    first = details[0] if details else {"field": "", "message": "invalid request"}
    message = f"{first['field']}: {first['message']}" if first["field"] else first["message"]
    return error_response(422, "validation_error", message, field=first["field"] or None, details=details)


def _body_model(request: Request) -> type[BaseModel]:
    """The pydantic model the route reads its JSON body into (the job spec unless the route says otherwise), so
    that a refusal names the request's own parameters."""
    field = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else JobSpec


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = HTTP_CODES.get(exc.status_code, "http_error")
    message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
    if exc.status_code == 404 and message == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405 and message == "Method Not Allowed":
        message = f"{request.method} is not allowed on {request.url.path}"
    return error_response(exc.status_code, code, message, headers=getattr(exc, "headers", None))


async def _bad_input(request: Request, exc: BadInput) -> JSONResponse:
    return error_response(422, "bad_input", exc.message, field=exc.field)


async def _client_disconnect(request: Request, exc: ClientDisconnect) -> JSONResponse:
    # an ordinary end of a request (a client that went away mid-upload, or one cut by the body idle timeout):
    # nothing was kept, nobody reads this answer, and it is no error of the server
    log.info("client disconnected during %s %s", request.method, request.url.path)
    return error_response(400, "client_disconnected", "the client disconnected before the request was read")


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device, disk quota exceeded
DISK_FULL_RETRY_S = 300  # Retry-After of a 507: an operator frees space, or old jobs' outputs are deleted


async def _os_error(request: Request, exc: OSError) -> JSONResponse:
    if exc.errno in DISK_FULL_ERRNOS:
        # the service's disk is full: the client may retry once space is freed; /readyz says not ready meanwhile
        log.warning("disk full during %s %s: %s", request.method, request.url.path, exc.strerror)
        return error_response(507, "insufficient_storage", "the service's storage is full; retry later",
                              headers={"Retry-After": str(DISK_FULL_RETRY_S)})
    return await _unexpected(request, exc)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal_error", "internal server error; the server log has the details")


def install_error_handlers(app: FastAPI) -> None:
    # Starlette calls each handler with an exception of its type; its signature asks for handlers of any
    # Exception, so the table's handlers take Any
    handlers: dict[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]] = {
        ApiError: _api_error, HorizonError: _domain_error, BadInput: _bad_input,
        RequestValidationError: _validation_error, StarletteHTTPException: _http_error,
        ClientDisconnect: _client_disconnect, OSError: _os_error, Exception: _unexpected}
    for kind, handler in handlers.items():
        app.add_exception_handler(kind, handler)
