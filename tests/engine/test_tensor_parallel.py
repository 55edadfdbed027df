"""Tensor parallelism: T real worker processes per replica in a real gloo group, against
transformers on the full model.

Numerics: a row-parallel projection sums its ranks' partial products in another order than one
matmul does, so float32 logits move by ~1e-6 relative; greedy tokens are compared exactly and a
flip is reported with HF's top-2 margin where it happened (tests.engine.test_tiny_models.compare).
"""
import asyncio
import os
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import engine
from engine import LLM, InvalidRequestError, SamplingParams
from engine.default_model import default_model_path
from engine.frontend.async_llm import AsyncLLM
from engine.model.parallel import Shard, head_split, split
from engine.worker.lora import LoRARequest
from tests.engine.hf_reference import CHATS, chat_token_ids, load_hf
from tests.engine.hf_reference import hf_greedy as hf_greedy_real
from tests.engine.perturb import hf_model_with, perturbed_state
from tests.engine.test_rl_control import push, start_ipc_trainer, stop_ipc_trainer
from tests.engine.test_tiny_models import PARAMS, build_model, compare, hf_greedy, make_prompts
from weight_sync import SharedWeights, SpareWriter, WeightTransferError, weights_checksum

EXT = "tests.engine.rl_worker_ext.MemoryProbe"


