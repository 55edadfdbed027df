"""Acceptance for the RL control plane: weight pushes from a real trainer process over gloo,
atomic updates that survive bad pushes, pause modes, sleep/wake memory, checksums."""
import asyncio
import json
import subprocess
import sys
import time

import pytest
import torch

from engine import LLM, EngineStateError, InvalidRequestError, SamplingParams
from engine.frontend.async_llm import AsyncLLM
from tests.engine.hf_reference import CHATS, chat_token_ids, hf_greedy
from tests.engine.perturb import hf_model_with, perturbed_state
from weight_sync import WeightTransferError, find_free_port, weights_checksum

EXT = "tests.engine.rl_worker_ext.MemoryProbe"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def start_trainer(port: int, mode: str, world_size: int = 2, seed: int = 0,
                  dtype: str | None = None) -> subprocess.Popen:
    """A trainer process (tests/engine/trainer_proc.py); `dtype`: every tensor sent cast to it."""
    return subprocess.Popen([sys.executable, "-m", "tests.engine.trainer_proc", str(port), mode, str(world_size),
                             str(seed), *([dtype] if dtype else [])], stdout=subprocess.PIPE, text=True)


def trainer_result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", worker_extension_cls=EXT, kv_cache_memory=256 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(default_model_path):
    from transformers import AutoTokenizer

    return chat_token_ids(AutoTokenizer.from_pretrained(default_model_path), CHATS[:3])


def push(llm, mode: str, version=None, world_size: int = 2, timeout_s: float = 20):
    """Trainer process + engine (world_size - 1 worker ranks) through one push; returns (engine
    result or exception, trainer)."""
    port = find_free_port()
    trainer = start_trainer(port, mode, world_size)
    llm.init_weight_transfer("127.0.0.1", port, world_size, timeout_s=timeout_s)
    try:
        result = llm.update_weights(version=version)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        result = e
    finally:
        llm.close_weight_transfer()
    return result, (trainer_result(trainer) if mode != "die" else trainer.wait(60))


@pytest.mark.slow
def test_push_bad_pushes_then_good_push(llm, prompts, default_model_path):
    """Bad pushes leave the old weights bit for bit; a good push matches HF on the new weights."""
    before = llm.generate(prompts, GREEDY, use_tqdm=False)
    base_sum = llm.weights_checksum()
    for mode, words in [("wrong_shape", "shape"), ("unknown_name", "unknown"), ("wrong_dtype", "dtype"),
                        ("die", "")]:
        result, trainer = push(llm, mode)
        assert isinstance(result, WeightTransferError), f"{mode}: the engine accepted a bad push ({result!r})"
        assert words in str(result).lower(), f"{mode}: unclear error {result}"
        assert llm.get_weight_version() == 0
        assert llm.weights_checksum() == base_sum, f"{mode} changed the weights"
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in before]

    result, trainer = push(llm, "full")
    assert trainer["ok"], trainer
    assert result["weight_version"] == 1 and llm.get_weight_version() == 1
    assert llm.weights_checksum() == trainer["checksum"]
    # prompts[0] was cached before the push; its first request after it must recompute it
    # (the later prompts may share blocks that prompts[0] computes in this very step)
    after = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert after[0].num_cached_tokens == 0, "KV computed by old weights was reused"
    assert all(o.outputs[0].weight_versions == [1] * 16 for o in after)
    reference = hf_greedy(hf_model_with(default_model_path, perturbed_state(default_model_path)), prompts, 16)
    assert [o.outputs[0].token_ids for o in after] == [r[0] for r in reference]
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]

    # a push of some parameters is legal and updates exactly those
    llm.reload_weights(version=2)
    assert llm.weights_checksum() == base_sum
    result, trainer = push(llm, "subset", version=7)
    assert trainer["ok"] and llm.get_weight_version() == 7
    state = perturbed_state(default_model_path)
    expected = dict(_base_state(default_model_path))
    for name in ("model.norm.weight", "model.layers.3.mlp.down_proj.weight"):
        expected[name] = state[name]
    assert llm.weights_checksum() == weights_checksum(expected.items())


def _base_state(path):
    from weight_sync import load_safetensors_folder

    return [(n, t.float()) for n, t in load_safetensors_folder(path)]


