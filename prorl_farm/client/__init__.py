"""Trainer-side SDK."""

from prorl_farm.client.farm import (
    FarmBadRequest,
    FarmClient,
    FarmConflict,
    FarmConnectionError,
    FarmHTTPError,
    FarmNotFound,
    FarmUnauthorized,
    FarmUnavailable,
)

__all__ = ["FarmBadRequest", "FarmClient", "FarmConflict", "FarmConnectionError",
           "FarmHTTPError", "FarmNotFound", "FarmUnauthorized", "FarmUnavailable"]
