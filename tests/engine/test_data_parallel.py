"""Data parallelism: several engine-core processes (replicas) behind one frontend, as local
processes ("mp") and as Ray actors on a local Ray cluster ("ray"; slow: starting Ray is).

Fast (tiny random model, real processes): requests spread over the replicas and stay on theirs;
control verbs reach every replica and their answers combine; a weight update is atomic across
replicas (a refused one leaves every replica on the old weights, a good one bumps the version
once); pause "keep" freezes and continues requests on every replica; kill -9 of one replica
fails its callers within 5 s while the other keeps serving, and nothing is left running.
Slow (the real model): DP=2 greedy fp32 equals DP=1 token for token on 32 prompts with both
replicas busy; a gloo push from a trainer process reaches both replicas.
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, AsyncLLM, EngineDeadError, SamplingParams
from engine.default_model import default_model_path
from weight_sync import WeightTransferError, find_free_port

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BACKENDS = ["mp", pytest.param("ray", marks=pytest.mark.slow)]


def tiny_llm(tiny_folder, cls=LLM, backend="mp", **kw):
    return cls(tiny_folder, dtype="float32", data_parallel_size=2, kv_cache_memory=16 << 20,
               tokenizer=str(default_model_path()), data_parallel_backend=backend, **kw)


def prompts(n: int, length: int = 6) -> list[list[int]]:
    return [[100 + i] * length for i in range(n)]


def replica_stats(llm) -> list[dict]:
    stats = llm.get_stats()
    assert len(stats["replicas"]) == 2
    return stats["replicas"]


def test_requests_spread_and_control_reaches_every_replica(tiny_folder):
    llm = tiny_llm(tiny_folder)
    try:
        outs = llm.generate(prompts(8), GREEDY, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        generated = [s["num_generated_tokens"] for s in replica_stats(llm)]
        assert generated == [32, 32], generated  # 4 prompts each
        assert sorted(llm.collective_rpc("get_rank")) == [0, 0]  # one worker in each replica
        # n > 1: the samples of one prompt stay together (they share its KV blocks)
        llm.generate([[7] * 6], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4), use_tqdm=False)
        generated2 = [s["num_generated_tokens"] for s in replica_stats(llm)]
        assert sorted(b - a for a, b in zip(generated, generated2)) == [0, 16]
        # control verbs reach both and combine
        assert llm.pause_generation("keep") == {"aborted": 0, "kept": 0, "mode": "keep"}
        assert llm.is_paused() and all(s["is_paused"] for s in replica_stats(llm))
        llm.resume_generation()
        assert not llm.is_paused()
        llm.sleep(1)
        assert llm.is_sleeping() and all(s["is_sleeping"] for s in replica_stats(llm))
        assert llm.wake_up()["is_sleeping"] is False
        assert llm.check_health() == {"replicas": [0, 1], "alive": [0, 1], "stalled": []}
        again = llm.generate(prompts(8), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_update_is_atomic_across_replicas(tiny_folder, backend):
    llm = tiny_llm(tiny_folder, backend=backend)
    try:
        before = llm.weights_checksum()  # the replicas agree, or this raises
        assert len(llm.collective_rpc("model_info")) == 2  # both replicas answer
        good = [("model.norm.weight", torch.full((64,), 1.5))]
        bad = good + [("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))]
        with pytest.raises(ValueError, match="shape"):
            llm.update_weights_from_tensors(bad)
        assert llm.weights_checksum() == before and llm.get_weight_version() == 0
        assert llm.update_weights_from_tensors(good)["weight_version"] == 1
        after = llm.weights_checksum()
        assert after != before
        assert [s["weight_version"] for s in replica_stats(llm)] == [1, 1]  # one bump, everywhere
        outs = llm.generate(prompts(4), GREEDY, use_tqdm=False)
        assert all(o.outputs[0].weight_versions == [1] * 8 for o in outs)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_replica_lends_its_spare_and_a_push_into_them_is_atomic(tiny_folder, backend):
    """A trainer on this machine writes the update into each replica's leased spare (packed for
    its kernels where they are built) and pushes every replica's handles in one update: both
    replicas then hold the trainer's weights under one version. A push that misses a replica's
    part (one that joined since the lease) is refused and leaves both replicas' weights whole."""
    from weight_sync import SpareWriter, load_safetensors_folder, weights_checksum

    llm = tiny_llm(tiny_folder, backend=backend)
    writers = {0: SpareWriter(), 1: SpareWriter()}
    state = dict(load_safetensors_folder(tiny_folder))
    new = {n: t * 0.5 for n, t in state.items()}

    def write_all() -> list[dict]:
        lease = llm.lease_weight_spare("trainer", writers[0].layouts)
        assert sorted(one["replica"] for one in lease["replicas"]) == [0, 1]
        return [dict(writers[one["replica"]].write(one, new.items()), replica=one["replica"])
                for one in lease["replicas"]]

    try:
        before = llm.weights_checksum()
        assert before == weights_checksum(state.items(), torch.float32)
        parts = write_all()
        with pytest.raises(ValueError, match="no part for replica 1"):
            llm.update_weights_from_ipc({"kind": "spare", "replicas": [p for p in parts if p["replica"] == 0]})
        assert llm.weights_checksum() == before and llm.get_weight_version() == 0
        result = llm.update_weights_from_ipc({"kind": "spare", "replicas": write_all()})  # (leased anew)
        assert result["weight_version"] == 1
        assert llm.weights_checksum() == weights_checksum(new.items(), torch.float32)  # (both agree, or it raises)
        assert [s["weight_version"] for s in replica_stats(llm)] == [1, 1]
    finally:
        for w in writers.values():
            w.close()
        llm.shutdown()


