"""Streaming helpers shared by /generate and the OpenAI routes: prime a set of engine streams
(so a bad prompt is a 4xx before any byte is sent), merge them in arrival order, and frame
events as SSE or NDJSON.
"""
import asyncio
import json
from typing import Any, AsyncGenerator, AsyncIterator

from rollout.api.cancel import until_disconnect
from rollout.api.errors import APIError, engine_error, error_body

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def ndjson(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def error_event(e: BaseException) -> dict:
    err = engine_error(e)
    return error_body(err.status, err.message, err.param, err.type)


async def prime(gens: list[AsyncGenerator], request) -> list:
    """The first item of every stream; on any failure, or if the client goes away first (a
    stream held by a pause sends nothing for a while), every stream is closed and the first
    error is raised."""
    try:
        results = await until_disconnect(request, asyncio.gather(*(g.__anext__() for g in gens),
                                                                 return_exceptions=True))
    except BaseException:
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        raise
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        if isinstance(failure, StopAsyncIteration):
            raise APIError(500, "an engine stream ended without output")
        raise failure
    return results


async def merge(gens: list[AsyncGenerator], firsts: list) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) in arrival order, starting with the primed first items. An exception
    in a stream is yielded as its item (and ends that stream). Closing the merge closes every
    stream (their engine requests are aborted)."""
    for i, item in enumerate(firsts):
        yield i, item
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield 0, item
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band, the headers are already out
            yield 0, e
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, g: AsyncGenerator) -> None:
        try:
            async for item in g:
                await queue.put((i, item))
        except Exception as e:  # noqa: BLE001
            await queue.put((i, e))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