# ---- the split itself -----------------------------------------------------------------------
def test_splits_are_contiguous_cover_everything_and_keep_groups_together():
    for n in (1, 3, 9, 49152, 49155):
        for size in (1, 2, 3, 4):
            ranges = [split(n, size, r) for r in range(size)]
            assert ranges[0][0] == 0 and sum(c for _, c in ranges) == n
            assert all(a[0] + a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    # SmolLM2-135M: 9 query heads in 3 kv groups of 3
    assert [head_split(9, 3, 2, r) for r in range(2)] == [((0, 6), (0, 2)), ((6, 3), (2, 1))]
    # more ranks than kv heads: each kv head is held by two ranks, its group's query heads split
    assert [head_split(4, 2, 4, r) for r in range(4)] == [((0, 1), (0, 1)), ((1, 1), (0, 1)),
                                                          ((2, 1), (1, 1)), ((3, 1), (1, 1))]
    with pytest.raises(engine.UnsupportedModelError, match="multiple"):
        head_split(9, 3, 4, 0)
    with pytest.raises(engine.UnsupportedModelError, match="attention heads"):
        head_split(4, 2, 8, 0)


def test_shards_reassemble_the_full_tensor():
    full = torch.arange(6 * 4.0).view(6, 4)
    for shard in (Shard(0, ((0, 4), (4, 2))), Shard(1, ((0, 3), (3, 1))), Shard(0, ((0, 3), (0, 3), (3, 3), (3, 3)))):
        parts = [shard.of(full, r) for r in range(len(shard.ranges))]
        assert shard.full_shape(tuple(parts[0].shape)) == (6, 4)
        assert torch.equal(shard.assemble(parts), full)


# ---- tiny models against transformers ----------------------------------------------------------
UNEVEN = dict(vocab_size=49155, hidden_size=96, intermediate_size=129, num_attention_heads=6, num_key_value_heads=3,
              head_dim=16, num_hidden_layers=2, max_position_embeddings=512, initializer_range=0.15,
              tie_word_embeddings=False)


def build_uneven(folder):
    """A Llama whose heads, intermediate columns and vocabulary all split unevenly in two."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**UNEVEN), dtype=torch.float32, attn_implementation="eager")
    model.eval().save_pretrained(folder)
    return model


def hf_state(model) -> dict:
    """The tensors the engine holds (a tied model's lm_head is its embedding)."""
    tied = model.config.tie_word_embeddings
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def tp_llm(folder, size, **kw):
    return LLM(str(folder), dtype="float32", kv_cache_memory=64 << 20, tokenizer=str(default_model_path()),
               tensor_parallel_size=size, multiprocess=False, **kw)


@pytest.fixture(scope="module", params=["uneven", "qwen3", "qwen2"])
def tiny_tp2(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = build_uneven(folder) if name == "uneven" else build_model(name, folder)
    prompts = make_prompts()
    refs = [hf_greedy(model, p) for p in prompts]
    llm = tp_llm(folder, 2, worker_extension_cls=EXT)
    yield name, model, llm, prompts, refs
    llm.shutdown()


def test_tp2_matches_transformers(tiny_tp2):
    """Greedy tokens exact and logprobs within 1e-4 of HF, through a prefix hit and again one by one."""
    name, _, llm, prompts, refs = tiny_tp2
    compare(name, prompts, refs, llm.generate(prompts, PARAMS, use_tqdm=False))
    again = llm.generate(prompts, PARAMS, use_tqdm=False)
    compare(name, prompts, refs, again)
    assert all(o.num_cached_tokens > 0 for o, p in zip(again, prompts) if len(p) > 16)
    assert llm.collective_rpc("get_rank") == [0, 1]


def test_tp2_checksum_is_the_full_tensors(tiny_tp2):
    """Rank 0 gathers the shards: the checksum is the one a trainer computes on the HF model."""
    _, model, llm, _, _ = tiny_tp2
    assert llm.weights_checksum() == weights_checksum(hf_state(model).items())


def assert_packed_and_serving(llm, name, model, prompts, new: dict) -> None:
    """After a push of `new`: every rank's projections are the panels the update staged (the
    row-parallel ones, column slices of the pushed tensors, packed in place: the swap in the pause
    repacked nothing), greedy tokens equal transformers on `new`, and so does the checksum."""
    for rank, packed in enumerate(llm.collective_rpc("packed_by_the_update")):
        for i in range(model.config.num_hidden_layers):
            assert f"model.layers.{i}.self_attn.o_proj.weight" in packed, (rank, packed)
            assert f"model.layers.{i}.mlp.down_proj.weight" in packed, (rank, packed)
    reference = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    reference.load_state_dict(new, strict=False)
    if model.config.tie_word_embeddings:
        reference.tie_weights()
    refs = [hf_greedy(reference, p) for p in prompts[:3]]
    # generated before anything reads the plain weights back (a tied embedding's rows come out of
    # the head's panels meanwhile), then the checksum, which unpacks them
    compare(name, prompts[:3], refs, llm.generate(prompts[:3], PARAMS, use_tqdm=False))
    assert llm.weights_checksum() == weights_checksum(new.items())


def test_tp2_push_lands_on_every_shard_and_a_bad_one_on_none(tiny_tp2):
    """Full HF tensors in; each rank keeps its slice; a wrong shape changes no rank."""
    name, model, llm, prompts, _ = tiny_tp2
    state = {k: v.clone() for k, v in hf_state(model).items()}
    before = llm.weights_checksum()
    bad = dict(state)
    bad["model.layers.1.mlp.down_proj.weight"] = bad["model.layers.1.mlp.down_proj.weight"][:, :-1]
    with pytest.raises(InvalidRequestError, match="shape"):
        llm.update_weights_from_tensors(bad.items(), version=5)
    assert llm.weights_checksum() == before and llm.get_weight_version() == 0
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    llm.update_weights_from_tensors(new.items(), version=1)
    assert_packed_and_serving(llm, name, model, prompts, new)  # (each rank packed its shards as they arrived)
    with SharedWeights() as shared:  # back through shared memory, read by each rank for its slices
        llm.update_weights_from_ipc(shared.share(state.items()), version=2)
    assert llm.weights_checksum() == before


def test_tp2_trainer_writes_each_ranks_slices_into_its_spare(tiny_tp2):
    """Each rank lends its own spare; the trainer's SpareWriter writes every rank's slices of the
    full tensors into it (the row-parallel ones, column slices, packed from their strided rows),
    and the update swaps them in: greedy tokens equal transformers on the new weights, the
    checksum equals the trainer's, and no rank repacks a projection in the pause."""
    name, model, llm, prompts, _ = tiny_tp2
    state = {k: v.clone() for k, v in hf_state(model).items()}
    before, version = llm.weights_checksum(), llm.get_weight_version()
    writer = SpareWriter()
    lease = llm.lease_weight_spare("trainer", writer.layouts)
    assert len(lease["ranks"]) == 2 and lease["replica"] == 0
    slots = {t["name"]: t for t in lease["ranks"][1]["tensors"]}
    down, q = slots["model.layers.0.mlp.down_proj.weight"], slots["model.layers.0.self_attn.q_proj.weight"]
    assert down["slice"][0] == 1 and "pack" in down  # (row-parallel: a column slice, packed by the trainer)
    assert q["slice"][0] == 0 and q["shape"] == list(state["model.layers.0.self_attn.q_proj.weight"].shape)
    halved = writer.write(lease, [(k, v * 0.5) for k, v in state.items()])
    with pytest.raises(InvalidRequestError, match="2 handles, one per rank"):  # rank 0's handles alone
        llm.update_weights_from_ipc(dict(halved["ranks"][0], kind="spare"), version=version + 1)
    assert llm.weights_checksum() == before and llm.get_weight_version() == version
    g = torch.Generator().manual_seed(11)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    handles = writer.write(llm.lease_weight_spare("trainer", writer.layouts), new.items())
    assert [len(h["tensors"]) for h in handles["ranks"]] == [len(new)] * 2
    llm.update_weights_from_ipc(handles, version=version + 1)
    assert_packed_and_serving(llm, name, model, prompts, new)  # (the trainer packed them: swapped in)
    handles = writer.write(llm.lease_weight_spare("trainer", writer.layouts), state.items())
    llm.update_weights_from_ipc(handles, version=version + 2)  # (back, for the module's other tests)
    writer.close()
    assert llm.weights_checksum() == before


def test_tp2_sleep_and_wake_on_every_rank(tiny_tp2):
    name, _, llm, prompts, refs = tiny_tp2
    llm.sleep(2)
    assert llm.collective_rpc("weight_bytes") == [0, 0]
    llm.wake_up()
    llm.reload_weights(version=9)
    compare(name, prompts[:2], refs[:2], llm.generate(prompts[:2], PARAMS, use_tqdm=False))


def test_more_ranks_than_kv_heads(tmp_path):
    """TP=4 on 2 kv heads: each kv head on two ranks, every rank one query head."""
    model = build_model("qwen3", tmp_path)  # 4 heads, 2 kv heads
    prompts = make_prompts()[:3]
    refs = [hf_greedy(model, p) for p in prompts]
    llm = tp_llm(tmp_path, 4, max_data_parallel_size=1)
    try:
        compare("qwen3 tp4", prompts, refs, llm.generate(prompts, PARAMS, use_tqdm=False))
        assert llm.weights_checksum() == weights_checksum(hf_state(model).items())
    finally:
        llm.shutdown()


def test_bad_sizes_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        LLM(tensor_parallel_size=0, multiprocess=False)
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(tensor_parallel_size=2, batch_invariant=True, multiprocess=False)
    model = build_model("qwen3", tmp_path)
    del model
    with pytest.raises(engine.UnsupportedModelError, match="attention heads"):
        tp_llm(tmp_path, 8)


def test_tp2_with_async_scheduling_equals_one_step_at_a_time(tmp_path):
    """Async scheduling on two ranks: only rank 0 samples, and it shares each step's tokens with
    rank 1, which decodes them as the next step's placeholders. Greedy tokens equal transformers'
    (through a prefix hit), seeded samples equal those of one step at a time."""
    model = build_uneven(tmp_path)
    prompts = make_prompts()
    refs = [hf_greedy(model, p) for p in prompts]
    seeded = [SamplingParams(temperature=1.0, max_tokens=12, seed=i, ignore_eos=True) for i in range(len(prompts))]
    sync = tp_llm(tmp_path, 2)
    try:
        expected = [o.outputs[0].token_ids for o in sync.generate(prompts, seeded, use_tqdm=False)]
    finally:
        sync.shutdown()
    llm = tp_llm(tmp_path, 2, async_scheduling=True)
    try:
        compare("uneven", prompts, refs, llm.generate(prompts, PARAMS, use_tqdm=False))
        compare("uneven", prompts, refs, llm.generate(prompts, PARAMS, use_tqdm=False))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)] == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_killed_rank_ends_the_replica_and_leaves_no_process(tmp_path, async_scheduling):
    """kill -9 of rank 1 mid-generation: the caller gets EngineDeadError within 5 s; no rank survives."""
    model = build_model("qwen3", tmp_path)
    del model
    llm = tp_llm(tmp_path, 2, worker_extension_cls=EXT, async_scheduling=async_scheduling)
    pids = llm.collective_rpc("pid")
    assert pids[0] == os.getpid() and pids[1] != pids[0]
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    outcome = {}

    def run():
        # Generate until the engine fails: a fast machine finishes one batch before the kill.
        try:
            while time.monotonic() < deadline:
                llm.generate([make_prompts()[0]] * 4, long, use_tqdm=False)
            outcome["error"] = None
        except Exception as e:  # noqa: BLE001 - the test inspects it
            outcome["error"], outcome["at"] = e, time.monotonic()

    deadline = time.monotonic() + 30

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    t.join(30)
    assert isinstance(outcome.get("error"), engine.EngineDeadError), outcome
    assert outcome["at"] - killed_at < 5.0
    with pytest.raises(engine.EngineDeadError):
        llm.generate([make_prompts()[0]], PARAMS, use_tqdm=False)
    llm.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pids[1], 0)


