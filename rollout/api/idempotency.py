"""Calls made with an idempotency key (POST /weights/update): a retry with the key gets the first
call's answer instead of running again.

    KeyedCalls.run(key, fingerprint, call) -> (answer, replayed)

- the answers of the last `capacity` keys whose call succeeded are kept (oldest forgotten first);
- a retry while the first call runs waits for it and gets its answer, or its error;
- a call that failed is forgotten once it ended: its key may be used again (nothing happened that
  a retry would repeat: a failed weight update changed nothing);
- the same key with another fingerprint (another body) is a 422 naming idempotency_key, as the
  IETF Idempotency-Key draft answers a key reused for a different payload.

Every call runs as a task of its own, with a key or without: a caller that goes away (its
connection dropped, which is when a trainer retries) neither cancels it halfway nor loses its
answer for the retry. Keys live in this
API server process: with --api-server-count > 1, a retry that lands on another API server is not
recognised.
"""
import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from rollout.api.errors import APIError

DEFAULT_CAPACITY = 64


class KeyedCalls:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._done: OrderedDict[str, tuple[str, dict]] = OrderedDict()  # key -> (fingerprint, answer)
        self._running: dict[str, tuple[str, asyncio.Task]] = {}

    def status(self, key: str) -> tuple[str, dict | None] | None:
        """("done", answer), ("running", None), or None for a key not known here."""
        if key in self._done:
            return "done", self._done[key][1]
        if key in self._running:
            return "running", None
        return None

    async def run(self, key: str | None, fingerprint: str, call: Callable[[], Awaitable[dict]]) -> tuple[dict, bool]:
        """The call's answer and whether it is a replay of an earlier call's (raises its error)."""
        if key is None:
            return await asyncio.shield(asyncio.ensure_future(call())), False
        if key in self._done:
            self._check(key, self._done[key][0], fingerprint)
            self._done.move_to_end(key)
            return self._done[key][1], True
        if key in self._running:
            first, task = self._running[key]
            self._check(key, first, fingerprint)
            return await asyncio.shield(task), True
        task = asyncio.ensure_future(call())
        self._running[key] = (fingerprint, task)
        task.add_done_callback(lambda t: self._ended(key, fingerprint, t))
        return await asyncio.shield(task), False

    def _ended(self, key: str, fingerprint: str, task: asyncio.Task) -> None:
        self._running.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            return
        self._done[key] = (fingerprint, task.result())
        while len(self._done) > self.capacity:
            self._done.popitem(last=False)

    @staticmethod
    def _check(key: str, first: str, fingerprint: str) -> None:
        if first != fingerprint:
            raise APIError(422, f"idempotency_key {key!r} was used for a different update (another body): use a new "
                                "key for a new update", "idempotency_key", type="invalid_request_error")
