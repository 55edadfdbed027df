"""Staging a weight update in the worker's spare and making it live (engine/worker/weight_buffers.py),
on tiny random-weight models held in this process: a full update swaps every storage (nothing
copied, the old storage becomes the next spare), a partial one copies exactly what it moves, a
tied model's lm_head copy is compared and dropped, MoE experts pushed by either naming land, and
the packed matmul copies always read the new weights."""
import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.decoder import LlamaModel
from engine.worker.weight_buffers import WeightBuffers
from tests.engine.test_tiny_models import build_model


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"])
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_model(request.param, path)
    return str(path)


def _model(folder: str) -> LlamaModel:
    model = LlamaModel(ModelConfig.from_folder(folder), torch.float32, torch.device("cpu"), 256)
    model.load_weights(folder)
    return model


def _stage(buffers: WeightBuffers, model: LlamaModel, tensors: dict) -> dict:
    staged = {name: buffers.dest(model, name).copy_(t) for name, t in tensors.items()}
    model.untie_pushed(staged)
    model.split_fused_experts(staged)
    return staged


def _new_values(model: LlamaModel, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(view.shape, generator=g) for name, view in model.hf_views()}


def _assert_live(model: LlamaModel, tensors: dict) -> None:
    for name, t in tensors.items():
        assert torch.equal(model.hf_view(name), t), name
    for lin in model._linears():  # the packed copies (oneDNN, the rows kernel) read the new weights
        x = torch.randn(12, lin.weight.shape[1], dtype=lin.weight.dtype)
        tol = 1e-4 if x.dtype == torch.float32 else 2e-2  # (bf16: our float32 sums against torch's)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=tol, atol=tol)


def test_full_update_swaps_every_storage(folder):
    model, buffers = _model(folder), WeightBuffers()
    qkv = model.layers[0].qkv.weight
    first_ptr = qkv.data_ptr()
    for seed in (1, 2, 3):
        new = _new_values(model, seed)
        assert buffers.commit(model, _stage(buffers, model, new)) == 0  # nothing copied
        _assert_live(model, new)
        assert model.layers[0].qkv.weight is qkv  # the same tensor object, another storage
        assert (qkv.data_ptr() == first_ptr) == (seed % 2 == 0)  # the two storages take turns


def test_partial_update_copies_what_it_moves(folder):
    model, buffers = _model(folder), WeightBuffers()
    buffers.commit(model, _stage(buffers, model, _new_values(model, 1)))  # the spare exists now
    before = {name: view.clone() for name, view in model.hf_views()}
    ptr = model.layers[0].qkv.weight.data_ptr()
    name = model.mc.text_prefix + "layers.0.self_attn.q_proj.weight"
    q = torch.randn(model.hf_view(name).shape)
    assert buffers.commit(model, _stage(buffers, model, {name: q})) == q.numel() * 4
    assert model.layers[0].qkv.weight.data_ptr() == ptr  # copied into, not swapped
    _assert_live(model, {**before, name: q})


def test_discarded_stage_leaves_the_live_weights(folder):
    model, buffers = _model(folder), WeightBuffers()
    before = {name: view.clone() for name, view in model.hf_views()}
    _stage(buffers, model, _new_values(model, 5))  # staged, then never committed
    _assert_live(model, before)
    new = _new_values(model, 6)
    buffers.commit(model, _stage(buffers, model, new))
    _assert_live(model, new)


def test_tied_head_copy_is_checked_and_dropped(tmp_path):
    build_model("qwen2", tmp_path)
    model, buffers = _model(str(tmp_path)), WeightBuffers()
    new = _new_values(model, 7)
    embed = new[model.embed_name]
    with pytest.raises(Exception, match="lm_head.weight differs"):
        _stage(buffers, model, {**new, "lm_head.weight": embed + 1})
    assert buffers.commit(model, _stage(buffers, model, {**new, "lm_head.weight": embed})) == 0
    _assert_live(model, new)
    assert model.lm_head.weight is model.embed  # still tied, to the new storage


