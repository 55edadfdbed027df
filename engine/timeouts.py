"""`wait_within`: asyncio.wait_for without its lost cancellation.

Before Python 3.12, a task cancelled while `asyncio.wait_for` waits is not cancelled at all when
the awaited call happens to finish in the same loop turn: wait_for hands back the call's result
(or raises its error) instead (cpython gh-86296). A loop that catches that error and goes on,
such as the server's stats poll when the engine is dead, then outlives its cancel and holds the
server's shutdown forever. `asyncio.wait` does not drop a cancel, so this waits with it.
"""
import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_within(aw: Awaitable[T], timeout: float | None) -> T:
    """`await aw`, or asyncio.TimeoutError (aw cancelled) after `timeout` seconds (None: no limit)."""
    if timeout is None:
        return await aw
    call = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({call}, timeout=timeout)
    except asyncio.CancelledError:
        _abandon(call)
        raise
    if not done:
        _abandon(call)
        raise asyncio.TimeoutError
    return call.result()


def _abandon(call: asyncio.Future) -> None:
    # Nobody reads what it ends with: mark its error seen, or asyncio logs it at ERROR.
    call.cancel()
    call.add_done_callback(lambda f: f.cancelled() or f.exception())