def test_a_push_goes_through_shared_memory_to_some_replicas_and_over_the_group_to_the_rest(tiny_folder):
    """A trainer on the machine of replica 0 only (replica 1 elsewhere): the group is formed from
    replica 1's worker alone, replica 0's spare is written, and one update takes both: replica 0
    reads its spare while replica 1 receives the broadcast. Refused, weights whole: handles for
    a replica that is in the group (the broadcast would wait on it), and a push that reaches
    replica 0 by neither way (it is in no group)."""
    import threading

    from weight_sync import SpareWriter, WeightSender, WeightTransferGroup, load_safetensors_folder, weights_checksum

    llm = tiny_llm(tiny_folder)
    writer = SpareWriter()
    state = dict(load_safetensors_folder(tiny_folder))
    new = {n: t * 0.5 for n, t in state.items()}
    port, ranks = find_free_port(), []
    joining = threading.Thread(target=lambda: ranks.extend(llm.init_weight_transfer("127.0.0.1", port, 2,
                                                                                    replicas=[1])))
    joining.start()
    group = WeightTransferGroup("127.0.0.1", port, 0, 2)
    joining.join()

    def spare_part() -> dict:
        lease = llm.lease_weight_spare("trainer", writer.layouts, replicas=[0])
        assert [one["replica"] for one in lease["replicas"]] == [0]  # (replica 1 lends nothing)
        return dict(writer.write(lease["replicas"][0], new.items()), replica=0)

    def push(shared: dict | None):
        answer = {}

        def update():
            try:
                answer["result"] = llm.update_weights(shared=shared)
            except Exception as e:  # noqa: BLE001 - the test looks at it
                answer["error"] = e

        receiving = threading.Thread(target=update)
        receiving.start()
        sent = WeightSender(group).send(new.items())
        receiving.join(timeout=60)
        assert sent["num_tensors"] == len(new)
        return answer

    try:
        assert ranks == [1]
        before = llm.weights_checksum()
        part = spare_part()
        with pytest.raises(ValueError, match="replica 1 is in the weight transfer group"):
            llm.update_weights(shared={"replicas": [part, dict(part, replica=1)]})  # (refused before receiving)
        assert llm.weights_checksum() == before and llm.get_weight_version() == 0
        missed = push(None)  # replica 1 receives it all; replica 0 has no group and no handles
        assert "no weight transfer group" in str(missed["error"])
        assert llm.weights_checksum() == before and llm.get_weight_version() == 0
        result = push({"replicas": [spare_part()]})["result"]
        assert result["weight_version"] == 1
        assert llm.weights_checksum() == weights_checksum(new.items(), torch.float32)  # (both agree, or it raises)
        assert [s["weight_version"] for s in replica_stats(llm)] == [1, 1]
        outs = llm.generate(prompts(4), GREEDY, use_tqdm=False)
        assert all(o.outputs[0].weight_versions == [1] * 8 for o in outs)
    finally:
        writer.close()
        group.close()
        llm.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pause_keep_continues_every_replica_with_the_new_version(tiny_folder, backend):
    async def main(llm):
        seen = {}

        async def collect(i):
            p = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            async for out in llm.generate([100 + i] * 6, p, request_id=f"k{i}"):
                seen[i] = out
            return seen[i]

        tasks = [asyncio.ensure_future(collect(i)) for i in range(6)]
        await _until(lambda: len(seen) == 6 and all(len(o.outputs[0].token_ids) >= 2 for o in seen.values()))
        await llm.pause_generation(mode="keep")
        await asyncio.sleep(0.3)  # outputs produced before the freeze arrive
        frozen = {i: len(o.outputs[0].token_ids) for i, o in seen.items()}
        await llm.update_weights_from_tensors([("model.norm.weight", torch.full((64,), 1.5))], version=5)
        await llm.resume_generation()
        outs = await asyncio.gather(*tasks)
        for i, o in enumerate(outs):
            v, k = o.outputs[0].weight_versions, frozen[i]
            assert len(v) == 60 and v == [0] * k + [5] * (60 - k), (i, k, v)
        stats = (await llm.get_stats())["replicas"]
        assert all(s["num_generated_tokens"] > 0 for s in stats)  # both replicas had kept requests

    llm = tiny_llm(tiny_folder, AsyncLLM, backend)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replica_killed_fails_its_callers_and_the_other_serves_on(tiny_folder, backend):
    async def main(llm):
        pids = llm.client.manager.pids()
        p = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        results: dict = {}

        async def collect(i):
            try:
                async for out in llm.generate([100 + i] * 6, p, request_id=f"r{i}"):
                    results[i] = out
            except EngineDeadError as e:
                results[i] = e

        tasks = [asyncio.ensure_future(collect(i)) for i in range(4)]
        await _until(lambda: len(results) == 4)
        victims = [i for i in range(4) if llm.client.owner[f"r{i}"].index == 0]
        assert len(victims) == 2
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        await _until(lambda: all(isinstance(results[i], EngineDeadError) for i in victims), timeout=5)
        assert time.monotonic() - t0 < 5
        assert not any(isinstance(results[i], Exception) for i in range(4) if i not in victims)
        assert (await llm.check_health()) == {"replicas": [0, 1], "alive": [1], "stalled": []}
        out = None
        async for out in llm.generate([5] * 6, GREEDY):  # new requests go to the survivor
            pass
        assert out.outputs[0].finish_reason == "length"
        await llm.abort([f"r{i}" for i in range(4)])
        await asyncio.gather(*tasks)
        # the survivor's two long requests ran on: to the context's end, or until the abort
        assert all(results[i].outputs[0].finish_reason in ("length", "abort") for i in range(4) if i not in victims)
        return pids

    llm = tiny_llm(tiny_folder, AsyncLLM, backend)
    try:
        pids = asyncio.run(main(llm))
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10  # (Ray's kill does not wait for the process to end)
    while [pid for pid in pids.values() if Path(f"/proc/{pid}").exists()]:
        assert time.monotonic() < deadline, "an engine core survived"
        time.sleep(0.1)