def test_checksum_matches_the_trainers(default_model_path):
    for dtype in (torch.float32, torch.bfloat16):
        llm = LLM(dtype=str(dtype).removeprefix("torch."), multiprocess=False, kv_cache_memory=64 << 20)
        assert llm.weights_checksum() == weights_checksum(_base_state(default_model_path), dtype=dtype)
        llm.shutdown()


def test_update_refused_while_running_and_asleep_states(default_model_path, tmp_path):
    from safetensors.torch import save_file

    state = perturbed_state(default_model_path)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    llm = LLM(dtype="float32", multiprocess=False, kv_cache_memory=64 << 20)
    core = llm.client.core
    core.add_request(__import__("engine.protocol", fromlist=["x"]).EngineCoreRequest(
        "r", [1, 2, 3], SamplingParams(max_tokens=50), None))
    core.step()
    with pytest.raises(EngineStateError, match="pause"):
        llm.update_weights_from_disk(str(tmp_path))
    llm.pause_generation(mode="keep")
    assert llm.update_weights_from_disk(str(tmp_path))["weight_version"] == 1
    llm.pause_generation(mode="abort")
    llm.resume_generation()
    llm.sleep(2)
    with pytest.raises(EngineStateError, match="asleep"):
        llm.generate("hi", GREEDY, use_tqdm=False)
    llm.wake_up()
    with pytest.raises(EngineStateError, match="no weights"):
        llm.generate("hi", GREEDY, use_tqdm=False)
    assert llm.update_weights_from_disk(str(tmp_path))["weight_version"] == 2
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].weight_versions == [2] * 16
    from weight_sync import SpareWriter

    layouts = SpareWriter().layouts
    if layouts:  # (the C++ kernels are built here) a trainer still gets the projections' panels to pack
        lease = llm.lease_weight_spare("trainer", layouts)
        assert any("pack" in e for e in lease.get("replicas", [lease])[0]["tensors"])
    llm.shutdown()


def test_errors_keep_their_type_across_the_process_boundary(llm, tmp_path):
    """Failures inside the engine-core process reach the caller as the same classes an
    in-process engine raises, and the engine keeps serving."""
    assert llm.client.__class__.__name__ == "SyncMPClient"
    with pytest.raises(FileNotFoundError, match="no .*safetensors"):
        llm.update_weights_from_disk(str(tmp_path))
    with pytest.raises(InvalidRequestError, match="sleep level"):
        llm.sleep(3)
    with pytest.raises(EngineStateError, match="no weight transfer group"):
        llm.update_weights()
    with pytest.raises(TypeError):
        llm.collective_rpc("weight_bytes", args=(1, 2, 3))
    for method in ("no_such_method", "step", "take_pending_outputs", "shutdown", "_check_prompt"):
        with pytest.raises(InvalidRequestError, match="no method"):  # only the utility table's verbs
            llm.client.call_utility(method)
    with pytest.raises(InvalidRequestError, match="level") as e:  # typed before the method runs
        llm.client.call_utility("sleep", level="deep")
    assert e.value.param == "level" and not llm.is_sleeping()
    assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _rss(llm) -> int:
    return llm.collective_rpc("rss_bytes")[0]


