"""KeyedCalls (rollout/api/idempotency.py), the memory behind /weights/update's idempotency_key:
a retry gets the first answer without running again, also while the first still runs; a failed
call is forgotten; another body under a used key is a 422; the memory is bounded; a caller that
goes away does not cancel the call or lose its answer."""
import asyncio

import pytest

from rollout.api.errors import APIError
from rollout.api.idempotency import KeyedCalls


class Counter:
    def __init__(self, delay: float = 0.0, fail: bool = False):
        self.n, self.delay, self.fail = 0, delay, fail

    async def __call__(self) -> dict:
        self.n += 1
        await asyncio.sleep(self.delay)
        if self.fail:
            raise APIError(500, "the transport broke")
        return {"weight_version": self.n}


def test_a_retry_gets_the_first_answer_without_running_again():
    async def main():
        calls, work = KeyedCalls(), Counter()
        first = await calls.run("k", "body", work)
        again = await calls.run("k", "body", work)
        assert first == ({"weight_version": 1}, False) and again == ({"weight_version": 1}, True) and work.n == 1
        assert await calls.run(None, "body", work) == ({"weight_version": 2}, False)  # no key: runs every time
        assert calls.status("k") == ("done", {"weight_version": 1}) and calls.status("other") is None
        with pytest.raises(APIError) as e:  # the key of another update
            await calls.run("k", "another body", work)
        assert e.value.status == 422 and e.value.param == "idempotency_key"

    asyncio.run(main())


def test_retries_while_the_first_runs_wait_for_its_answer():
    async def main():
        calls, work = KeyedCalls(), Counter(delay=0.2)
        answers = await asyncio.gather(*(calls.run("k", "body", work) for _ in range(3)))
        assert work.n == 1 and [a for a, _ in answers] == [{"weight_version": 1}] * 3
        assert sorted(replayed for _, replayed in answers) == [False, True, True]

    asyncio.run(main())


def test_a_failed_call_is_forgotten_and_its_waiters_get_its_error():
    async def main():
        calls, broken = KeyedCalls(), Counter(delay=0.1, fail=True)
        results = await asyncio.gather(calls.run("k", "body", broken), calls.run("k", "body", broken),
                                       return_exceptions=True)
        assert broken.n == 1 and all(isinstance(r, APIError) and r.status == 500 for r in results)
        assert calls.status("k") is None
        assert await calls.run("k", "another body", Counter()) == ({"weight_version": 1}, False)

    asyncio.run(main())


def test_the_memory_is_bounded_oldest_first():
    async def main():
        calls, work = KeyedCalls(capacity=3), Counter()
        for key in "abcd":
            await calls.run(key, "body", work)
        assert calls.status("a") is None and [calls.status(k)[0] for k in "bcd"] == ["done"] * 3

    asyncio.run(main())


def test_a_caller_that_goes_away_neither_cancels_the_call_nor_loses_its_answer():
    async def main():
        calls, work = KeyedCalls(), Counter(delay=0.3)
        caller = asyncio.ensure_future(calls.run("k", "body", work))
        await asyncio.sleep(0.05)
        caller.cancel()  # the HTTP connection dropped
        # until the call ends (a fixed 0.5 s: after a stalled loop both timers fire in one turn, the end second)
        for _ in range(500):
            if calls.status("k") != ("running", None):
                break
            await asyncio.sleep(0.01)
        assert calls.status("k") == ("done", {"weight_version": 1})
        assert await calls.run("k", "body", work) == ({"weight_version": 1}, True) and work.n == 1

    asyncio.run(main())
