"""Elastic size: growing or shrinking the data-parallel replicas of a running AsyncMPClient.

A new replica copies a live one before it takes requests: its weights (pushed ones included,
over a group of their own: send_weights_to_peers / stage_weights("peer")), its weight version,
its LoRA adapters and its pause state. A removed one takes no new requests, drains, then has
what is left aborted with final outputs. A failure at any point stops every new replica and
leaves the others as they were.
"""
import asyncio
import time

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineStateError, InvalidRequestError
from engine.process.core_proc import HANDSHAKE_TIMEOUT_MS, engine_identity
from engine.process.managers import EngineWatcher, available_memory, check_replica_count
from engine.process.replicas import EngineState
from engine.timeouts import wait_within


def check_room_for(config: EngineConfig, num_new: int, stats: dict) -> None:
    """InvalidRequestError (data_parallel_size) if this machine's free memory cannot hold `num_new`
    more local replicas like the one whose get_stats() is `stats` (its peak RSS plus the whole KV
    cache, whose pages it touches only as they fill)."""
    kv_bytes = stats["num_blocks"] * config.block_size * config.kv_bytes_per_token()
    on_host = 0 if config.device.startswith("cuda") else kv_bytes
    each = int(stats["peak_rss_mb"] * 2**20) + on_host
    free = available_memory()
    if num_new * each > free:
        raise InvalidRequestError(
            f"{num_new} more replica(s) need about {num_new * each / 2**30:.1f} GiB ({each / 2**30:.2f} GiB each: "
            f"a replica's peak RSS and its KV cache); this machine has {free / 2**30:.1f} GiB available",
            "data_parallel_size")


class ElasticScaling:
    """scale_async and its parts, mixed into AsyncMPClient (they use its replicas, manager and
    _call)."""

    async def scale_async(self, size: int, drain_timeout_s: float = 60.0) -> dict:
        """Grow or shrink to `size` live replicas. New ones copy a live replica's weights (pushed
        ones included), LoRA adapters and pause state before they take requests; removed ones (the newest
        first) take no new requests, their requests get `drain_timeout_s` to finish, then are
        aborted with a final output. Dead replicas are dropped (a scale to the same size
        replaces them)."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidRequestError(f"data_parallel_size must be an int >= 1, got {size!r}", "data_parallel_size")
        if isinstance(self.manager, EngineWatcher):
            raise EngineStateError("the engine cores belong to the launcher of several API servers: "
                                   "scaling is not supported there")
        if self.config.enable_expert_parallel and self.config.data_parallel_size > 1:
            raise EngineStateError("the replicas of an expert-parallel engine split the experts between them: "
                                   "scaling them is not supported (start it with another data_parallel_size)")
        check_replica_count(self.config, size)  # before anything starts or stops
        await self._ensure_ready()
        live = sorted(i for i, e in self.engines.items() if e.alive)
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine core is alive")
        state = None
        if size > len(live):
            state = await self._call(self.engines[live[0]], "get_stats", (), {}, None)
            if state["is_sleeping"]:
                raise EngineStateError("the engine is asleep: wake it up before scaling")
            if self.config.data_parallel_backend == "mp":
                check_room_for(self.config, size - len(live), state)
        dropped = [i for i, e in self.engines.items() if not e.alive]
        for i in dropped:
            del self.engines[i]
            self.manager.stop(i)
        added, removed = [], []
        if size > len(live):
            added = await self._scale_up(size - len(live), state)
        elif size < len(live):
            removed = await self._scale_down(live[size:], drain_timeout_s)
        return {"data_parallel_size": len(self.engines), "added": added, "removed": removed + dropped}

    async def _scale_up(self, n: int, state: dict) -> list[int]:
        """Start n replicas, copy `state`'s replica (its get_stats()) into them, then route to them;
        a failure at any point stops every new one and leaves the others as they were."""
        from weight_sync import find_free_port

        source = self.engines[min(self.engines)]
        first = max(self._indices_used) + 1
        new = list(range(first, first + n))  # an index is never reused: identities stay unique
        self._indices_used.update(new)
        taken = {e.rank for e in self.engines.values()}
        ranks = [r for r in range(len(self.engines) + n) if r not in taken][:n]  # the slots the dead left first
        for i, rank in zip(new, ranks):
            self.engines[i] = EngineState(i, engine_identity(i), rank=rank, routable=False)
        try:
            await asyncio.to_thread(self.manager.start, new, ranks)
            await self._await_registrations({engine_identity(i) for i in new})
            host = await self._call(source, "collective_rpc", (), {"method": "node_ip_address"}, None)
            port = find_free_port(host[0])
            tp = self.config.tensor_parallel_size  # every rank of a new replica receives (rank 1 + j * tp + its own)
            world = 1 + n * tp
            copies = [self._call(self.engines[i], "stage_weights", (),
                                {"source": "peer", "args": [host[0], port, world, 1 + j * tp]}, None)
                      for j, i in enumerate(new)]
            await asyncio.gather(self._call(source, "send_weights_to_peers", (),
                                                 {"master_address": host[0], "master_port": port, "world_size": world},
                                                 None),
                                 *copies)
            loras = await self._call(source, "export_loras", (), {}, None)
            for i in new:
                await self._call(self.engines[i], "commit_weights", (), {"version": state["weight_version"]}, None)
                if loras:  # the adapters too, pushed ones with their tensors
                    await self._call(self.engines[i], "import_loras", (), {"loras": loras}, None)
                if state["is_paused"]:  # held (abort / wait) or frozen (keep) like the others
                    mode = "keep" if state["pause_state"] == "paused_all" else "abort"
                    await self._call(self.engines[i], "pause_generation", (),
                                     {"mode": mode, "clear_cache": False}, None)
        except BaseException:
            for i in new:
                self.engines.pop(i, None)
                self.manager.stop(i)
            raise
        for i in new:
            self.engines[i].routable = True
        return new

    def cancel_scale(self) -> None:
        """Make a scale-up that is starting engines fail now (they are stopped; the others serve on)."""
        if not isinstance(self.manager, EngineWatcher):
            self.manager.cancel_start()

    async def _await_registrations(self, identities: set[bytes], timeout_s: float = HANDSHAKE_TIMEOUT_MS / 1000):
        """New engines' DEALERs announce themselves on our ROUTER (nothing else arrives there)."""
        deadline = time.monotonic() + timeout_s
        while identities:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"new engine cores did not connect: {sorted(identities)}")
            frames = await wait_within(self.input_socket.recv_multipart(), left)
            identities.discard(frames[0])

    async def _scale_down(self, victims: list[int], drain_timeout_s: float) -> list[int]:
        for i in victims:
            self.engines[i].routable = False
        deadline = time.monotonic() + drain_timeout_s
        while any(self.engines[i].num_in_flight for i in victims) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = [rid for rid, e in self.owner.items() if e.index in victims]
        if left:  # past the deadline: their callers get a final output ("abort"), not silence
            await self.abort_requests_async(left)
            until = time.monotonic() + 10
            while any(self.engines[i].num_in_flight for i in victims) and time.monotonic() < until:
                await asyncio.sleep(0.05)
        for i in victims:
            del self.engines[i]
            self.manager.stop(i)
        return victims