# ---- the real model, in engine-core processes -------------------------------------------------
@pytest.fixture(scope="module")
def real_tp2():
    llm = LLM(dtype="float32", tensor_parallel_size=2, worker_extension_cls=EXT, kv_cache_memory=256 << 20)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def chats(default_model_path):
    from transformers import AutoTokenizer

    return chat_token_ids(AutoTokenizer.from_pretrained(default_model_path), CHATS[:4])


def assert_matches_hf(outs, refs, what: str):
    for i, (o, (tokens, lps, gaps)) in enumerate(zip(outs, refs)):
        c = o.outputs[0]
        if c.token_ids != tokens:
            j = next(k for k, (a, b) in enumerate(zip(c.token_ids, tokens)) if a != b)
            pytest.fail(f"{what} prompt {i}: greedy differs at token {j} (HF's top-2 logit margin there "
                        f"{gaps[j]:.3g})")
        diff = max(abs(a - b) for a, b in zip(c.logprobs, lps))
        assert diff <= 1e-4, f"{what} prompt {i}: logprobs differ by {diff:.2e}"


@pytest.mark.slow
def test_real_model_tp2_matches_transformers_then_takes_a_trainer_push(real_tp2, chats, default_model_path):
    """SmolLM2-135M (9 heads in 3 kv groups: split 6+3) on two ranks against HF; a gloo push from a
    trainer process (world: trainer + 2 ranks) lands on both shards; a wrong shape on none; a
    trainer process that writes each rank's slices into the spare that rank lent does the same."""
    llm = real_tp2
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    assert_matches_hf(llm.generate(chats, params, use_tqdm=False),
                      hf_greedy_real(load_hf(default_model_path), chats, 16), "tp2")
    base = llm.weights_checksum()
    result, trainer = push(llm, "wrong_shape", world_size=3, timeout_s=30)
    assert isinstance(result, WeightTransferError) and "shape" in str(result), result
    assert llm.weights_checksum() == base and llm.get_weight_version() == 0
    result, trainer = push(llm, "full", version=1, world_size=3, timeout_s=30)
    assert trainer["ok"], trainer
    assert llm.weights_checksum() == trainer["checksum"]
    pushed = hf_model_with(default_model_path, perturbed_state(default_model_path))
    outs = llm.generate(chats, params, use_tqdm=False)
    assert all(o.outputs[0].weight_versions == [1] * 16 for o in outs)
    reference = hf_greedy_real(pushed, chats, 16)
    assert_matches_hf(outs, reference, "tp2 after the push")
    llm.reload_weights(version=2)
    assert llm.weights_checksum() == base
    proc, shared = start_ipc_trainer("spare", llm.lease_weight_spare("trainer", SpareWriter().layouts))
    try:
        assert len(shared["handles"]["ranks"]) == 2
        llm.update_weights_from_ipc(shared["handles"], version=3)
    finally:
        stop_ipc_trainer(proc)
    assert llm.weights_checksum() == shared["checksum"]
    assert_matches_hf(llm.generate(chats, params, use_tqdm=False), reference, "tp2 after the spare push")
    llm.reload_weights(version=4)
    assert llm.weights_checksum() == base


