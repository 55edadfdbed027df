"""The control routes' turn across API servers (rollout/api/state.py ControlLock): two locks on
one file exclude each other as two API-server processes' do (flock locks belong to each open
file, so two in one process behave like two processes); a waiter cancelled meanwhile (a
deadline) holds nothing; a holder that dies frees the turn. The state the routes share beside
it (SharedState): changes through two instances at once lose nothing, a reader never sees half a
document, a change that raises writes nothing. The servers' race end to end:
tests/rollout/test_scale_out.py."""
import asyncio
import json
import subprocess
import sys
import threading

import pytest

from rollout.api.state import ControlLock, SharedState


def test_two_locks_on_one_file_take_turns_and_a_cancelled_waiter_holds_nothing(tmp_path):
    path = str(tmp_path / "control.lock")

    async def main():
        a, b = ControlLock(path), ControlLock(path)
        order = []
        await a.acquire()
        waiter = asyncio.ensure_future(b.acquire())
        await asyncio.sleep(0.05)
        assert not waiter.done()  # b waits for a, though they share no asyncio lock
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert not b._local.locked()  # (the cancelled waiter let its own server's lock go too)

        async def use(lock, name):
            async with lock:
                order.append(f"{name} in")
                await asyncio.sleep(0.02)
                order.append(f"{name} out")

        second = asyncio.ensure_future(use(b, "b"))
        await asyncio.sleep(0.05)
        assert order == []
        a.release()
        await second
        assert order == ["b in", "b out"]
        async with a:  # free again
            pass

    asyncio.run(main())


def test_a_dead_holders_turn_is_freed(tmp_path):
    path = str(tmp_path / "control.lock")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import asyncio, sys, time; from rollout.api.state import ControlLock\n"
        f"lock = ControlLock({path!r}); asyncio.run(lock.acquire()); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"

        async def main():
            lock = ControlLock(path)
            waiter = asyncio.ensure_future(lock.acquire())
            await asyncio.sleep(0.1)
            assert not waiter.done()
            holder.kill()
            await asyncio.wait_for(waiter, 10)
            lock.release()

        asyncio.run(main())
    finally:
        holder.kill()
        holder.wait()


def test_shared_state_changes_at_once_lose_nothing(tmp_path):
    control_lock = str(tmp_path / "control.lock")
    servers = [SharedState(control_lock), SharedState(control_lock)]  # two API servers' views
    torn = []

    def bump(state):
        for _ in range(300):
            state.update(lambda doc: doc.update(n=doc.get("n", 0) + 1, pad="x" * 4096))

    def read():
        while not done.is_set():
            try:
                servers[1].read()
            except json.JSONDecodeError as e:  # (a rename replaces the document whole)
                torn.append(e)

    done = threading.Event()
    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=bump, args=(s,)) for s in servers]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert servers[0].read()["n"] == servers[1].read()["n"] == 600 and torn == []

    def refused(doc):
        doc["n"] = -1
        raise ValueError("refused")

    with pytest.raises(ValueError):
        servers[0].update(refused)
    assert servers[1].read()["n"] == 600
    assert SharedState().update(lambda doc: doc.setdefault("n", 1)) == 1  # one API server: in memory
