"""Trainer-side SDK."""

from prorl_farm.trainer.farm import (
    FarmBadRequest,
    FarmClient,
    FarmConflict,
    FarmConnectionError,
    FarmHTTPError,
    FarmNotFound,
    FarmOverQuota,
    FarmUnauthorized,
    FarmUnavailable,
)

__all__ = ["FarmBadRequest", "FarmClient", "FarmConflict", "FarmConnectionError",
           "FarmHTTPError", "FarmNotFound", "FarmOverQuota", "FarmUnauthorized",
           "FarmUnavailable"]