async def _until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


# ---- the real model ---------------------------------------------------------------------------------
GREEDY_64 = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def chats_32_and_one_replicas_tokens():
    """32 chat prompts and one replica's greedy tokens for them (the reference of both backends)."""
    from transformers import AutoTokenizer

    from tests.engine.hf_reference import CHATS, chat_token_ids

    ids = chat_token_ids(AutoTokenizer.from_pretrained(default_model_path()), CHATS[:32])
    llm = LLM(dtype="float32", kv_cache_memory=256 << 20)
    try:
        return ids, [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY_64, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_dp2_greedy_equals_dp1_on_32_prompts(backend, chats_32_and_one_replicas_tokens):
    ids, one_replica = chats_32_and_one_replicas_tokens
    llm = LLM(dtype="float32", data_parallel_size=2, kv_cache_memory=256 << 20, data_parallel_backend=backend)
    try:
        two_replicas = [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY_64, use_tqdm=False)]
        per_replica = [s["num_generated_tokens"] for s in llm.get_stats()["replicas"]]
    finally:
        llm.shutdown()
    assert two_replicas == one_replica
    assert min(per_replica) > 0 and max(per_replica) <= 2 * min(per_replica), per_replica


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_a_gloo_push_reaches_both_replicas(backend):
    llm = LLM(dtype="float32", data_parallel_size=2, kv_cache_memory=128 << 20, data_parallel_backend=backend)
    try:
        base = llm.weights_checksum()
        for mode, ok in (("wrong_shape", False), ("full", True)):
            port = find_free_port()
            trainer = subprocess.Popen([sys.executable, "-m", "tests.engine.trainer_proc", str(port), mode, "3"],
                                       stdout=subprocess.PIPE, text=True)
            # (a hang guard: the trainer loads and perturbs the whole model first; a busy host took 20 s)
            assert llm.init_weight_transfer("127.0.0.1", port, 3, timeout_s=60) == [1, 2]
            try:
                if ok:
                    assert llm.update_weights()["weight_version"] == 1
                else:
                    with pytest.raises(WeightTransferError, match="shape"):
                        llm.update_weights()
            finally:
                llm.close_weight_transfer()
            result = json.loads(trainer.communicate(timeout=120)[0].strip().splitlines()[-1])
            if ok:  # every replica holds the trainer's weights (weights_checksum checks they agree)
                assert result["ok"] and llm.weights_checksum() == result["checksum"]
                assert [s["weight_version"] for s in llm.get_stats()["replicas"]] == [1, 1]
            else:
                assert not result["ok"] and llm.weights_checksum() == base
    finally:
        llm.shutdown()


