"""The one exception eplb raises: a ValueError that names the argument and the limit it broke."""
from __future__ import annotations


class EplbError(ValueError):
    """Bad input or an impossible request (e.g. more replicas of an expert than dies, too few surviving slots)."""
