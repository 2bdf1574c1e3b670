"""Access to the FarmServices of the current app, and request-body helpers."""

from __future__ import annotations

from flask import current_app, request
from werkzeug.exceptions import BadRequest

from api.errors import ApiError


def services():
    return current_app.extensions["prorl"]


# JSON documents nested deeper than this are refused before any work is done on them.
MAX_JSON_DEPTH = 64


def _too_deep(raw: bytes, limit: int) -> bool:
    """True if the JSON text nests arrays/objects deeper than ``limit`` (a linear scan that
    skips strings, run before the parser so that no recursion happens on hostile input)."""
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def json_body() -> dict:
    """The request body as a JSON object, or a 4xx saying why it is not one."""
    if not request.is_json:
        raise ApiError(415, "unsupported_media_type", "send Content-Type: application/json")
    raw = request.get_data(cache=True)
    if _too_deep(raw, MAX_JSON_DEPTH):
        raise ApiError(400, "invalid_json", f"body: JSON nested deeper than {MAX_JSON_DEPTH} "
                       "levels", {"_schema": [f"Nested deeper than {MAX_JSON_DEPTH} levels."]})
    try:
        body = request.get_json()
    except (BadRequest, RecursionError) as e:
        raise ApiError(400, "invalid_json", "request body is not valid JSON") from e
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "body: must be a JSON object",
                       {"_schema": ["Not an object."]})
    return body
