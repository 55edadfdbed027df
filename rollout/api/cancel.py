"""Cancellation helpers shared by the routes (a leaf: it imports no route module): run engine work
so that a client that goes away, or a sibling that fails, cancels it, and with it the engine
requests it started (their generators abort them when closed)."""
import asyncio

from fastapi import Request

from rollout.api.errors import APIError


async def gather_all(coros) -> list:
    """asyncio.gather, but the first failure cancels the others (their engine requests abort)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


async def until_disconnect(request: Request, coro):
    """Run `coro`; if the client goes away first, cancel it (the engine request is aborted)."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "the client disconnected")
    return task.result()
