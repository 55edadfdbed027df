"""KeyedCalls (rollout/api/idempotency.py), the memory behind /weights/update's idempotency_key:
a retry gets the first answer without running again, also while the first still runs; a failed
call is forgotten; another body under a used key is a 422; the memory is bounded; a caller that
goes away does not cancel the call or lose its answer. Across API servers (two KeyedCalls on one
SharedState file, as two servers of a launcher have): a retry reaching the other server gets the
answer, waits for the running call, gets its error, and runs the call again when its server
died."""
import asyncio
import subprocess
import sys

import pytest

from rollout.api.errors import APIError
from rollout.api.idempotency import KeyedCalls
from rollout.api.state import SharedState


def in_memory(**kw) -> KeyedCalls:  # (one API server)
    return KeyedCalls(SharedState(), **kw)


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
        calls, work = in_memory(), Counter()
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
        calls, work = in_memory(), Counter(delay=0.2)
        answers = await asyncio.gather(*(calls.run("k", "body", work) for _ in range(3)))
        assert work.n == 1 and [a for a, _ in answers] == [{"weight_version": 1}] * 3
        assert sorted(replayed for _, replayed in answers) == [False, True, True]

    asyncio.run(main())


def test_a_failed_call_is_forgotten_and_its_waiters_get_its_error():
    async def main():
        calls, broken = in_memory(), Counter(delay=0.1, fail=True)
        results = await asyncio.gather(calls.run("k", "body", broken), calls.run("k", "body", broken),
                                       return_exceptions=True)
        assert broken.n == 1 and all(isinstance(r, APIError) and r.status == 500 for r in results)
        assert calls.status("k") is None
        assert await calls.run("k", "another body", Counter()) == ({"weight_version": 1}, False)

    asyncio.run(main())


def test_the_memory_is_bounded_oldest_first():
    async def main():
        calls, work = in_memory(capacity=3), Counter()
        for key in "abcd":
            await calls.run(key, "body", work)
        assert calls.status("a") is None and [calls.status(k)[0] for k in "bcd"] == ["done"] * 3

    asyncio.run(main())


def test_a_caller_that_goes_away_neither_cancels_the_call_nor_loses_its_answer():
    async def main():
        calls, work = in_memory(), Counter(delay=0.3)
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


def two_servers(tmp_path) -> tuple[KeyedCalls, KeyedCalls]:
    lock = str(tmp_path / "control.lock")
    return KeyedCalls(SharedState(lock)), KeyedCalls(SharedState(lock))


def test_a_retry_through_another_api_server_gets_the_answer_or_waits_for_it(tmp_path):
    async def main():
        a, b = two_servers(tmp_path)
        work = Counter(delay=0.3)
        first = asyncio.ensure_future(a.run("k", "body", work))
        await asyncio.sleep(0.05)
        assert b.status("k") == ("running", None)
        assert await b.run("k", "body", work) == ({"weight_version": 1}, True)  # waited for a's call
        assert await first == ({"weight_version": 1}, False) and work.n == 1
        assert await b.run("k", "body", work) == ({"weight_version": 1}, True) and b.status("k")[0] == "done"
        with pytest.raises(APIError) as e:
            await b.run("k", "another body", work)
        assert e.value.status == 422

        broken = Counter(delay=0.2, fail=True)
        results = await asyncio.gather(a.run("f", "body", broken), b.run("f", "body", broken), return_exceptions=True)
        assert broken.n == 1 and all(isinstance(r, APIError) and r.message == "the transport broke" for r in results)
        assert a.status("f") is None and b.status("f") is None
        assert await b.run("f", "body", work) == ({"weight_version": 2}, False)  # forgotten: runs again

    asyncio.run(main())


def test_a_key_whose_server_died_mid_call_runs_again(tmp_path):
    """A server that claimed the key and died (its pid gone) left no answer: the retry runs it."""
    lock = str(tmp_path / "control.lock")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    SharedState(lock).update(lambda doc: doc.setdefault("keys", {}).update(
        k={"fingerprint": "body", "answer": None, "owner": {"pid": dead.pid, "token": "gone"}}))

    async def main():
        calls, work = KeyedCalls(SharedState(lock)), Counter()
        assert calls.status("k") is None
        assert await calls.run("k", "body", work) == ({"weight_version": 1}, False) and work.n == 1

    asyncio.run(main())
