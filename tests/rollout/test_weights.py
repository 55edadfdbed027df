"""Weight pushes end to end: this test process is the trainer (rank 0 of a gloo group), the
server's engine worker rank 1. A push of changed tensors changes the engine's checksum to
exactly what the trainer computes, labels the new tokens with the new version, and pushing the
originals back restores the original output; vLLM's four phases driven by hand work too."""
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout.client import AsyncRolloutClient, RolloutAPIError, RolloutClient
from tests.rollout.conftest import ADMIN_KEY, API_KEY
from kernels import cpu_ext
from weight_sync import SpareWriter, WeightSender, weights_checksum

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def original(model_path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_path) / "model.safetensors"))


@pytest.fixture(scope="module")
def transfer(client):
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=60)
    yield client
    client.close_weight_transfer()


def test_push_changes_weights_checksum_and_version(transfer, original):
    client = transfer
    assert client.weights_checksum() == weights_checksum(original.items(), torch.float32)
    before = client.generate(PROMPT, GREEDY)[0]
    changed = {"model.norm.weight": original["model.norm.weight"] * 0.5,
               "model.layers.0.mlp.down_proj.weight": original["model.layers.0.mlp.down_proj.weight"].flip(0)}
    version = client.weight_version() + 1
    result = client.push_weights(changed.items(), version=version)
    assert result["weight_version"] == version and result["send"]["num_tensors"] == 2
    assert client.weights_checksum() == weights_checksum({**original, **changed}.items(), torch.float32)
    after = client.generate(PROMPT, GREEDY)[0]
    assert set(after.weight_versions) == {version}
    assert after.token_ids != before.token_ids
    # push the originals back (default version: previous + 1): the output is the original one
    result = client.push_weights([(n, original[n]) for n in changed])
    assert result["weight_version"] == version + 1
    assert client.weights_checksum() == weights_checksum(original.items(), torch.float32)
    assert client.generate(PROMPT, GREEDY)[0].token_ids == before.token_ids


def test_two_pushes_at_once_over_one_group_land_whole_in_turn(transfer, original):
    """Two threads push over one client's group at the same moment (same names and shapes,
    different values): the server takes one update at a time, so the client must send one at a
    time too, or an update could receive the other push's bytes under its own version. The
    push answered with the higher version is the one live."""
    client = transfer
    names = ("model.norm.weight", "model.layers.1.mlp.up_proj.weight")
    states = [{n: original[n] * s for n in names} for s in (0.5, 2.0)]
    base = client.weight_version()
    go = threading.Barrier(2)

    def push(i: int) -> dict:
        go.wait(60)
        return client.push_weights(states[i].items())

    for _ in range(3):
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(push, (0, 1), timeout=300))
        versions = [r["weight_version"] for r in results]
        assert sorted(versions) == [base + 1, base + 2]
        last = states[versions.index(base + 2)]
        assert client.weights_checksum() == weights_checksum({**original, **last}.items(), torch.float32)
        base += 2
    client.push_weights([(n, original[n]) for n in names])
    assert client.weights_checksum() == weights_checksum(original.items(), torch.float32)

    async def both_at_once():  # the asyncio client: two tasks
        async with AsyncRolloutClient(client.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
            await c.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=60)
            try:
                return await asyncio.gather(*(c.push_weights(state.items()) for state in states))
            finally:
                await c.close_weight_transfer()

    base = client.weight_version()
    versions = [r["weight_version"] for r in asyncio.run(both_at_once())]
    assert sorted(versions) == [base + 1, base + 2]
    last = states[versions.index(base + 2)]
    assert client.weights_checksum() == weights_checksum({**original, **last}.items(), torch.float32)
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=60)  # (the fixture's)
    client.push_weights([(n, original[n]) for n in names])
    assert client.weights_checksum() == weights_checksum(original.items(), torch.float32)


