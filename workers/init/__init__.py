"""The INIT pool."""
