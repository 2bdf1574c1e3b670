"""Trainer-side SDK."""

from prorl_farm.client.farm import FarmClient, FarmHTTPError

__all__ = ["FarmClient", "FarmHTTPError"]