def test_moe_experts_by_their_fused_names(tmp_path):
    build_model("qwen3_moe", tmp_path)
    model, buffers = _model(str(tmp_path)), WeightBuffers()
    new = _new_values(model, 8)
    fused = {}
    for i, layer in enumerate(model.layers):
        if layer.moe is None:
            continue
        p = f"model.layers.{i}.mlp."
        E, I, H = layer.moe.cfg.num_experts, layer.moe.cfg.intermediate_size, model.mc.hidden_size
        fused[p + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([new.pop(p + f"experts.{e}.gate_proj.weight"), new.pop(p + f"experts.{e}.up_proj.weight")])
             for e in range(E)])
        fused[p + "experts.down_proj"] = torch.stack([new.pop(p + f"experts.{e}.down_proj.weight")
                                                      for e in range(E)])
        assert fused[p + "experts.gate_up_proj"].shape == (E, 2 * I, H)
    assert fused, "the model has MoE layers"
    assert buffers.commit(model, _stage(buffers, model, {**new, **fused})) == 0
    for name, t in fused.items():
        torch.testing.assert_close(model.hf_view(name), t, rtol=0, atol=0)
    _assert_live(model, new)


# ---- the spare lent to a trainer on the same machine (shared memory) --------------------------
def _push_through_lease(buffers: WeightBuffers, model: LlamaModel, tensors: dict, holder: str = "trainer"):
    from weight_sync import SpareWriter

    writer = SpareWriter()
    try:
        handles = writer.write(buffers.lease(model, holder), tensors.items())
    finally:
        writer.close()
    assert handles is not None and handles["kind"] == "spare"
    return buffers.commit(model, buffers.leased(model, handles))


def _segment_names() -> set[str]:
    import os

    from engine.worker.weight_buffers import SEGMENT_PREFIX, SHM_DIR

    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")}


def test_leased_spare_takes_a_trainers_writes_and_alternates_two_segments(folder):
    model, buffers = _model(folder), WeightBuffers()
    qkv = model.layers[0].qkv.weight
    homes = []
    for seed in (1, 2, 3, 4):
        new = _new_values(model, seed)
        assert _push_through_lease(buffers, model, new) == 0  # written by the trainer, swapped in
        _assert_live(model, new)
        homes.append(buffers._segments.index_of(qkv))
    assert homes == [0, 1, 0, 1]  # live and spare take turns between the two segments
    assert len(_segment_names()) == 2
    new = _new_values(model, 9)  # a push by any other route still stages in the spare
    assert buffers.commit(model, _stage(buffers, model, new)) == 0
    _assert_live(model, new)
    buffers.release()  # (sleep) the names go; the live weights stay readable where they are
    assert not _segment_names()
    _assert_live(model, new)


def test_leased_partial_push_copies_what_it_moves(folder):
    model, buffers = _model(folder), WeightBuffers()
    before = {name: view.clone() for name, view in model.hf_views()}
    name = model.mc.text_prefix + "layers.0.self_attn.q_proj.weight"
    q = torch.randn(model.hf_view(name).shape)
    assert _push_through_lease(buffers, model, {name: q}) == q.numel() * 4
    _assert_live(model, {**before, name: q})
    buffers.release()


