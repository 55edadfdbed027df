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
answer for the retry.

The keys live in the API servers' SharedState (rollout/api/state.py), under "keys": a retry's new
connection may reach another API server (--api-server-count > 1), which then answers from the
first call's answer, or waits for the call running in the other server by polling the document.
A failed call leaves its error there for such waiters (a new call with the key runs again); a
call whose server died (its pid gone) is run again by whoever asks next.
"""
import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable

from rollout.api.errors import APIError

DEFAULT_CAPACITY = 64
POLL_S = 0.02  # a retry waiting for a call another API server runs reads the document this often


class KeyedCalls:
    def __init__(self, shared, capacity: int = DEFAULT_CAPACITY):
        self.shared, self.capacity = shared, capacity
        self._owner = {"pid": os.getpid(), "token": uuid.uuid4().hex}  # this KeyedCalls, among the servers'
        self._running: dict[str, asyncio.Task] = {}  # the calls this one runs

    def status(self, key: str) -> tuple[str, dict | None] | None:
        """("done", answer), ("running", None), or None for a key no API server knows (never
        seen, failed, or forgotten)."""
        entry = self.shared.read().get("keys", {}).get(key)
        if entry is None or "error" in entry or (entry["answer"] is None and not _alive(entry["owner"])):
            return None
        return ("done", entry["answer"]) if entry["answer"] is not None else ("running", None)

    async def run(self, key: str | None, fingerprint: str, call: Callable[[], Awaitable[dict]]) -> tuple[dict, bool]:
        """The call's answer and whether it is a replay of an earlier call's (raises its error)."""
        if key is None:
            return await asyncio.shield(asyncio.ensure_future(call())), False
        while True:
            how, answer = self.shared.update(lambda doc: self._claim(doc, key, fingerprint))
            if how == "done":
                return answer, True
            if how == "here":  # running in this server: wait for it (its error is ours too)
                return await asyncio.shield(self._running[key]), True
            if how == "run":
                break
            answer = await self._other_server(key)  # ("there")
            if answer is not None:
                return answer, True
        task = self._running[key] = asyncio.ensure_future(call())
        task.add_done_callback(lambda t: self._ended(key, fingerprint, t))
        return await asyncio.shield(task), False

    def _claim(self, doc: dict, key: str, fingerprint: str) -> tuple[str, dict | None]:
        """What a call with `key` does: "done" (its answer), "here" / "there" (it runs in this
        or another API server: wait for it), or "run" (it is this call's to run, claimed now)."""
        keys = doc.setdefault("keys", {})
        entry = keys.get(key)
        if entry is not None and "error" not in entry and (entry["answer"] is not None or _alive(entry["owner"])):
            if entry["fingerprint"] != fingerprint:
                raise APIError(422, f"idempotency_key {key!r} was used for a different update (another body): use a "
                                    "new key for a new update", "idempotency_key", type="invalid_request_error")
            if entry["answer"] is not None:
                keys[key] = keys.pop(key)  # (the most recently used is forgotten last)
                return "done", entry["answer"]
            return ("here" if entry["owner"] == self._owner else "there"), None
        keys[key] = {"fingerprint": fingerprint, "answer": None, "owner": self._owner}
        return "run", None

    async def _other_server(self, key: str) -> dict | None:
        """Wait for the call with `key` that another API server runs: its answer, its error
        (raised), or None when that server died without an answer (this one may run it)."""
        while True:
            entry = self.shared.read().get("keys", {}).get(key)
            if entry is not None and "error" in entry:
                e = entry["error"]
                raise APIError(e["status"], e["message"], e["param"], e["type"], e["extra"])
            if entry is None or (entry["answer"] is None and not _alive(entry["owner"])):
                return None
            if entry["answer"] is not None:
                return entry["answer"]
            await asyncio.sleep(POLL_S)

    def _ended(self, key: str, fingerprint: str, task: asyncio.Task) -> None:
        self._running.pop(key, None)
        error = None if task.cancelled() else task.exception()
        if task.cancelled() or error is not None:
            e = error if isinstance(error, APIError) else APIError(500, f"the call failed: {error or 'cancelled'}")
            failed = {"status": e.status, "message": e.message, "param": e.param, "type": e.type, "extra": e.extra}
            self.shared.update(lambda doc: self._record(doc, key, {"fingerprint": fingerprint, "error": failed}))
            return
        self.shared.update(lambda doc: self._record(doc, key, {"fingerprint": fingerprint, "answer": task.result(),
                                                              "owner": self._owner}))

    def _record(self, doc: dict, key: str, entry: dict) -> None:
        keys = doc.setdefault("keys", {})
        keys.pop(key, None)
        keys[key] = entry
        answered = [k for k, e in keys.items() if e.get("answer") is not None]
        for k in answered[:max(0, len(answered) - self.capacity)]:
            del keys[k]
        for k in [k for k, e in keys.items() if "error" in e][:-self.capacity]:  # (only waiters read them)
            del keys[k]


def _alive(owner: dict) -> bool:
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
