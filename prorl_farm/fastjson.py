"""JSON on the per-call paths (the model gateway, the token-in client): orjson where it is
installed (a call's JSON, its token ids above all, is several times cheaper), else the
standard library; the same documents either way."""

from __future__ import annotations

import json

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; this keeps a bare install
    orjson = None


def dumps(doc) -> bytes:
    """``doc`` as compact-enough UTF-8 JSON bytes."""
    if orjson is not None:
        try:
            return orjson.dumps(doc)
        except TypeError:  # what orjson does not take (an int past 64 bits): json does
            pass
    return json.dumps(doc).encode()


def loads(data: bytes | str):
    """A JSON document; ValueError if it is not one. What orjson refuses and the standard
    library reads (NaN, Infinity: Python servers write them) is read as before."""
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)