def test_the_default_push_loses_no_work(transfer, original):
    """push_weights pauses in mode "keep" by default: a request in flight is neither truncated
    nor aborted; its tokens after the push carry the new version; the result counts it."""
    client = transfer
    old_version = client.weight_version()
    box, started = {}, threading.Event()

    def stream():
        deltas = []
        for _, ds in client.generate_stream(PROMPT, dict(GREEDY, max_tokens=120)):
            deltas.extend(ds)
            started.set()
        box["deltas"] = deltas

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(120)
    result = client.push_weights([("model.norm.weight", original["model.norm.weight"])])
    t.join(120)
    assert result["aborted"] == 0 and result["kept"] == 1, result
    deltas = box["deltas"]
    assert deltas[-1].finish_reason == "length"
    versions = [v for d in deltas for v in d.weight_versions]
    assert len(versions) == 120 and versions[0] == old_version and versions[-1] == result["weight_version"]
    assert versions == sorted(versions)


def test_generation_goes_on_while_the_push_arrives(transfer, original):
    """The server receives a push beside its steps and pauses only for the swap: while the
    trainer's bytes are late, a streaming request keeps getting tokens (the old version's); the
    answer's phases run receive, stage, pause, swap, and generation stood still for less than
    the receive took. A trainer that pauses first (POST /pause) gets nothing generated while it
    pushes, and its pause stays."""
    client = transfer
    named = [("model.norm.weight", original["model.norm.weight"])]
    info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[576]], "packed": True}
    for paused_first in (False, True):
        version = client.weight_version()
        box, started = {"deltas": []}, threading.Event()

        def stream():
            for _, ds in client.generate_stream(PROMPT, dict(GREEDY, max_tokens=480)):
                box["deltas"].extend(ds)
                started.set()

        streaming = threading.Thread(target=stream, daemon=True)
        streaming.start()
        assert started.wait(120)
        if paused_first:
            client.pause(mode="keep")
        posting = threading.Thread(target=lambda: box.update(result=client.weights_update("gloo", update_info=info)))
        posting.start()
        time.sleep(0.5)  # (the update is under way: its receive waits for the trainer's bytes)
        n0 = sum(len(d.token_ids) for d in box["deltas"])
        time.sleep(1.0)
        n1 = sum(len(d.token_ids) for d in box["deltas"])
        WeightSender(client.weights.group).send(named, dtype=torch.float32)
        posting.join(120)
        result = box["result"]
        assert result["weight_version"] == version + 1
        if paused_first:
            assert n1 == n0, "generation went on under the trainer's own pause"
            assert result["paused_here"] is False and client.is_paused()
            client.resume()
        else:
            assert n1 - n0 >= 5, f"generation stood still while the push arrived ({n0} -> {n1} tokens)"
            assert result["paused_here"] is True and result["kept"] == 1 and not client.is_paused()
            assert list(result["phases"]) == ["queue", "receive", "stage", "pause", "swap", "clear_cache", "resume"]
            assert result["paused_seconds"] < result["phases"]["receive"], result
        streaming.join(300)
        versions = [v for d in box["deltas"] for v in d.weight_versions]
        k = versions.count(version)
        assert len(versions) == 480 and versions == [version] * k + [version + 1] * (480 - k) and k >= n1
    assert client.weights_checksum() == weights_checksum(original.items(), torch.float32)


def test_refused_push_leaves_weights_whole(transfer, original):
    client = transfer
    good = client.weights_checksum()
    bad = [("model.norm.weight", torch.zeros(3))]  # wrong shape: the receiver refuses
    with pytest.raises(RolloutAPIError) as e:
        client.push_weights(bad)
    assert e.value.status == 400 and "shape" in e.value.message
    assert client.weights_checksum() == good
    assert not client.is_paused()  # resumed even though the push failed
    version = client.weight_version()  # the group is still usable
    client.push_weights([("model.norm.weight", original["model.norm.weight"])])
    assert client.weight_version() == version + 1 and client.weights_checksum() == good