def test_a_lease_is_one_trainers_at_a_time(folder, monkeypatch):
    import engine.worker.weight_buffers as wb
    from engine.errors import EngineStateError, InvalidRequestError

    model, buffers = _model(folder), WeightBuffers()
    first = buffers.lease(model, "a")
    with pytest.raises(EngineStateError, match="another trainer holds the weight spare"):
        buffers.lease(model, "b")
    # meanwhile another route's update stages in fresh memory, never in the leased spare
    name = model.mc.text_prefix + "layers.0.self_attn.q_proj.weight"
    spare_ptr = buffers._spare_of(model, model.hf_view(name)).data_ptr()
    assert buffers.dest(model, name).data_ptr() != spare_ptr
    monkeypatch.setattr(wb, "LEASE_TTL_S", 0.0)  # "a" is taken to be gone: "b" takes the spare over
    second = buffers.lease(model, "b")
    with pytest.raises(InvalidRequestError, match="lease is not current"):
        buffers.leased(model, {"kind": "spare", "lease": first["lease"], "tensors": [name]})
    with pytest.raises(InvalidRequestError, match="lease is not current"):  # the refusal ended b's lease too
        buffers.leased(model, {"kind": "spare", "lease": second["lease"], "tensors": [name]})
    third = buffers.lease(model, "b")
    with pytest.raises(InvalidRequestError, match="no tensor"):
        buffers.leased(model, {"kind": "spare", "lease": third["lease"], "tensors": ["model.nope.weight"]})
    buffers.release()


def test_the_writer_writes_nothing_a_lease_has_no_place_for(tmp_path):
    from weight_sync import SpareWriter

    build_model("qwen2", tmp_path)  # tied embeddings
    model, buffers = _model(str(tmp_path)), WeightBuffers()
    lease, writer = buffers.lease(model, "t"), SpareWriter()
    new = _new_values(model, 3)
    embed, q = model.embed_name, model.mc.text_prefix + "layers.0.self_attn.q_proj.weight"
    assert writer.write(lease, {**new, "lm_head.weight": new[embed] + 1}.items()) is None  # a differing tied head
    assert writer.write(lease, {**new, "model.nope.weight": new[q]}.items()) is None
    assert writer.write(lease, {**new, q: new[q][:-1]}.items()) is None  # a wrong shape
    assert writer.write(lease, new.items(), dtype=torch.bfloat16) is None  # another dtype than the engine's
    assert writer.write(lease, [*new.items(), (q, new[q])]) is None  # a name twice
    assert writer.write(lease, {**new, q: new[q].long()}.items()) is None  # not floating point
    handles = writer.write(lease, {**new, "lm_head.weight": new[embed]}.items())  # the equal tied copy is dropped
    writer.close()
    assert "lm_head.weight" not in handles["tensors"]
    assert buffers.commit(model, buffers.leased(model, handles)) == 0
    _assert_live(model, new)
    assert model.lm_head.weight is model.embed
    buffers.release()


def test_a_dead_workers_segments_are_removed(folder):
    import os
    import subprocess

    from engine.worker.weight_buffers import SEGMENT_PREFIX, SHM_DIR

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{dead.pid}-feed-0")
    open(stale, "wb").close()
    model, buffers = _model(folder), WeightBuffers()
    buffers.lease(model, "t")
    assert not os.path.exists(stale)
    buffers.release()


def test_a_stopped_engine_core_leaves_no_segment(tmp_path):
    """The engine-core process exits by os._exit when the frontend stops it (no finalizer runs):
    its segments' names must still go, or tmpfs keeps their memory."""
    import os

    from engine import LLM
    from engine.default_model import default_model_path
    from engine.worker.weight_buffers import SHM_DIR

    build_model("llama3", tmp_path)
    llm = LLM(model=str(tmp_path), tokenizer=str(default_model_path()), dtype="float32",
              kv_cache_memory=16 << 20)
    try:
        names = llm.lease_weight_spare("t")["segments"]
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    finally:
        llm.shutdown()
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)


# ---- the trainer packs into the leased panels ---------------------------------------------------
def _packed_model(folder: str, dtype: torch.dtype) -> LlamaModel:
    from kernels import cpu_ext

    model = LlamaModel(ModelConfig.from_folder(folder), dtype, torch.device("cpu"), 256)
    model.load_weights(folder)
    if cpu_ext.ops_for(model.device, dtype) is None or not any(lin.panels_serve() for lin in model._linears()):
        pytest.skip("no panels that serve every step here (the C++ kernels, or a CPU without their paths)")
    return model


