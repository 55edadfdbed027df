"""The control routes' turn across API servers (rollout/api/state.py ControlLock): two locks on
one file exclude each other as two API-server processes' do (flock locks belong to each open
file, so two in one process behave like two processes); a waiter cancelled meanwhile (a
deadline) holds nothing; a holder that dies frees the turn. The servers' race end to end:
tests/rollout/test_scale_out.py."""
import asyncio
import subprocess
import sys

from rollout.api.state import ControlLock


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