@pytest.mark.slow
def test_real_model_tp2_sleep_frees_every_ranks_memory(real_tp2, chats):
    llm = real_tp2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(chats, params, use_tqdm=False)]
    kv = llm.collective_rpc("fill_kv_cache")
    weights = llm.collective_rpc("weight_bytes")
    awake = llm.collective_rpc("rss_bytes")
    llm.sleep(2)
    slept = llm.collective_rpc("rss_bytes")
    for rank, (a, s, k, w) in enumerate(zip(awake, slept, kv, weights)):
        assert a - s >= 0.9 * (k + w), f"rank {rank}: RSS {a} -> {s}, its KV {k} + weights {w}"
    llm.wake_up()
    llm.reload_weights(version=llm.get_weight_version() + 1)
    assert [o.outputs[0].token_ids for o in llm.generate(chats, params, use_tqdm=False)] == before


@pytest.mark.slow
def test_dp2_tp2_push_and_scale_up(tiny_folder):
    """Two replicas of two ranks (oversubscribing the cores on purpose): one push reaches all four
    ranks; a third replica scaled up copies the pushed weights from a live one."""
    async def run():
        llm = AsyncLLM(tiny_folder, dtype="float32", tokenizer=str(default_model_path()), data_parallel_size=2,
                       tensor_parallel_size=2, max_data_parallel_size=3, kv_cache_memory=32 << 20)
        try:
            assert len(await llm.collective_rpc("get_rank")) == 4
            g = torch.Generator().manual_seed(3)
            from weight_sync import load_safetensors_folder

            new = [(n, t.float() + 0.1 * torch.randn(t.shape, generator=g)) for n, t in load_safetensors_folder(tiny_folder)]
            await llm.update_weights_from_tensors(new, version=4)
            assert await llm.weights_checksum() == weights_checksum(new)
            await llm.scale(3)
            assert len(await llm.collective_rpc("get_rank")) == 6
            assert await llm.weights_checksum() == weights_checksum(new)  # (replicas must agree)
        finally:
            llm.shutdown()

    asyncio.run(run())