def _packed_push(buffers: WeightBuffers, model: LlamaModel, tensors: dict) -> tuple[int, dict]:
    from weight_sync import SpareWriter

    writer = SpareWriter()
    try:
        assert writer.layouts, "the kernels this process loaded are built: the writer can run their packs"
        lease = buffers.lease(model, "trainer", tuple(writer.layouts))
        handles = writer.write(lease, tensors.items())
    finally:
        writer.close()
    assert handles is not None
    return buffers.commit(model, buffers.leased(model, handles)), lease


def _assert_panels_pack(model: LlamaModel, tensors: dict) -> None:
    """Every projection whose panels were written holds the engine's own pack of these tensors
    (checked before anything brings its plain weight up to date)."""
    from kernels import cpu_ext

    ext = cpu_ext.load()
    for lin in model._behind.values():
        names = sorted((start, n) for n, (tensor, start, _, _) in model._hf.items()
                       if tensor is lin.weight or tensor._base is lin.weight)
        weight = torch.cat([tensors[n].to(model.dtype) for _, n in names])
        assert torch.equal(lin.panels, getattr(ext, lin.pack_fn)(weight, None)), names
    assert model._behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trainer_packs_its_tensors_into_the_leased_panels(folder, dtype):
    """Where the projections' panels alone serve the matmuls, the lease hands them out and the
    trainer packs into them: the update swaps panels and repacks nothing; the plain weights follow
    only when read, and then equal what was pushed (cast from float32 in the writer for bf16)."""
    model, buffers = _packed_model(folder, dtype), WeightBuffers()
    qkv = model.layers[0].qkv
    for seed in (1, 2, 3):
        new = {n: t.to(dtype) if seed == 2 else t for n, t in _new_values(model, seed).items()}  # (2: no cast)
        copied, lease = _packed_push(buffers, model, new)
        assert copied == 0
        assert {e["pack"] for e in lease["tensors"] if "pack" in e} == {qkv.pack_fn}
        assert id(qkv) in model._behind  # not unpacked yet
        _assert_panels_pack(model, new)
        _assert_live(model, {n: t.to(dtype) for n, t in new.items()})  # (reads: every plain weight catches up)
        assert not model._behind
    buffers.release()


def test_packed_pushes_mix_with_partial_and_plain_ones(folder):
    """A partial packed push copies the panels of what it moves; a plain push after packed ones
    (gloo, a checkpoint) lands whole, never overwritten by the older panels it replaces; sleep's
    drop of the packed copies first brings the plain weights up to date."""
    model, buffers = _packed_model(folder, torch.float32), WeightBuffers()
    q = model.mc.text_prefix + "layers.0.self_attn.q_proj.weight"
    first = _new_values(model, 1)
    assert _packed_push(buffers, model, first)[0] == 0
    new_q = torch.randn(model.hf_view(q, current=False).shape)
    assert _packed_push(buffers, model, {q: new_q})[0] == new_q.numel() * 4  # its panels, no padding
    _assert_live(model, {**first, q: new_q})
    assert _packed_push(buffers, model, _new_values(model, 2))[0] == 0  # behind again ...
    plain = _new_values(model, 3)  # ... then a plain full push: staged in the plain spare, swapped, repacked
    assert buffers.commit(model, _stage(buffers, model, plain)) == 0
    assert not model._behind
    _assert_live(model, plain)
    some = {n: t for n, t in _new_values(model, 4).items()
            if n.endswith(("1.self_attn.q_proj.weight", "1.mlp.gate_proj.weight"))}
    assert _packed_push(buffers, model, _new_values(model, 5))[0] == 0
    assert buffers.commit(model, _stage(buffers, model, some)) > 0  # a partial plain push: caught up, then copied
    _assert_live(model, {**_new_values(model, 5), **some})
    fifth = _new_values(model, 6)
    assert _packed_push(buffers, model, fifth)[0] == 0
    model.drop_packed()  # (sleep level 1) ...
    assert not model._behind
    for name, t in fifth.items():
        assert torch.equal(model.hf_view(name, current=False), t), name
    model.repack()  # ... and wake
    _assert_live(model, fifth)
    buffers.release()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [None, 1000])  # (1000: the embedding's last panel is padded)
