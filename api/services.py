"""Access to the FarmServices of the current app, and request-body helpers."""

from __future__ import annotations

from flask import current_app, request
from werkzeug.exceptions import BadRequest

from api.errors import ApiError


def services():
    return current_app.extensions["prorl"]


def json_body() -> dict:
    """The request body as a JSON object, or a 400 saying why it is not one."""
    if not request.is_json:
        raise ApiError(415, "unsupported_media_type", "send Content-Type: application/json")
    try:
        body = request.get_json()
    except BadRequest as e:
        raise ApiError(400, "invalid_json", "request body is not valid JSON") from e
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "body: must be a JSON object",
                       {"_schema": ["Not an object."]})
    return body