def test_lora_on_tp2_equals_peft(tmp_path):
    """Adapters sliced like their base projections (q/k/v/gate/up by output rows, o/down by input
    columns): three adapters and the base model in one batch equal PEFT; a push of one adapter's
    full PEFT tensors lands on both ranks."""
    from tests.engine.test_lora import GREEDY, PROMPTS, build_models, lora_tensors, perturbed, reference

    folder, base, adapters = build_models(tmp_path)
    llm = tp_llm(folder, 2, enable_lora=True)
    try:
        loras = [None] + [LoRARequest(f"a{k}", k + 1, path) for k, (path, _) in enumerate(adapters)]
        prompts = [p for p in PROMPTS for _ in loras]
        lora_of = [r for _ in PROMPTS for r in loras]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora_of)
        for p, r, o in zip(prompts, lora_of, outs):
            model = base if r is None else adapters[r.lora_int_id - 1][1]
            assert o.outputs[0].token_ids == reference(model, p), (r, p)
        trained = perturbed(adapters[2][1], 1)  # all-linear: every projection's slicing is exercised
        llm.update_weights_from_tensors(lora_tensors(trained), version=3, lora_id=3)
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False, lora_request=loras[3])
        assert out[0].outputs[0].token_ids == reference(trained, PROMPTS[1])
    finally:
        llm.shutdown()


