"""Elastic data parallelism under the faults an outside prober found (real engine-core processes):

- a scale to a size the machine cannot hold (cores, memory, a configured maximum) is refused
  before any process starts, naming data_parallel_size; so is such a size at start-up;
- a scale-up whose new replica dies while starting stops every new process and leaves the old
  replicas serving; the failure says why;
- after a replica is replaced, after 2 -> 1 -> 2 and after 2 -> 3, the trainer's weight group
  forms again (ranks follow the live replicas, not their ever-growing indices) and a gloo push
  reaches every replica: the trainer's checksum and transformers' greedy tokens on the new
  weights (slow: the real model);
- a dead replica's pending calls leave no "Future exception was never retrieved" behind.
"""
import asyncio
import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import AsyncLLM, EngineDeadError, EngineStartError, InvalidRequestError, SamplingParams
from engine.default_model import default_model_path
from weight_sync import find_free_port

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine_cores_of(pid: int) -> set[int]:
    """Engine-core processes whose parent is `pid` (started from any of its threads)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and "run_engine_core" in (stat.parent / "cmdline").read_text():
                found.add(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    return found


def tiny(tiny_folder, **kw) -> AsyncLLM:
    return AsyncLLM(tiny_folder, dtype="float32", kv_cache_memory=16 << 20, tokenizer=str(default_model_path()), **kw)


async def generate(llm, prompt=(7,) * 6) -> list[int]:
    out = None
    async for out in llm.generate(list(prompt), GREEDY):
        pass
    return out.outputs[0].token_ids


def test_a_size_the_machine_cannot_hold_is_refused_before_any_process_starts(tiny_folder):
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(InvalidRequestError, match="data_parallel_size") as e:
        tiny(tiny_folder, data_parallel_size=cores + 1)
    assert e.value.param == "data_parallel_size" and not engine_cores_of(os.getpid())

    async def main(llm):
        before = engine_cores_of(os.getpid())
        expected = await generate(llm)
        for size, why in ((1000, "CPU core"), (cores + 1, "CPU core")):
            t0 = time.monotonic()
            with pytest.raises(InvalidRequestError, match=why) as e:
                await llm.scale(size)
            assert e.value.param == "data_parallel_size" and time.monotonic() - t0 < 1.0
            assert engine_cores_of(os.getpid()) == before
        assert await generate(llm) == expected

    llm = tiny(tiny_folder)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()

    async def configured(llm):
        with pytest.raises(InvalidRequestError, match="max_data_parallel_size"):
            await llm.scale(3)
        # past the core bound on purpose, but not past memory: 1000 replicas would need ~1000 x RSS
        llm.client.config.max_data_parallel_size = 1000
        with pytest.raises(InvalidRequestError, match="GiB available") as e:
            await llm.scale(1000)
        assert e.value.param == "data_parallel_size"
        assert len(engine_cores_of(os.getpid())) == 1

    llm = tiny(tiny_folder, max_data_parallel_size=2)
    try:
        asyncio.run(configured(llm))
    finally:
        llm.shutdown()


def test_a_scale_up_whose_new_replica_dies_starting_leaves_the_old_ones_serving(tiny_folder):
    async def main(llm):
        old = engine_cores_of(os.getpid())
        expected = await generate(llm)
        killed = []

        def kill_the_first_new_core():  # as soon as it exists: importing, loading or in the handshake
            deadline = time.monotonic() + 60
            while not killed and time.monotonic() < deadline:
                for pid in engine_cores_of(os.getpid()) - old:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    break
                time.sleep(0.01)

        killer = threading.Thread(target=kill_the_first_new_core)
        killer.start()
        with pytest.raises(EngineStartError, match="during start-up"):
            await llm.scale(3)
        killer.join()
        assert killed
        assert engine_cores_of(os.getpid()) == old  # the other new one is gone too
        assert llm.client.manager.pids() == {0: next(iter(old))}
        assert sorted(llm.client.engines) == [0]
        assert await generate(llm) == expected
        assert (await llm.scale(2))["added"] == [3]  # and a later scale-up works
        assert await generate(llm) == expected

    llm = tiny(tiny_folder, max_data_parallel_size=3)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()


def test_a_dead_replicas_calls_leave_no_unretrieved_future(tiny_folder):
    """A call that was on its way to a replica when its death was noticed fails with
    EngineDeadError and leaves nothing behind; when the last replica dies, the failures set on
    pending calls are all retrieved (asyncio logs each unretrieved one at ERROR)."""
    unretrieved = []

    async def main(llm):
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
        pids = llm.client.manager.pids()
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.client.engines[1].alive:
            assert time.monotonic() < deadline
            await asyncio.gather(llm.get_stats(), llm.is_paused(), return_exceptions=True)
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError):  # (routed there a moment before the death was noticed)
            await llm.client._call(llm.client.engines[1], "get_stats", [], {}, None)
        assert not llm.client._pending
        await generate(llm)  # the survivor serves on
        os.kill(pids[0], signal.SIGKILL)  # the last one: every call fails with EngineDeadError
        deadline = time.monotonic() + 10  # (calls keep coming while the death is noticed, however long that takes)
        for i in itertools.count():
            results = await asyncio.gather(llm.get_stats(), llm.is_paused(), return_exceptions=True)
            if i >= 19 and all(isinstance(r, EngineDeadError) for r in results):
                break
            assert time.monotonic() < deadline, results
            await asyncio.sleep(0.05)

    llm = tiny(tiny_folder, data_parallel_size=2)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()
    del llm  # a future nobody retrieved is reported when it is collected
    gc.collect()
    assert not [m for m in unretrieved if "never retrieved" in m], unretrieved


# ---- the weight group after scaling (the real model, a real trainer process) ------------------------
async def push(llm, world_size: int, seed: int, version: int) -> str:
    """A trainer process (rank 0) pushes weights perturbed with `seed`; returns its checksum."""
    port = find_free_port()
    trainer = subprocess.Popen([sys.executable, "-m", "tests.engine.trainer_proc", str(port), "full",
                                str(world_size), str(seed)], stdout=subprocess.PIPE, text=True)
    try:
        ranks = await llm.init_weight_transfer("127.0.0.1", port, world_size, timeout_s=30)
        assert ranks == list(range(1, world_size))
        assert (await llm.update_weights(version=version))["weight_version"] == version
        await llm.close_weight_transfer()
        result = json.loads(trainer.communicate(timeout=120)[0].strip().splitlines()[-1])
    finally:
        trainer.kill()
    assert result["ok"], result
    return result["checksum"]


async def on_every_replica(llm, prompt: list[int]) -> set[tuple[int, ...]]:
    """The greedy tokens of `prompt` from every live replica (one request each, placed by hand)."""
    outs = set()
    for engine in llm.client._live():
        others = [e for e in llm.client._live() if e is not engine]
        for e in others:
            e.routable = False
        try:
            outs.add(tuple(await generate(llm, prompt)))
        finally:
            for e in others:
                e.routable = True
    return outs


@pytest.mark.slow
def test_the_weight_group_forms_after_replace_shrink_grow_and_grow():
    from tests.engine.hf_reference import hf_greedy
    from tests.engine.perturb import hf_model_with, perturbed_state

    prompt = [1, 504, 3458, 282, 4649, 314]

    async def main(llm):
        versions = iter(range(1, 10))
        os.kill(llm.client.manager.pids()[1], signal.SIGKILL)  # kill + replace
        deadline = time.monotonic() + 10
        while llm.client.engines[1].alive:  # (calls run the output handler, which learns of the death)
            assert time.monotonic() < deadline
            await asyncio.gather(llm.get_stats(), return_exceptions=True)
            await asyncio.sleep(0.05)
        assert (await llm.scale(2))["added"] == [2]
        assert await push(llm, 3, 1, next(versions)) == await llm.weights_checksum()
        await llm.scale(1)  # 2 -> 1 -> 2
        await llm.scale(2)
        assert await push(llm, 3, 2, next(versions)) == await llm.weights_checksum()
        assert (await llm.scale(3))["added"] == [4]  # 2 -> 3
        checksum = await push(llm, 4, 3, next(versions))
        assert checksum == await llm.weights_checksum()  # every replica holds it (or this raises)
        assert [s["weight_version"] for s in (await llm.get_stats())["replicas"]] == [3, 3, 3]
        return await on_every_replica(llm, prompt)

    llm = AsyncLLM(dtype="float32", data_parallel_size=2, kv_cache_memory=64 << 20, max_data_parallel_size=3)
    try:
        outs = asyncio.run(main(llm))
    finally:
        llm.shutdown()
    path = str(default_model_path())
    tokens, _, gaps = hf_greedy(hf_model_with(path, perturbed_state(path, seed=3)), [prompt], 8)[0]
    assert outs == {tuple(tokens)}, (outs, tokens, gaps)
