"""Exceptions raised by Pallas-Flash."""

from __future__ import annotations


class InvalidInputError(ValueError):
    """An argument has the wrong rank, shape, dtype or value.

    The message names the argument, what it got, and what was expected.
    """


class UnsupportedFeatureError(NotImplementedError):
    """The selected backend does not implement a feature the call asks for."""


class BackendNotFoundError(LookupError):
    """No installed backend has the requested name."""