def test_tp2_saves_after_a_push_as_hf_and_as_shards(tmp_path):
    """After a push: save_weights gathers a Hugging Face folder that transformers serves with the
    same greedy tokens; save_sharded_state writes each rank's slices, which a TP=2 engine starts
    from (and reloads) with the same checksum, and a TP=1 engine refuses."""
    model = build_uneven(tmp_path / "base")
    prompts = make_prompts()[:3]
    llm = tp_llm(tmp_path / "base", 2)
    try:
        g = torch.Generator().manual_seed(5)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf_state(model).items()}
        llm.update_weights_from_tensors(new.items(), version=1)
        served = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        llm.save_weights(tmp_path / "hf")
        saved = llm.save_sharded_state(tmp_path / "shards", max_size=1 << 20)
        assert len(saved["files"]) == 2 and all(len(f) > 1 for f in saved["files"])  # per rank, split by max_size
        checksum = llm.weights_checksum()
    finally:
        llm.shutdown()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert [hf_greedy(reloaded, p)[0] for p in prompts] == served
    again = tp_llm(tmp_path / "shards", 2)
    try:
        assert again.weights_checksum() == checksum == weights_checksum(new.items())
        assert [o.outputs[0].token_ids for o in again.generate(prompts, PARAMS, use_tqdm=False)] == served
        again.reload_weights(version=2)
        assert again.weights_checksum() == checksum
    finally:
        again.shutdown()
    with pytest.raises(engine.UnsupportedModelError, match="tensor_parallel_size 2"):
        tp_llm(tmp_path / "shards", 1)


@pytest.mark.slow
def test_ray_replica_of_two_ranks(tiny_folder):
    """Under Ray each replica's placement group has a bundle per rank (on one node); the replica
    serves what a local one does."""
    prompts = make_prompts()[:2]

    async def run(**kw):
        llm = AsyncLLM(tiny_folder, dtype="float32", tokenizer=str(default_model_path()), tensor_parallel_size=2,
                       kv_cache_memory=32 << 20, **kw)
        try:
            outs = [await collect(llm, p, f"r{i}") for i, p in enumerate(prompts)]
            groups = getattr(llm.client.manager, "groups", {})
            return outs, [len(g.bundle_specs) for g in groups.values()]
        finally:
            llm.shutdown()

    async def collect(llm, prompt, rid):
        final = None
        async for out in llm.generate({"prompt_token_ids": prompt}, PARAMS, rid):
            final = out
        return final.outputs[0].token_ids

    local, _ = asyncio.run(run())
    on_ray, bundles = asyncio.run(run(data_parallel_backend="ray"))
    assert on_ray == local and bundles == [2]


@pytest.mark.slow
def test_a_killed_rank_ends_only_its_replica(tiny_folder):
    """-dp 2 -tp 2 (cores oversubscribed on purpose): kill -9 of replica 0's rank 1 fails that
    replica's callers with EngineDeadError within 5 s, replica 1 serves on, and no process of
    replica 0 is left."""
    from engine import EngineDeadError

    async def main(llm):
        pids = await llm.collective_rpc("pid")  # replica 0: rank 0 (its engine core), rank 1; replica 1: ...
        assert len(set(pids)) == 4
        p = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        results: dict = {}

        async def collect(i):
            try:
                async for out in llm.generate([100 + i] * 6, p, request_id=f"r{i}"):
                    results[i] = out
            except EngineDeadError as e:
                results[i] = e

        tasks = [asyncio.ensure_future(collect(i)) for i in range(4)]
        while len(results) < 4:
            await asyncio.sleep(0.02)
        victims = [i for i in range(4) if llm.client.owner[f"r{i}"].index == 0]
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        while not all(isinstance(results[i], EngineDeadError) for i in victims):
            assert time.monotonic() - t0 < 5, "the replica's callers did not learn of the dead rank within 5 s"
            await asyncio.sleep(0.02)
        assert not any(isinstance(results[i], Exception) for i in range(4) if i not in victims)
        out = None
        async for out in llm.generate([5] * 6, PARAMS):  # new requests go to the survivor
            pass
        assert out.outputs[0].finish_reason == "length"
        await llm.abort([f"r{i}" for i in range(4)])
        await asyncio.gather(*tasks)
        return pids

    llm = AsyncLLM(tiny_folder, dtype="float32", tokenizer=str(default_model_path()), data_parallel_size=2,
                   tensor_parallel_size=2, max_data_parallel_size=2, kv_cache_memory=32 << 20,
                   worker_extension_cls=EXT)
    try:
        pids = asyncio.run(main(llm))
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 5.0  # (the dead replica's core flushes its last message, then exits)
    while [pid for pid in pids if os.path.exists(f"/proc/{pid}")] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "a rank survived"