def test_vllm_four_phases_by_hand(transfer, original):
    """What a trainer written against vLLM's HTTP API does: pause, start, update_weights (its
    update_info) concurrently with the broadcast, finish(weight_version), resume."""
    client = transfer
    named = [("model.norm.weight", original["model.norm.weight"])]
    client.pause()
    client.start_weight_update(is_checkpoint_format=True)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=client.update_weights(
        {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[576]], "packed": True})))
    t.start()
    WeightSender(client.weights.group).send(named, dtype=torch.float32)
    t.join(60)
    assert "weight_version" in box["r"]
    with pytest.raises(RolloutAPIError) as e:  # not a version this engine can take
        client.finish_weight_update("latest")
    assert e.value.status == 400 and e.value.param == "weight_version"
    client.finish_weight_update(box["r"]["weight_version"])
    client.resume()
    assert client.weight_version() == box["r"]["weight_version"]


def test_chunked_update_is_one_version(transfer, original):
    client = transfer
    good = client.weights_checksum()
    version = client.weight_version() + 3
    with client.weight_update(version=version) as update:  # paused throughout, one version at the end
        update.send([("model.norm.weight", original["model.norm.weight"])])
        update.send([("model.layers.1.mlp.up_proj.weight", original["model.layers.1.mlp.up_proj.weight"])])
        assert client.is_paused()
    assert update.num_sends == 2 and update.weight_version == version == client.weight_version()
    assert not client.is_paused() and client.weights_checksum() == good


@pytest.mark.parametrize("local", [False, True])
def test_async_client_push(server, original, local):
    import asyncio

    from rollout.client import AsyncRolloutClient
    from tests.rollout.conftest import ADMIN_KEY, API_KEY

    async def main():
        async with AsyncRolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
            await c.init_weight_transfer(backend="gloo", shared_memory_when_local=local, timeout_s=60)
            version = await c.weight_version() + 1
            result = await c.push_weights([("model.norm.weight", original["model.norm.weight"])])
            assert result["weight_version"] == version and result["transport"] == ("spare" if local else "group")
            [out] = await c.generate(PROMPT, GREEDY)
            assert set(out.weight_versions) == {version}
            assert await c.weights_checksum() == weights_checksum(original.items(), torch.float32)

    asyncio.run(main())


def test_push_weights_shared_from_this_machine(client, original):
    """/update_weights_from_ipc through the client: shared memory, no transfer group; a bad
    share is a 400 that leaves the weights whole."""
    good = client.weights_checksum()
    with pytest.raises(RolloutAPIError) as e:
        client.push_weights_shared([("model.norm.weight", torch.zeros(3))])
    assert e.value.status == 400 and "shape" in e.value.message
    with pytest.raises(RolloutAPIError) as e:
        client.update_weights_from_ipc({"kind": "shm", "shm": "no-such-segment", "tensors": []})
    assert e.value.status == 400 and "segment" in e.value.message
    assert client.weights_checksum() == good and not client.is_paused()
    changed = {"model.norm.weight": original["model.norm.weight"] * 0.5}
    version = client.weight_version() + 1
    result = client.push_weights_shared(changed.items(), version=version)
    assert result["weight_version"] == version and result["shared_via"] == "spare"  # written into the server's spare
    assert client.weights_checksum() == weights_checksum({**original, **changed}.items(), torch.float32)
    assert set(client.generate(PROMPT, GREEDY)[0].weight_versions) == {version}
    client.push_weights_shared([("model.norm.weight", original["model.norm.weight"])])
    assert client.weights_checksum() == good


def test_concurrent_shared_pushes_on_one_client_do_not_share_a_segment(client, original):
    """The client reuses its shared-memory segment push after push; two pushes at once from one
    client must not both write it (the server reads one while the other refills it): each
    lands whole, and the live weights are those of the push that went live last."""
    good = client.weights_checksum()
    states = [{"model.norm.weight": original["model.norm.weight"] * s} for s in (0.5, 2.0)]
    go = threading.Barrier(2)

    def push(state: dict) -> int:
        go.wait(60)
        return client.push_weights_shared(state.items())

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(push, states, timeout=300))
    versions = [r["weight_version"] for r in results]
    assert "spare" in {r["shared_via"] for r in results}
    last = states[versions.index(max(versions))]
    assert client.weights_checksum() == weights_checksum({**original, **last}.items(), torch.float32)
    client.push_weights_shared([("model.norm.weight", original["model.norm.weight"])])
    assert client.weights_checksum() == good


