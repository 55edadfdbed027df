"""wait_within: asyncio.wait_for's result and timeout, and a cancel that arrives in the loop turn
the awaited call finishes is raised, never dropped (Python < 3.12's wait_for drops it:
cpython gh-86296). The server's stats poll is the loop that hung a shutdown that way."""
import asyncio
import gc

import pytest

from engine.errors import EngineDeadError
from engine.timeouts import wait_within


def run(coro):
    """asyncio.run, plus every error the loop logged (an exception nobody retrieved)."""
    logged = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: logged.append(ctx["message"]))
        try:
            return await coro
        finally:
            await asyncio.sleep(0)
            gc.collect()

    return asyncio.run(main()), logged


def test_result_and_timeout():
    async def value():
        await asyncio.sleep(0.01)
        return 7

    async def timing_out():
        never = asyncio.Event()
        task = asyncio.ensure_future(never.wait())
        with pytest.raises(asyncio.TimeoutError):
            await wait_within(task, 0.05)
        await asyncio.sleep(0)
        return task.cancelled()  # the call is cancelled, as wait_for does

    assert run(wait_within(value(), 1.0))[0] == 7
    assert run(wait_within(value(), None))[0] == 7
    assert run(timing_out()) == (True, [])


async def _cancelled_as_the_call_fails(waiting):
    """A task waits within a timeout on a call that cancels the task and then fails: what the
    server's shutdown does to the stats poll while the engine is dead."""
    task = None

    async def failing_call():
        task.cancel()
        raise EngineDeadError("gone")

    task = asyncio.ensure_future(waiting(failing_call))
    done, _ = await asyncio.wait({task}, timeout=2.0)
    return bool(done) and task.cancelled()


def test_a_cancel_landing_as_the_call_fails_is_raised():
    async def waiting(call):
        try:
            await wait_within(call(), 5.0)
        except EngineDeadError:
            await asyncio.sleep(10)  # what a caller that handles the error and goes on does next

    cancelled, logged = run(_cancelled_as_the_call_fails(waiting))
    assert cancelled and logged == []  # and the call's own error is not logged as never retrieved


def test_the_stats_poll_stops_when_cancelled_as_a_dead_engine_answers():
    from rollout.metrics import ServerMetrics

    metrics = ServerMetrics()

    class DeadEngine:
        errored = True

        def __init__(self, call):
            self.get_stats = call

    async def waiting(call):
        await metrics.poll(DeadEngine(call), interval_s=0.01)

    cancelled, _ = run(_cancelled_as_the_call_fails(waiting))
    assert cancelled  # asyncio.wait_for lets the poll run on forever, holding the server's shutdown
