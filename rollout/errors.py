"""What the trainer client raises, in a leaf module that both rollout/client.py and
rollout/client_weights.py import (re-exported as `rollout.RolloutAPIError` / `rollout.client`).

    RolloutAPIError        the server answered with an error: its status, message, type and the
                           request field at fault (`param`)
    RolloutConnectionError no server answered at the URL (a ConnectionError: nothing was sent,
                           so there is no status; the httpx error is its __cause__)
"""


class RolloutAPIError(RuntimeError):
    """`details`: the error object's other fields; a failed /weights/update's are `phase` (where it
    stopped) and `weight_version` (the version live after it), also as attributes."""

    def __init__(self, status: int, message: str, type: str = "error", param: str | None = None,
                 details: dict | None = None):
        super().__init__(f"{status} {type}: {message}" + (f" (param: {param})" if param else ""))
        self.status, self.message, self.type, self.param = status, message, type, param
        self.details = details or {}
        self.phase: str | None = self.details.get("phase")
        self.weight_version: int | None = self.details.get("weight_version")


class RolloutConnectionError(ConnectionError):
    """No rollout server listens at `url` (or it could not be reached in time)."""

    def __init__(self, url: str, method: str, path: str):
        super().__init__(f"{method} {path}: cannot connect to a rollout server at {url}. Is it running? Start "
                         f"one with `rollout serve` (or `make serve`), or pass the URL it printed when ready.")
        self.url = url