def test_a_tied_embedding_is_pushed_as_the_heads_panels(tmp_path, monkeypatch, dtype, vocab):
    """A tied model's embedding is leased as the LM head's panels: the trainer packs it once (no
    plain copy), the update repacks nothing, and until the plain weights are read the model takes
    the embedding's rows out of the panels; a forward then equals one after the catch-up."""
    from engine.model.decoder import Linear

    build_model("qwen2", tmp_path, **({} if vocab is None else {"vocab_size": vocab}))
    model, buffers = _packed_model(str(tmp_path), dtype), WeightBuffers()
    head = model.lm_head
    assert model.ties_head and head.weight is model.embed and head.panels_serve()
    repacked = []
    pack = Linear.pack
    monkeypatch.setattr(Linear, "pack", lambda self, *a: (repacked.append(self), pack(self, *a))[1])
    new = _new_values(model, 11)
    new["lm_head.weight"] = new[model.embed_name]  # (a trainer's state_dict holds both: checked, dropped)
    copied, lease = _packed_push(buffers, model, new)
    assert copied == 0 and not repacked  # nothing copied, nothing repacked
    entry = next(e for e in lease["tensors"] if e["name"] == model.embed_name)
    assert entry["pack"] == head.pack_fn and entry["packed_shape"] == list(head.panels.shape)
    assert id(head) in model._behind
    embed = new[model.embed_name].to(dtype)
    ids = torch.tensor([0, 1, 31, 32, 33, model.embed.shape[0] - 1, 5, 5])
    assert torch.equal(model._embed_rows(ids), embed[ids])  # read off the panels
    assert id(head) in model._behind  # (reading rows catches nothing up)
    _assert_panels_pack(model, {k: v for k, v in new.items() if k != "lm_head.weight"})
    x = torch.randn(4, model.embed.shape[1], dtype=dtype)
    before = (model._embed_rows(ids), head(x))
    model._catch_up()  # (what any read of the plain weights does)
    assert not model._behind and torch.equal(model.embed, embed)
    assert torch.equal(before[0], F.embedding(ids, model.embed)) and torch.equal(before[1], head(x))
    buffers.release()


