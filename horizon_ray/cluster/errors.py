"""Typed domain errors that cross the service boundary (coordinator -> client -> API).

Each has a stable `code` the API maps to an HTTP status in one place, a human `message`, and `details`
(plain data, safe to put in a JSON body). They survive Ray: the Ray client ships (code, message, details)
and rebuilds the same class with `from_wire`.
"""

from __future__ import annotations

from typing import Any


class HorizonError(Exception):
    """Base of every domain error; never carries a traceback to a client."""

    code = "error"  # stable machine-readable code; subclasses override

    def __init__(self, message: str, **details: Any):
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> HorizonError:
        cls = _BY_CODE.get(d.get("code", ""), HorizonError)
        return cls(d.get("message", ""), **(d.get("details") or {}))

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.details))


def _rebuild(cls: type[HorizonError], message: str, details: dict[str, Any]) -> HorizonError:
    return cls(message, **details)


class InvalidRequest(HorizonError):
    """A malformed argument (bad tenant name, unknown status filter...). HTTP 400."""

    code = "invalid_request"


class InvalidSpec(InvalidRequest):
    """The job spec is malformed (unknown key, bad value); the message names the fix. HTTP 400/422."""

    code = "invalid_spec"


class JobRejected(HorizonError):
    """No node of the cluster can ever hold the job; details: reason, nodes (per-node verdicts). 422."""

    code = "rejected"


class QuotaExceeded(HorizonError):
    """The tenant's quota forbids the job (too many queued jobs, or a job larger than its RAM quota). 429."""

    code = "quota_exceeded"


class JobNotFound(HorizonError):
    """No such job for this tenant (another tenant's job is reported the same way). 404."""

    code = "not_found"


class InvalidTransition(HorizonError):
    """The job's state forbids the operation (e.g. cancelling a finished job). 409."""

    code = "invalid_transition"


class IdempotencyConflict(HorizonError):
    """The idempotency key was used before with a different spec. 409."""

    code = "idempotency_conflict"


class Unauthorized(HorizonError):
    """The call's credential is missing, invalid, or another tenant's than the tenant it names
    (`horizon_ray.cluster.gate`). 401."""

    code = "unauthorized"


class CoordinatorUnavailable(HorizonError):
    """The coordinator cannot be reached or is not ready. 503."""

    code = "unavailable"


_BY_CODE: dict[str, type[HorizonError]] = {
    c.code: c
    for c in (
        InvalidRequest,
        InvalidSpec,
        JobRejected,
        QuotaExceeded,
        JobNotFound,
        InvalidTransition,
        IdempotencyConflict,
        CoordinatorUnavailable,
        Unauthorized,
    )
}