def test_sleep_releases_memory_and_outputs_survive(llm, prompts):
    llm.reload_weights()
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    kv_bytes = llm.collective_rpc("fill_kv_cache")[0]
    weight_bytes = llm.collective_rpc("weight_bytes")[0]
    awake = _rss(llm)
    llm.sleep(1)
    assert llm.is_sleeping()
    slept1 = _rss(llm)
    assert awake - slept1 >= 0.9 * kv_bytes, (awake, slept1, kv_bytes)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before
    llm.collective_rpc("fill_kv_cache")
    awake = _rss(llm)
    llm.sleep(2)
    slept2 = _rss(llm)
    assert awake - slept2 >= 0.9 * (kv_bytes + weight_bytes), (awake, slept2, kv_bytes, weight_bytes)
    llm.wake_up(["weights"])
    llm.wake_up(["kv_cache"])
    with pytest.raises(EngineStateError, match="no weights"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(EngineStateError, match="no weights"):
        llm.weights_checksum()
    llm.reload_weights()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before


@pytest.mark.slow
def test_200_sleep_wake_cycles_do_not_creep():
    llm = LLM(dtype="float32", worker_extension_cls=EXT, kv_cache_memory=64 << 20)
    try:
        samples = []
        for i in range(200):
            llm.sleep(1)
            llm.wake_up()
            llm.collective_rpc("fill_kv_cache")
            if i in (0, 199):
                llm.generate("Hello", GREEDY, use_tqdm=False)
                samples.append(_rss(llm))
        assert samples[1] <= samples[0] * 1.05, samples
    finally:
        llm.shutdown()


# ---- pause modes (AsyncLLM) -----------------------------------------------------------------------

def test_pause_modes():
    asyncio.run(_pause_modes())


async def _collect(llm, prompt, params, request_id, seen: dict):
    async for out in llm.generate(prompt, params, request_id=request_id):
        seen[request_id] = out
    return seen[request_id]


async def _until(cond, timeout=60.0):
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout, "timed out"
        await asyncio.sleep(0.01)


async def _pause_modes():
    llm = AsyncLLM(dtype="float32", kv_cache_memory=256 << 20)
    try:
        prompts = [f"Count slowly from {i} to one hundred:" for i in range(16)]
        # abort: partial outputs with finish_reason "abort"
        seen = {}
        p = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        tasks = [asyncio.ensure_future(_collect(llm, q, p, f"a{i}", seen)) for i, q in enumerate(prompts[:8])]
        await _until(lambda: len(seen) == 8 and all(len(o.outputs[0].token_ids) >= 3 for o in seen.values()))
        await llm.pause_generation(mode="abort")
        outs = await asyncio.gather(*tasks)
        assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
        assert all(3 <= len(o.outputs[0].token_ids) < 400 for o in outs)
        assert await llm.is_paused()
        # a request made while paused waits, then runs after resume
        late = asyncio.ensure_future(_collect(llm, "Hi", SamplingParams(temperature=0, max_tokens=4), "late", seen))
        await asyncio.sleep(0.5)
        assert "late" not in seen and not late.done()
        await llm.resume_generation()
        assert (await late).outputs[0].finish_reason == "length"

        # wait: 16 running requests finish; nothing new is admitted until resume
        seen = {}
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        tasks = [asyncio.ensure_future(_collect(llm, q, p, f"w{i}", seen)) for i, q in enumerate(prompts)]
        await _until(lambda: len(seen) == 16)
        await llm.pause_generation(mode="wait")
        assert all(t.done() for t in tasks)
        assert all(t.result().outputs[0].finish_reason == "length" for t in tasks)
        late = asyncio.ensure_future(_collect(llm, "Hi", SamplingParams(temperature=0, max_tokens=4), "late2", seen))
        await asyncio.sleep(0.3)
        assert "late2" not in seen
        await llm.resume_generation()
        await late

        # keep: 16 frozen requests continue after an update; versions switch where the pause was
        seen = {}
        p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        tasks = [asyncio.ensure_future(_collect(llm, q, p, f"k{i}", seen)) for i, q in enumerate(prompts)]
        await _until(lambda: len(seen) == 16 and all(len(o.outputs[0].token_ids) >= 2 for o in seen.values()))
        await llm.pause_generation(mode="keep")
        await asyncio.sleep(0.2)  # the last outputs produced before the freeze arrive
        frozen = {rid: len(o.outputs[0].token_ids) for rid, o in seen.items()}
        await asyncio.sleep(0.3)
        assert {rid: len(o.outputs[0].token_ids) for rid, o in seen.items()} == frozen, "kept requests moved"
        await llm.reload_weights(version=1)  # an update while frozen
        await llm.resume_generation()
        outs = await asyncio.gather(*tasks)
        for o in outs:
            v = o.outputs[0].weight_versions
            k = frozen[o.request_id]
            assert len(v) == 40 and v == [0] * k + [1] * (40 - k), (o.request_id, k, v)
    finally:
        llm.shutdown()


def test_requests_waiting_on_a_pause_can_be_aborted():
    asyncio.run(_aborts_while_paused())


async def _aborts_while_paused():
    """A request that arrived while paused has not reached the engine: abort() ends it at once
    (finish_reason "abort", no tokens), and a second pause does not wait for it."""
    llm = AsyncLLM(dtype="float32", kv_cache_memory=64 << 20)
    try:
        await llm.pause_generation(mode="abort")
        seen = {}
        p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        gone = asyncio.ensure_future(_collect(llm, "Hi", p, "gone", seen))
        kept = asyncio.ensure_future(_collect(llm, "Hello", p, "kept", seen))
        await asyncio.sleep(0.3)
        assert not gone.done() and not kept.done()
        await asyncio.wait_for(llm.pause_generation(mode="abort"), 10)  # the waiting ones are not running
        await asyncio.wait_for(llm.pause_generation(mode="wait"), 10)
        await llm.abort("gone")
        out = await asyncio.wait_for(gone, 10)
        assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
        assert not kept.done()
        await llm.resume_generation()
        out = await asyncio.wait_for(kept, 60)
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
        with pytest.raises(InvalidRequestError, match="vocabulary"):  # bad input fails at once, even while paused
            await llm.pause_generation(mode="abort")
            await _collect(llm, [10 ** 9], p, "bad", seen)
    finally:
        llm.shutdown()


# ---- weights shared by a process on the same machine (weight_sync.ipc) -------------------------

def start_ipc_trainer(mode: str, lease: dict | None = None):
    proc = subprocess.Popen([sys.executable, "-m", "tests.engine.ipc_trainer_proc", mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if lease is not None:
        proc.stdin.write(json.dumps(lease) + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"the IPC trainer died (exit code {proc.wait(60)})"
    return proc, json.loads(line)


def stop_ipc_trainer(proc) -> None:
    proc.communicate("done\n", timeout=60)
    assert proc.returncode == 0


@pytest.mark.slow
def test_weights_shared_by_a_trainer_process(llm, prompts, default_model_path):
    """Shared memory from a real trainer process: bad shares leave the weights whole; a good one
    matches transformers on the new weights and the trainer's checksum."""
    base_version = llm.reload_weights()["weight_version"]
    base_sum = llm.weights_checksum()
    for mode, words in (("wrong_shape", "shape"), ("unknown_name", "unknown")):
        proc, shared = start_ipc_trainer(mode)
        with pytest.raises(InvalidRequestError, match=words):
            llm.update_weights_from_ipc(shared["handles"], version=base_version + 5)
        stop_ipc_trainer(proc)
        assert llm.get_weight_version() == base_version and llm.weights_checksum() == base_sum
    proc, shared = start_ipc_trainer("full")
    try:
        result = llm.update_weights_from_ipc(shared["handles"], version=base_version + 3)
    finally:
        stop_ipc_trainer(proc)
    assert result["weight_version"] == base_version + 3 and llm.weights_checksum() == shared["checksum"]
    after = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].weight_versions == [base_version + 3] * 16 for o in after)
    reference = hf_greedy(hf_model_with(default_model_path, perturbed_state(default_model_path)), prompts, 16)
    assert [o.outputs[0].token_ids for o in after] == [r[0] for r in reference]
    # the segment is gone once the trainer closed it: a clear error, weights unchanged
    with pytest.raises(InvalidRequestError, match="closed it too early"):
        llm.update_weights_from_ipc(shared["handles"])
    assert llm.weights_checksum() == shared["checksum"]
    llm.reload_weights()


@pytest.mark.slow
def test_a_trainer_process_writes_into_the_engines_spare(llm, prompts, default_model_path):
    """The engine lends its staging memory (lease_weight_spare); a real trainer process writes
    the new weights there itself, packed for the matmul kernels where it can run their packs, and
    the update swaps them in: transformers on the new weights, before and after a sleep (which
    first unpacks the plain weights from the pushed panels), then the trainer's checksum. A stale
    lease is refused with the weights whole; sleep takes the shared segments' names back; after
    wake the spare is lent again."""
    import os

    from engine.worker.weight_buffers import SEGMENT_PREFIX, SHM_DIR
    from kernels import cpu_ext
    from weight_sync import SpareWriter

    base_version = llm.reload_weights()["weight_version"]
    proc, shared = start_ipc_trainer("spare", llm.lease_weight_spare("trainer"))
    try:
        with pytest.raises(InvalidRequestError, match="lease is not current"):
            llm.update_weights_from_ipc(dict(shared["handles"], lease="0" * 16), version=base_version + 1)
        assert llm.get_weight_version() == base_version  # (the refusal ended the lease: lease again)
        proc.communicate("done\n", timeout=60)
        lease = llm.lease_weight_spare("trainer", SpareWriter().layouts)  # (the trainer's build is this one)
        ext = cpu_ext.built()
        if ext is not None and ext.f32_panel_supported():  # the float32 panels serve the projections here
            assert {e.get("pack") for e in lease["tensors"]} == {"f32_panel_pack", None}
        proc, shared = start_ipc_trainer("spare", lease)
        result = llm.update_weights_from_ipc(shared["handles"], version=base_version + 3)
    finally:
        stop_ipc_trainer(proc)
    assert result["weight_version"] == base_version + 3
    after = llm.generate(prompts, GREEDY, use_tqdm=False)
    reference = hf_greedy(hf_model_with(default_model_path, perturbed_state(default_model_path)), prompts, 16)
    assert [o.outputs[0].token_ids for o in after] == [r[0] for r in reference]
    segments = llm.lease_weight_spare("trainer")["segments"]
    assert all(os.path.exists(os.path.join(SHM_DIR, n)) and n.startswith(SEGMENT_PREFIX) for n in segments)
    llm.sleep(1)
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in segments)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [r[0] for r in reference]
    assert llm.weights_checksum() == shared["checksum"]
    assert llm.lease_weight_spare("trainer")["segments"] != segments
    llm.reload_weights()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_from_a_trainer_process_on_the_same_gpu(default_model_path):
    engine = LLM(dtype="float32", device="cuda", kv_cache_memory=256 << 20)
    try:
        proc, shared = start_ipc_trainer("cuda")
        try:
            assert shared["handles"]["kind"] == "cuda"
            assert engine.update_weights_from_ipc(shared["handles"], version=1)["weight_version"] == 1
        finally:
            stop_ipc_trainer(proc)
        assert engine.weights_checksum() == shared["checksum"]
    finally:
        engine.shutdown()


def test_ipc_handles_are_checked_and_never_run_code(tmp_path):
    import base64
    import os
    import pickle

    from weight_sync import SharedWeights, read_shared

    cpu = torch.device("cpu")
    for bad in ({}, {"kind": "nope", "tensors": []}, {"kind": "shm", "tensors": "x"}):
        with pytest.raises(ValueError, match="IPC handles must be"):
            read_shared(bad, cpu)
    with SharedWeights() as shared:
        h = shared.share([("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16))])
        got = read_shared(h, cpu, check=lambda n, shape, dtype: None)
        assert torch.equal(got["a"], torch.arange(6.0).view(2, 3)) and got["b"].dtype == torch.bfloat16
        h["tensors"][0]["shape"] = [1000, 1000]
        with pytest.raises(ValueError, match="outside the shared segment"):
            read_shared(h, cpu)

    class Evil:  # a "handle" whose unpickling would run a command
        def __reduce__(self):
            return os.system, (f"touch {tmp_path}/pwned",)

    evil = {"kind": "cuda", "tensors": [{"name": "a", "handle": base64.b64encode(pickle.dumps(Evil())).decode()}]}
    with pytest.raises(ValueError, match="may not name"):
        read_shared(evil, cpu)
    assert not (tmp_path / "pwned").exists()


def test_a_tied_lm_head_in_a_push_is_checked_and_skipped(default_model_path):
    """A trainer's state_dict() of a tied model holds lm_head.weight (the embedding): accepted
    when equal to the embedding it is tied to, refused (weights whole) when not."""
    llm = LLM(dtype="float32", multiprocess=False, kv_cache_memory=64 << 20)
    try:
        base = dict(_base_state(default_model_path))
        checksum = llm.weights_checksum()
        embed = base["model.embed_tokens.weight"]
        result = llm.update_weights_from_tensors([("model.embed_tokens.weight", embed), ("lm_head.weight", embed)])
        assert result["num_tensors"] == 1 and llm.weights_checksum() == checksum
        with pytest.raises(InvalidRequestError, match="ties them"):
            llm.update_weights_from_tensors([("lm_head.weight", embed * 2)])
        assert llm.weights_checksum() == checksum
    finally:
        llm.shutdown()


def test_a_deadline_ends_staging_and_nothing_goes_live(llm, default_model_path):
    """update_weights_from with deadline_s: an update the workers cannot stage in time (a disk
    read past it) raises TimeoutError across the process boundary and changes nothing, its trace
    naming the phase; without a deadline the same update goes through, every phase timed."""
    from engine.process.utility import UpdateTrace

    version, checksum = llm.get_weight_version(), llm.weights_checksum()
    trace = UpdateTrace()
    with pytest.raises(TimeoutError, match="deadline"):
        llm.update_weights_from("disk", [default_model_path], deadline_s=1e-6, trace=trace)
    assert trace.phase == "receive"
    assert llm.get_weight_version() == version and llm.weights_checksum() == checksum
    trace = UpdateTrace()
    assert llm.update_weights_from("disk", [default_model_path], deadline_s=60, trace=trace)["weight_version"] == \
        version + 1
    assert trace.phase == "done" and set(trace.seconds) == {"receive", "stage", "swap", "clear_cache"}
    assert llm.weights_checksum() == checksum


# ---- an update received beside the steps (EngineConfig.stages_weights_beside_steps) ------------------
LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # (outlasts the late push)
REFERENCE = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)  # (past what a receive overlaps)
COUNT = "Count slowly from one to a thousand:"


async def _late_push(llm, seed: int = 0, dtype: str | None = None, world_size: int = 2, **kwargs):
    """A trainer process that sends a full push (perturbed with `seed`) LATE_S after the group
    formed, and the engine's update of it under way: (trainer, trace, update task)."""
    from engine.process.utility import UpdateTrace

    port = find_free_port()
    trainer = start_trainer(port, "late", world_size, seed=seed, dtype=dtype)
    await llm.init_weight_transfer("127.0.0.1", port, world_size, timeout_s=60)
    trace = UpdateTrace()
    update = asyncio.ensure_future(llm.update_weights_from("broadcast", [], trace=trace, **kwargs))
    return trainer, trace, update


@pytest.mark.parametrize("dtype,tp", [("float32", 1), pytest.param("bfloat16", 1, marks=pytest.mark.slow),
                                      pytest.param("float32", 2, marks=pytest.mark.slow)])
def test_requests_go_on_generating_while_a_push_is_received(dtype, tp, default_model_path):
    asyncio.run(_generates_while_receiving(dtype, tp, default_model_path))


async def _generates_while_receiving(dtype: str, tp: int, model_path: str):
    """The bytes of a push arrive while a request generates with the live weights (its tokens
    those of the live weights, bit for bit: the receive writes only memory no step reads, also
    the second time, into the storage the first swap took out of service); generation pauses
    only once they are all staged, for the swap, and the request goes on under the new version
    after the resume. With tensor parallelism every rank receives its shard in a thread of its
    process while the ranks step together."""
    llm = AsyncLLM(dtype=dtype, kv_cache_memory=128 << 20, tensor_parallel_size=tp)
    try:
        for version in (1, 2) if tp == 1 else (1,):  # (tp: the ranks' threads; the second push is tp 1's case)
            reference = (await _collect(llm, COUNT, REFERENCE, f"ref{version}", {})).outputs[0].token_ids
            seen = {}
            task = asyncio.ensure_future(_collect(llm, COUNT, LONG, f"r{version}", seen))
            await _until(lambda: f"r{version}" in seen)
            trainer, trace, update = await _late_push(llm, seed=version, dtype=dtype, world_size=1 + tp,
                                                      pause={"mode": "keep"})
            n0 = len(seen[f"r{version}"].outputs[0].token_ids)
            await asyncio.sleep(1.0)  # (the trainer sends 2 s after the group formed)
            assert trace.phase == "receive" and not update.done()
            n1 = len(seen[f"r{version}"].outputs[0].token_ids)
            assert n1 - n0 >= 5, f"generation stood still while the push was received ({n0} -> {n1} tokens)"
            result = await update
            assert result["weight_version"] == version and result["paused"]["kept"] == 1
            assert result["paused"]["was_paused"] is False
            assert list(trace.seconds) == ["receive", "stage", "pause", "swap", "clear_cache"]
            assert await llm.is_paused()  # (the caller resumes)
            await llm.resume_generation()
            # a few tokens under the new version, then the rest of the long request is not needed
            await _until(lambda: seen[f"r{version}"].outputs[0].weight_versions.count(version) >= 5)
            await llm.abort(f"r{version}")
            out = (await task).outputs[0]
            k = out.weight_versions.count(version - 1)
            assert out.weight_versions == [version - 1] * k + [version] * (len(out.token_ids) - k) and k >= n1
            same = min(k, len(reference))  # (every token made during the receive, and the rest up to the swap
            assert same >= n1             # where the reference reaches)
            assert out.token_ids[:same] == reference[:same], "the receive changed what the live weights compute"
            assert trainer_result(trainer)["ok"]
            pushed = perturbed_state(model_path, seed=version)
            assert await llm.weights_checksum() == weights_checksum(pushed.items(), dtype=getattr(torch, dtype))
    finally:
        llm.shutdown()


def test_a_sleep_during_a_receive_waits_for_it_and_the_update_is_refused():
    asyncio.run(_sleep_during_receive())


async def _sleep_during_receive():
    """A sleep asked for while a push is received beside a request (another frontend's sleep, say)
    waits for the receive instead of freeing what it writes; the update then finds the weights
    asleep and is refused, discarded whole: after the wake-up the old weights serve under the old
    version."""
    llm = AsyncLLM(dtype="float32", kv_cache_memory=128 << 20)
    try:
        checksum = await llm.weights_checksum()
        seen = {}
        running = asyncio.ensure_future(_collect(llm, COUNT, LONG, "r", seen))
        await _until(lambda: "r" in seen)
        trainer, trace, update = await _late_push(llm, pause={"mode": "keep"})
        await asyncio.sleep(0.5)
        sleeping = asyncio.ensure_future(llm.sleep(1))
        await asyncio.sleep(0.5)
        assert trace.phase == "receive" and not sleeping.done(), "the sleep did not wait for the receive"
        with pytest.raises(EngineStateError, match="asleep"):
            await update
        assert trace.phase == "swap"
        await sleeping
        assert (await running).outputs[0].finish_reason == "abort"  # (the sleep's pause mode)
        assert trainer_result(trainer)["ok"]  # every byte was received, then discarded
        await llm.wake_up()
        assert await llm.get_weight_version() == 0 and await llm.weights_checksum() == checksum
        out = await _collect(llm, "Hi", SamplingParams(temperature=0, max_tokens=4), "after", {})
        assert out.outputs[0].weight_versions == [0] * 4
    finally:
        llm.shutdown()


def test_a_wait_pause_past_the_deadline_after_the_receive_changes_nothing():
    asyncio.run(_wait_pause_past_deadline())


async def _wait_pause_past_deadline():
    """pause mode "wait" comes after the receive: a request that outlasts the deadline fails the
    update in phase "pause" (trace.paused: the pause is the caller's to lift), nothing is live,
    and the trainer's push itself completed (its group stays usable)."""
    llm = AsyncLLM(dtype="float32", kv_cache_memory=256 << 20)
    try:
        checksum = await llm.weights_checksum()
        seen = {}
        task = asyncio.ensure_future(_collect(llm, COUNT, SamplingParams(temperature=0, max_tokens=3000,
                                                                         ignore_eos=True), "long", seen))
        await _until(lambda: "long" in seen)
        port = find_free_port()
        trainer = start_trainer(port, "full")
        await llm.init_weight_transfer("127.0.0.1", port, 2, timeout_s=60)
        from engine.process.utility import UpdateTrace

        trace = UpdateTrace()
        with pytest.raises(TimeoutError, match="pausing"):
            await llm.update_weights_from("broadcast", [], trace=trace, deadline_s=6.0, pause={"mode": "wait"})
        assert trace.phase == "pause" and trace.paused["was_paused"] is False and "receive" in trace.seconds
        assert trainer_result(trainer)["ok"]
        assert await llm.is_paused()  # (the update's pause, still waiting for the request)
        await llm.resume_generation()
        assert await llm.get_weight_version() == 0 and await llm.weights_checksum() == checksum
        await llm.abort("long")
        await task
    finally:
        llm.shutdown()
