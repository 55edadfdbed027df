"""Errors the engine raises to its callers.

Bad input is a `ValueError` subclass (`InvalidRequestError`, `UnsupportedModelError`): the
request is refused and the engine keeps serving. `EngineDeadError` means the engine is gone.
"""


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) that the engine refuses."""


class EngineStateError(InvalidRequestError):
    """A call the engine cannot serve in its current state (asleep, no weights, not paused)."""


class UnsupportedModelError(ValueError):
    """A model folder the engine cannot load (unknown architecture, missing files)."""


class EngineDeadError(RuntimeError):
    """The engine core is gone; every pending and later call fails with this."""
