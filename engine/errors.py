"""Errors the engine raises to its callers.

Bad input is a `ValueError` subclass (`InvalidRequestError`, `UnsupportedModelError`): the
request is refused and the engine keeps serving. `EngineDeadError` means the engine is gone.
Errors raised in the engine-core process travel as (type name, message) and are raised again
with their type by the client (`remote_error`), so callers catch the same classes as in-process.
"""


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) that the engine refuses. `param` names the
    field at fault when one does (an HTTP server reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineStateError(InvalidRequestError):
    """A call the engine cannot serve in its current state (asleep, no weights, not paused)."""


class UnsupportedModelError(ValueError):
    """A model folder the engine cannot load (unknown architecture, missing files)."""


class EngineDeadError(RuntimeError):
    """The engine core is gone; every pending and later call fails with this."""


class EngineStartError(RuntimeError):
    """Engine cores failed to start (one exited, or reported why); none of them is left running.
    A scale-up that raises it leaves the replicas that were serving as they were."""


# types a caller may catch, re-raised as themselves when they cross the process boundary
_REMOTE_TYPES = {c.__name__: c for c in (InvalidRequestError, EngineStateError, UnsupportedModelError, EngineDeadError,
                                         EngineStartError, ValueError, TypeError, KeyError, FileNotFoundError, NotADirectoryError,
                                         IsADirectoryError, TimeoutError, NotImplementedError)}


def remote_error(type_name: str | None, message: str, default: type = RuntimeError,
                 param: str | None = None) -> Exception:
    """The exception for a failure the engine core reported as (type name, message, field)."""
    if type_name in ("WeightTransferError", "WeightPushRefused", "WeightGroupError", "WeightDeadlineError"):
        from weight_sync import group

        return getattr(group, type_name)(message)
    cls = _REMOTE_TYPES.get(type_name or "")
    if cls is not None and issubclass(cls, InvalidRequestError):
        return cls(message, param)
    if cls is not None:
        return cls(message)
    return default(f"{type_name}: {message}" if type_name else message)