def test_scale_up_copies_live_weights_and_scale_down_drains(tiny_folder):
    """1 -> 2 -> 1 replicas while requests stream: the new replica holds the pushed weights (same
    checksum) and takes requests; the removed one finishes its requests first; nothing is lost."""
    async def main(llm):
        await llm.update_weights_from_tensors([("model.norm.weight", torch.full((64,), 1.5))], version=3)
        pushed = await llm.weights_checksum()
        outs: dict = {}

        async def collect(i, n):
            p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            async for out in llm.generate([100 + i] * 6, p, request_id=f"s{i}"):
                outs[i] = out

        first = [asyncio.ensure_future(collect(i, 40)) for i in range(4)]
        await _until(lambda: len(outs) == 4)
        assert await llm.scale(2) == {"data_parallel_size": 2, "added": [1], "removed": []}
        assert await llm.weights_checksum() == pushed  # the replicas agree (or this raises)
        assert [s["weight_version"] for s in (await llm.get_stats())["replicas"]] == [3, 3]
        leases = (await llm.lease_weight_spare("trainer"))["replicas"]  # the new replica lends its spare too
        assert sorted(one["replica"] for one in leases) == [0, 1] and all(one["segments"] for one in leases)
        second = [asyncio.ensure_future(collect(i, 40)) for i in range(4, 8)]
        await _until(lambda: len(outs) == 8)
        placed = {i: llm.client.owner[f"s{i}"].index for i in range(4, 8) if f"s{i}" in llm.client.owner}
        assert 1 in placed.values(), placed  # the new replica takes requests
        assert await llm.scale(1, drain_timeout_s=120) == {"data_parallel_size": 1, "added": [], "removed": [1]}
        assert (await llm.lease_weight_spare("trainer"))["segments"]  # one again
        await asyncio.gather(*first, *second)
        assert all(o.finished and o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 40
                   for o in outs.values())
        assert all(o.outputs[0].weight_versions == [3] * 40 for o in outs.values())
        return llm.client.manager.pids()

    llm = AsyncLLM(tiny_folder, dtype="float32", kv_cache_memory=16 << 20, tokenizer=str(default_model_path()))
    try:
        pids = asyncio.run(main(llm))
    finally:
        llm.shutdown()
    assert list(pids) == [0]  # the removed replica is gone from the manager too


def test_scale_up_copies_lora_adapters(tmp_path):
    """A replica that joins by scaling gets the live replica's LoRA adapters: loaded ones from
    their folders, a pushed one with its pushed tensors and version; both replicas then serve
    both adapters token-exact against PEFT."""
    from engine.worker.lora import LoRARequest
    from tests.engine.test_lora import PROMPTS, build_models, lora_tensors, perturbed, reference

    folder, _, adapters = build_models(tmp_path)
    trained = perturbed(adapters[0][1], 1)
    a0, a1 = LoRARequest("a0", 1, adapters[0][0]), LoRARequest("a1", 2, adapters[1][0])
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def one(llm, rid, lora):
        out = None
        async for out in llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy, request_id=rid, lora_request=lora):
            pass
        return out.outputs[0]

    async def main(llm):
        await llm.add_lora(a0)
        await llm.add_lora(a1)
        await llm.update_weights_from_tensors(lora_tensors(trained), version=4, lora_id=1)
        assert (await llm.scale(2))["added"] == [1]
        assert await llm.collective_rpc("list_loras") == [[1, 2], [1, 2]]
        outs = await asyncio.gather(*[one(llm, f"l{i}", a0 if i % 2 == 0 else a1) for i in range(8)])
        assert all(s["num_generated_tokens"] > 0 for s in (await llm.get_stats())["replicas"])  # both served
        for i, c in enumerate(outs):
            model, version = (trained, 4) if i % 2 == 0 else (adapters[1][1], 0)
            assert c.token_ids == reference(model, PROMPTS[1]) and c.lora_versions == [version] * 12, i

    llm = AsyncLLM(folder, dtype="float32", kv_cache_memory=16 << 20, tokenizer=str(default_model_path()),
                   enable_lora=True)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()