def _received_push(buffers: WeightBuffers, model: LlamaModel, tensors: dict, bucket_bytes: int) -> dict:
    """`tensors` pushed over a real gloo group (the trainer on a thread) and staged as the worker
    stages a broadcast: received into the spare, packed where a linear's panels serve."""
    import threading

    from weight_sync import WeightReceiver, WeightSender, WeightTransferGroup, find_free_port

    port = find_free_port()

    def trainer():
        with WeightTransferGroup("127.0.0.1", port, 0, 2, timeout_s=30) as group:
            WeightSender(group, bucket_bytes=bucket_bytes).send(tensors.items())

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        with WeightTransferGroup("127.0.0.1", port, 1, 2, timeout_s=30) as group:
            staged = WeightReceiver(group).receive(model.accepted_weights(), into=lambda n: buffers.dest(model, n),
                                                   write=lambda n, t: buffers.write(model, n, t))
    finally:
        thread.join(timeout=30)
    model.untie_pushed(staged)
    model.split_fused_experts(staged)
    return staged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_a_received_update_is_packed_as_it_arrives(tmp_path, monkeypatch, dtype, tied):
    """An update the engine receives (gloo here; a checkpoint or tensors alike) is packed into the
    spare of the projections' panels straight from the receiver's buffers, large tensors from
    where their pieces landed: the update swaps the panels and repacks nothing, and the plain
    weights follow only when read, equal to what was pushed. A tied model's pushed lm_head copy
    is checked against the embedding staged as the head's panels: equal passes, different is
    refused."""
    from engine.errors import InvalidRequestError
    from engine.model.decoder import Linear

    build_model("qwen2" if tied else "qwen3", tmp_path)
    model, buffers = _packed_model(str(tmp_path), dtype), WeightBuffers()
    assert model.ties_head == tied
    repacked = []
    pack = Linear.pack
    monkeypatch.setattr(Linear, "pack", lambda self, *a: (repacked.append(self), pack(self, *a))[1])
    for seed in (1, 2):
        new = {n: t.to(dtype) for n, t in _new_values(model, seed).items()}
        if tied:
            new["lm_head.weight"] = new[model.embed_name].clone()  # (a trainer's state_dict holds both)
        bucket = min(t.numel() * t.element_size() for n, t in new.items() if "embed" in n) // 3  # (pieces)
        staged = _received_push(buffers, model, new, bucket)
        assert buffers.commit(model, staged) == 0 and not repacked  # nothing copied, nothing repacked
        assert model._behind
        if tied:
            del new["lm_head.weight"]
        _assert_panels_pack(model, new)
        _assert_live(model, new)
        assert not model._behind
    if tied:
        bad = {n: t.to(dtype) for n, t in _new_values(model, 3).items()}
        bad["lm_head.weight"] = bad[model.embed_name] + 1
        with pytest.raises(InvalidRequestError, match="lm_head.weight differs"):
            _received_push(buffers, model, bad, 1 << 20)
        _assert_live(model, new)  # (the refused update never went live)
    buffers.release()


def test_float32_tensors_are_cast_as_they_are_packed_for_a_bf16_model(folder):
    """A float32 checkpoint (or tensors) staged into a bf16 engine: each projection's tensor is
    cast on its way into the panels' spare, rounded as torch rounds; the rest is copied (cast) into
    the plain spare. Nothing is repacked; the live weights then equal the pushed ones in bf16."""
    model, buffers = _packed_model(folder, torch.bfloat16), WeightBuffers()
    new = _new_values(model, 21)  # (float32)
    staged = {}
    for name, t in new.items():
        packed = buffers.write(model, name, t)
        staged[name] = packed if packed is not None else buffers.dest(model, name).copy_(t)
    assert any(staged[n].shape != t.shape for n, t in new.items())  # (some went into panels)
    model.untie_pushed(staged)
    model.split_fused_experts(staged)
    assert buffers.commit(model, staged) == 0 and model._behind
    _assert_panels_pack(model, new)
    _assert_live(model, {n: t.to(torch.bfloat16) for n, t in new.items()})
    buffers.release()


@pytest.mark.parametrize("pack_fn", ["bf16_vnni_pack", "f32_panel_pack", "bf16_panel_pack"])
@pytest.mark.parametrize("n, k", [(64, 96), (45, 33)])  # (ragged: a padded panel, an odd k)
def test_unpack_inverts_every_pack(pack_fn, n, k):
    """Linear.unpack reads the plain weight back out of each of the kernels' layouts exactly
    (bf16_panel_pack interleaves a panel's rows; the others are plain transposes)."""
    from engine.model.decoder import Linear
    from kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None or pack_fn != "bf16_vnni_pack" and not ext.f32_panel_supported():
        pytest.skip("the C++ kernels' panels are not built here")
    dtype = torch.float32 if pack_fn == "f32_panel_pack" else torch.bfloat16
    lin = Linear(n, k, False, dtype, torch.device("cpu"))
    w = torch.randn(n, k).to(dtype)
    lin.panels, lin.pack_fn = getattr(ext, pack_fn)(w, None), pack_fn
    ids = torch.tensor([0, n - 1, 31 % n, n // 2, 0])
    assert torch.equal(lin.rows(ids), w[ids])  # (a tied embedding read off the panels)
    lin.unpack()
    assert torch.equal(lin.weight, w)