def test_two_trainers_pushing_at_once_both_land(server, client, original):
    """Two clients (two lease holders) push through shared memory at the same moment: whichever
    holds the spare writes into it, the other is refused it and shares a segment of its own (or
    leases it once the first update took it); neither push is lost or mixed with the other."""
    good = client.weights_checksum()
    states = [{"model.norm.weight": original["model.norm.weight"] * s} for s in (0.25, 4.0)]
    go = threading.Barrier(2)

    def push(state: dict) -> dict:
        with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
            go.wait(60)
            return c.push_weights_shared(state.items())

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(push, states, timeout=300))
    versions = [r["weight_version"] for r in results]
    assert len(set(versions)) == 2 and "spare" in {r["shared_via"] for r in results}
    last = states[versions.index(max(versions))]
    assert client.weights_checksum() == weights_checksum({**original, **last}.items(), torch.float32)
    client.push_weights_shared([("model.norm.weight", original["model.norm.weight"])])
    assert client.weights_checksum() == good


def test_the_spare_is_lent_to_one_trainer_at_a_time(client, original):
    """POST /weights/spare: a second trainer is refused (409) while the first holds the lease,
    and its push_weights_shared goes through a segment of its own instead; the first trainer's
    retry leases again. A lease nobody used changes nothing."""
    good = client.weights_checksum()
    lease = client.lease_weight_spare("another-trainer")
    assert lease["segments"] and {"name", "dtype", "shape", "stride", "segment", "offset"} <= set(lease["tensors"][0])
    assert lease["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    with pytest.raises(RolloutAPIError) as e:
        client.lease_weight_spare(client.weights.holder)
    assert e.value.status == 409 and "another trainer" in e.value.message
    again = client.lease_weight_spare("another-trainer")
    assert again["lease"] != lease["lease"]
    result = client.push_weights_shared([("model.norm.weight", original["model.norm.weight"] * 3)])
    assert result["shared_via"] == "segment"
    assert client.weights_checksum() == weights_checksum(
        {**original, "model.norm.weight": original["model.norm.weight"] * 3}.items(), torch.float32)
    client.push_weights_shared([("model.norm.weight", original["model.norm.weight"])])
    assert client.weights_checksum() == good
    with pytest.raises(RolloutAPIError) as e:  # an update of nothing: refused, and it ends the lease
        client.update_weights_from_ipc({"kind": "spare", "lease": again["lease"], "tensors": []})
    assert e.value.status == 400 and client.weights_checksum() == good
    assert client.push_weights_shared([("model.norm.weight", original["model.norm.weight"])])["shared_via"] == "spare"
    ext = cpu_ext.built()  # a lease for a writer that runs the packs: the projections' panels (docs/http-api.md)
    if ext is not None and ext.f32_panel_supported():
        packed = client.lease_weight_spare(client.weights.holder, SpareWriter().layouts)
        entry = next(e for e in packed["tensors"] if e["name"] == "model.layers.0.self_attn.q_proj.weight")
        assert entry["pack"] == "f32_panel_pack" and entry["packed_shape"] == [576 // 32, 576, 32]
        client.push_weights_shared(original.items())  # (packed by the client, and it ends this lease)
        assert client.weights_checksum() == good


def test_push_weights_to_a_server_on_this_machine_goes_through_shared_memory(server, client, original, monkeypatch):
    """push_weights after init_weight_transfer: the server says its engine runs on this
    machine's CPU (`shm_host` is our host key), so the push takes the shared-memory route (the
    server's spare) instead of loopback TCP; a group push from another trainer at the same
    moment lands too. A server whose key differs (another machine, another container's
    /dev/shm) gets the group; so does a trainer that asks for it."""
    import weight_sync

    good = client.weights_checksum()
    assert client.server_info()["shm_host"] == weight_sync.host_key() is not None
    with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as local, \
            RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as grouped:
        local.init_weight_transfer(backend="gloo", timeout_s=60)
        grouped.init_weight_transfer(backend="gloo", timeout_s=60, shared_memory_when_local=False)
        changed = {"model.norm.weight": original["model.norm.weight"] * 0.5,
                   "model.layers.3.self_attn.o_proj.weight": original["model.layers.3.self_attn.o_proj.weight"] * 2}
        version = local.weight_version() + 1
        result = local.push_weights(changed.items(), version=version)
        assert result["transport"] == "spare" and result["send"] is None and result["weight_version"] == version
        assert client.weights_checksum() == weights_checksum({**original, **changed}.items(), torch.float32)
        assert set(client.generate(PROMPT, GREEDY)[0].weight_versions) == {version}

        states = [{"model.norm.weight": original["model.norm.weight"] * s} for s in (0.25, 4.0)]
        go = threading.Barrier(2)

        def push(c, state):
            go.wait(60)
            return c.push_weights(state.items())

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(push, (local, grouped), states, timeout=300))
        assert [r["transport"] for r in results] == ["spare", "group"]
        versions = [r["weight_version"] for r in results]
        assert len(set(versions)) == 2
        last = states[versions.index(max(versions))]
        assert client.weights_checksum() == weights_checksum(
            {**original, **changed, **last}.items(), torch.float32)
        grouped.close_weight_transfer()

        monkeypatch.setattr(weight_sync, "host_key", lambda: "another-machine")
        local.init_weight_transfer(backend="gloo", timeout_s=60)
        result = local.push_weights([(n, original[n]) for n in changed])
        assert result["transport"] == "group" and result["send"]["num_tensors"] == 2
        local.close_weight_transfer()
    assert client.weights_checksum() == good


def test_push_weights_shared_casts_to_the_served_dtype(server, original):
    """A trainer whose tensors are not in the engine's dtype (float64 here, the server serves
    float32; float32 to a bf16 engine alike): cast by default, with the dtype learned from the
    server (a fresh client, no transfer group); an explicit dtype= is what travels."""
    with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
        good = c.weights_checksum()
        wide = {"model.norm.weight": original["model.norm.weight"].double() * 0.5}
        version = c.weight_version() + 1
        assert c.push_weights_shared(wide.items(), version=version)["weight_version"] == version
        assert c.weights_checksum() == weights_checksum({**original, **wide}.items(), torch.float32)
        with pytest.raises(RolloutAPIError) as e:  # float64 as asked: the engine refuses it, nothing changes
            c.push_weights_shared(wide.items(), dtype=torch.float64)
        assert e.value.status == 400 and "float64" in e.value.message
        c.push_weights_shared([("model.norm.weight", original["model.norm.weight"].double())])
        assert c.weights_checksum() == good


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_server_with_one_replica_elsewhere_gets_its_part_over_the_group(tmp_path, default_model_path,
                                                                         monkeypatch, tp):
    """A trainer beside replica 0 of a two-replica server whose replica 1 runs on another machine:
    the group is formed from replica 1's workers alone (with `tp` 2: its two ranks; replica 0's
    two ranks lend a spare each, written with their slices) and each push writes replica 0's spare
    (a segment of ours while another trainer holds that spare) beside the broadcast to replica
    1, one update for both. One machine cannot host a replica elsewhere, so the server's
    `replica_hosts` is rewritten as a two-node Ray cluster's would read (every byte still moves
    for real: shared memory to one replica process, gloo over TCP to the other). A new group
    keeps the spares mapped. Updates in chunks over that group are refused (replica 0 is not in
    it)."""
    import weight_sync
    from tests.rollout.conftest import start_server, stop_server, tiny_model_folder

    folder = tiny_model_folder(tmp_path, default_model_path)
    server = start_server(folder, "--max-model-len", "256", "--data-parallel-size", "2",  # (tp 2: 4 ranks, 2 cores)
                          "--tensor-parallel-size", str(tp), "--max-data-parallel-size", "2")
    here = weight_sync.host_key()
    try:
        with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c, \
                RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as other:
            assert c.server_info()["replica_hosts"] == {"0": here, "1": here}
            real_info = RolloutClient.server_info

            def replica_1_elsewhere(self):
                info = real_info(self)
                return dict(info, shm_host=None, replica_hosts=dict(info["replica_hosts"], **{"1": "another-machine"}))

            monkeypatch.setattr(RolloutClient, "server_info", replica_1_elsewhere)
            state = load_file(str(Path(folder) / "model.safetensors"))
            assert c.init_weight_transfer(backend="gloo", timeout_s=60)["ranks"] == list(range(1, tp + 1))
            for scale, transport in ((0.5, "group+spare"), (0.25, "group+spare"), (2.0, "group+segment")):
                if scale == 0.25:  # a new group keeps the spares mapped (a remap would fault them in again)
                    writers = dict(c.weights.spare)
                    c.init_weight_transfer(backend="gloo", timeout_s=60)
                    assert c.weights.spare == writers and 0 in writers
                if transport == "group+segment":  # another trainer holds replica 0's spare now
                    other.lease_weight_spare("another-trainer", [], replicas=[0])
                pushed = {n: t * scale for n, t in state.items()}
                result = c.push_weights(pushed.items())
                assert result["transport"] == transport and result["send"]["num_tensors"] == len(state)
                # (each replica's checksum: they agree, or this raises)
                assert c.weights_checksum() == weights_checksum(pushed.items(), torch.float32)
                assert set(c.generate(PROMPT, GREEDY)[0].weight_versions) == {result["weight_version"]}
            with pytest.raises(RuntimeError, match="in chunks"):
                with c.weight_update():
                    pass
            c.close_weight_transfer()
            assert c.weights.spare == {}  # (closed: unmapped)
    finally:
        assert stop_server(server) == 0, server.log()


def test_a_ray_server_on_this_machine_takes_pushes_through_shared_memory(tmp_path, default_model_path, monkeypatch):
    """Ray may place replicas on any node, so the server asks its workers for their host keys:
    on a local Ray cluster (two replicas as Ray actors) every worker has this machine's key, the
    server names it (`shm_host`), and push_weights goes through shared memory (each replica's
    leased spare, written one after the other) to both replicas, which then hold the trainer's
    weights. A trainer that sees another key gets the group."""
    import weight_sync
    from tests.rollout.conftest import start_server, stop_server, tiny_model_folder

    folder = tiny_model_folder(tmp_path, default_model_path)
    server = start_server(folder, "--max-model-len", "256", "--data-parallel-size", "2",
                          "--data-parallel-backend", "ray")
    try:
        with RolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as c:
            assert c.server_info()["shm_host"] == weight_sync.host_key() is not None
            state = load_file(str(Path(folder) / "model.safetensors"))
            changed = {n: t * 0.5 for n, t in state.items() if n.endswith("norm.weight")}
            c.init_weight_transfer(backend="gloo", timeout_s=60)
            result = c.push_weights(changed.items())
            assert result["transport"] == "spare" and result["send"] is None
            want = weights_checksum({**state, **changed}.items(), torch.float32)
            assert c.weights_checksum() == want  # (the replicas' checksums agree, or it raises)
            c.close_weight_transfer()

            monkeypatch.setattr(weight_sync, "host_key", lambda: "another-machine")
            c.init_weight_transfer(backend="gloo", timeout_s=60)
            result = c.push_weights(state.items())
            assert result["transport"] == "group" and result["send"]["num_tensors"] == len(state)
            c.close_weight_transfer()
            assert c.weights_checksum() == weights_checksum(state.items(), torch.float32)
    finally:
        assert stop_server(server) == 0, server.log()
