"""Map errors to HTTP: ``{"error": {"code", "message", "details"}}``, 4xx for caller mistakes."""

from __future__ import annotations

import logging

import redis
from flask import Flask, jsonify
from marshmallow import ValidationError
from werkzeug.exceptions import HTTPException

from prorl_farm.errors import Conflict, FarmError, NotFound

log = logging.getLogger(__name__)


class ApiError(FarmError):
    """An API refusal: its HTTP status, error code, message and field details."""

    def __init__(self, status: int, code: str, message: str, details=None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details
        self.headers = headers or {}


def _flatten(messages, prefix: str = "") -> list[str]:
    """{"instances": {0: {"run_s": ["Not a valid number."]}}} -> ["instances.0.run_s: ..."]."""
    if isinstance(messages, dict):
        out = []
        for key, value in messages.items():
            name = prefix if key == "_schema" else f"{prefix}.{key}" if prefix else str(key)
            out += _flatten(value, name)
        return out
    if isinstance(messages, list) and all(isinstance(m, str) for m in messages):
        return [f"{prefix or 'body'}: {' '.join(messages)}"]
    if isinstance(messages, list):
        return [x for m in messages for x in _flatten(m, prefix)]
    return [f"{prefix or 'body'}: {messages}"]


def error_response(status: int, code: str, message: str, details=None):
    return jsonify({"error": {"code": code, "message": message, "details": details or {}}}), status


def validation_error(messages, code: str = "invalid_request"):
    lines = _flatten(messages)
    return ApiError(400, code, "; ".join(lines[:10]), messages)


def register_error_replies(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(e: ApiError):
        resp, status = error_response(e.status, e.code, e.message, e.details)
        resp.headers.update(e.headers)
        return resp, status

    @app.errorhandler(ValidationError)
    def _validation(e: ValidationError):
        err = validation_error(e.normalized_messages())
        return error_response(err.status, err.code, err.message, err.details)

    @app.errorhandler(NotFound)
    def _not_found(e: NotFound):
        return error_response(404, "not_found", str(e))

    @app.errorhandler(Conflict)
    def _conflict(e: Conflict):
        return error_response(409, e.code, str(e))

    @app.errorhandler(HTTPException)
    def _http(e: HTTPException):
        code = (e.name or "error").lower().replace(" ", "_")
        body, status = error_response(e.code or 500, code, e.description or e.name)
        # Keep what the exception says about itself (Allow on a 405, for one).
        for name, value in e.get_headers():
            if name.lower() != "content-type":
                body.headers[name] = value
        return body, status

    @app.errorhandler(redis.exceptions.ConnectionError)
    def _redis_down(e: Exception):
        return error_response(503, "redis_unavailable", f"job store unreachable: {e}")

    @app.errorhandler(redis.exceptions.OutOfMemoryError)
    def _redis_full(e: Exception):
        # Writes of one request go in one transaction (or script): refused, none landed.
        return error_response(503, "redis_out_of_memory", "job store out of memory "
                              f"(maxmemory); nothing of this request was written: {e}")

    @app.errorhandler(Exception)
    def _internal(e: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal_error", f"{type(e).__name__}: {e}")
