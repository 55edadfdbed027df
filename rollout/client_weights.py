"""The trainer's side of a weight push, mixed into RolloutClient / AsyncRolloutClient.

The trainer is rank 0 of a `weight_sync.WeightTransferGroup`; the engine's workers are ranks
1..N. Forming the group blocks until every rank joined, so the trainer's side and the server's
/init_weight_transfer_engine run concurrently; likewise each push's `WeightSender.send` runs
concurrently with the server's /update_weights (which receives it). If the HTTP side fails first
(e.g. 409: requests running) and the sender is still blocked a few seconds later, the group is
aborted so the sender fails now instead of at its timeout; the group is broken then: call
init_weight_transfer() again. A push the engine refuses (names, shapes, dtypes) leaves the group
usable.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any, Iterable, Optional

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
ABORT_AFTER_S = 5.0  # after the server failed an update, how long the sender may take to notice


def _update_info(named: list, dtype, version: Optional[int]) -> dict:
    def dname(t):
        d = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return str(d).removeprefix("torch.")

    return {"names": [n for n, _ in named], "dtype_names": [dname(t) for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "packed": True, "weight_version": version}


def log_push(wandb_run: Any, source: str, seconds: float, num_bytes: Optional[int], version: Optional[int]) -> None:
    """Log one push to the trainer's W&B run (`True`: the current `wandb.run`). commit=False: the
    values join the trainer's next `log` call instead of advancing its step."""
    if wandb_run is True:
        import wandb

        wandb_run = wandb.run
    if wandb_run is None or wandb_run is False:
        return
    data = {"rollout/push_seconds": seconds, f"rollout/push_{source}_seconds": seconds}
    if num_bytes:
        data["rollout/push_gb_per_s"] = num_bytes / max(seconds, 1e-9) / 1e9
    if version is not None:
        data["rollout/weight_version"] = version
    try:
        wandb_run.log(data, commit=False)
    except Exception as e:  # noqa: BLE001 - metrics must never fail a push
        logger.warning("logging the push to W&B failed: %s", e)


def _torch_dtype(name: Optional[str]):
    import torch

    return getattr(torch, name) if name else None


class WeightPushMixin:
    def __init__(self, wandb_run: Any = None):
        self._group = None
        self._push_dtype = None
        self._bucket_bytes = None
        self.wandb_run = wandb_run

    def init_weight_transfer(self, backend: str = "gloo", master_address: str = "127.0.0.1",
                             master_port: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                             bucket_bytes: Optional[int] = None) -> dict:
        """Form the transfer group: this process is rank 0 (it hosts the rendezvous on
        master_address:master_port, a free port by default), the server's workers join."""
        from weight_sync import WeightTransferGroup, find_free_port

        self.close_weight_transfer()
        world_size = self.get_world_size() + 1
        port = master_port or find_free_port(master_address)
        init_info = dict(master_address=master_address, master_port=port, world_size=world_size, rank_offset=1,
                         backend=backend, timeout_s=timeout_s)
        box: dict = {}
        server = threading.Thread(target=_capture, args=(box, self.init_weight_transfer_engine, init_info),
                                  name="init-weight-transfer", daemon=True)
        server.start()
        try:
            group = WeightTransferGroup(master_address, port, 0, world_size, backend=backend, timeout_s=timeout_s)
        except BaseException as e:
            server.join()
            if "error" in box:  # the server's reason is the useful one
                raise box["error"] from e
            raise
        server.join()
        if "error" in box:
            group.close()
            raise box["error"]
        self._group = group
        self._push_dtype = _torch_dtype(self.server_info().get("dtype"))
        self._bucket_bytes = bucket_bytes
        return box["result"]

    def push_weights(self, named_tensors: Iterable, version: Optional[int] = None, pause_mode: str = "abort",
                     dtype=None) -> dict:
        """pause(mode) -> start -> [POST /update_weights || WeightSender.send] -> finish(version) -> resume.

        Tensors carry Hugging Face names (a subset of the model is fine) and are cast to the
        engine's dtype (or `dtype`). The engine swaps them in atomically, clears its prefix and
        encoder caches and labels them `version` (default: previous + 1). A failed push leaves
        the old weights serving; generation is resumed either way. Chunked: `weight_update()`."""
        with self.weight_update(version, pause_mode, dtype) as update:
            update.send(named_tensors)
        return update.result()

    @contextlib.contextmanager
    def weight_update(self, version: Optional[int] = None, pause_mode: str = "abort", dtype=None):
        """with client.weight_update(version=step) as update: update.send(chunk); update.send(chunk2) ...

        One update in several pushes (e.g. layer by layer, to bound the trainer's memory): pause
        and start on entry, finish(version) and resume on exit (resume only, after an error).
        Every chunk is swapped in atomically on arrival; generation stays paused in between."""
        update = WeightUpdate(self, self._require_group(), dtype or self._push_dtype)
        self.pause(mode=pause_mode)
        try:
            update.version = self.weight_version() + 1 if version is None else version
            self.start_weight_update()
            yield update
            if update.num_sends:
                update.weight_version = self.finish_weight_update(update.version)
        finally:
            self.resume()
        update.log(self.wandb_run)

    def push_weights_shared(self, named_tensors: Iterable, version: Optional[int] = None,
                            pause_mode: str = "abort") -> dict:
        """For a trainer on the server's machine: pause -> share the tensors (CUDA IPC on a shared
        GPU, shared memory on CPU; in the engine's dtype) -> the engine copies them in -> resume.
        No transfer group needed."""
        from weight_sync import SharedWeights

        with self.paused(pause_mode), SharedWeights() as shared:
            return self.update_weights_from_ipc(shared.share(named_tensors), version)

    @contextlib.contextmanager
    def paused(self, mode: str = "abort", clear_cache: bool = True):
        """with client.paused(): ...  (generation resumes on exit, also on error)"""
        self.pause(mode=mode, clear_cache=clear_cache)
        try:
            yield self
        finally:
            self.resume()

    def close_weight_transfer(self) -> None:
        """Close the trainer's side of the group (and the server's, if it is reachable)."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            self.close_weight_transfer_engine()
        except Exception:  # noqa: BLE001 - best effort: the server may be gone
            pass
        group.close()

    def _require_group(self):
        if self._group is None:
            raise RuntimeError("no weight transfer group: call init_weight_transfer() first")
        return self._group


class WeightUpdate:
    """One update in progress (see `weight_update`); `send` pushes one chunk of named tensors."""

    def __init__(self, client, group, dtype):
        self.client, self.group, self.dtype = client, group, dtype
        self.version: Optional[int] = None
        self.weight_version: Optional[int] = None
        self.num_sends = 0
        self.stats: list[dict] = []
        self.t0 = time.perf_counter()

    def send(self, named_tensors: Iterable) -> dict:
        from weight_sync import WeightSender

        named = [(n, t) for n, t in named_tensors]
        kw = {"bucket_bytes": self.client._bucket_bytes} if self.client._bucket_bytes else {}
        sender = WeightSender(self.group, **kw)
        box: dict = {}
        thread = threading.Thread(target=_capture, args=(box, sender.send, named, self.dtype), name="weight-send",
                                  daemon=True)
        thread.start()
        try:
            update = self.client.update_weights(_update_info(named, self.dtype, self.version))
        except BaseException as e:
            thread.join(ABORT_AFTER_S)  # a refused push ends the sender too, the group intact
            if thread.is_alive():  # the sender waits for a receiver that is gone: break the group
                self.group.abort(f"the server failed the update: {e}")
            raise
        finally:
            thread.join()
        if "error" in box:
            raise box["error"]
        self.num_sends += 1
        self.stats.append({"send": box["result"], "update": update})
        return self.stats[-1]

    def result(self) -> dict:
        return {"weight_version": self.weight_version, "seconds": time.perf_counter() - self.t0,
                "send": self.stats[-1]["send"] if self.stats else None,
                "update": self.stats[-1]["update"] if self.stats else None, "num_sends": self.num_sends}

    def log(self, wandb_run: Any) -> None:
        if self.num_sends:
            log_push(wandb_run, "broadcast", time.perf_counter() - self.t0,
                     sum(s["send"]["num_bytes"] for s in self.stats), self.weight_version)


def _capture(box: dict, fn, *args) -> None:
    try:
        box["result"] = fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
        box["error"] = e


class AsyncWeightPushMixin:
    """The same protocol for AsyncRolloutClient; blocking collectives run in threads."""

    def __init__(self, wandb_run: Any = None):
        self._group = None
        self._push_dtype = None
        self._bucket_bytes = None
        self.wandb_run = wandb_run

    async def init_weight_transfer(self, backend: str = "gloo", master_address: str = "127.0.0.1",
                                   master_port: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                                   bucket_bytes: Optional[int] = None) -> dict:
        from weight_sync import WeightTransferGroup, find_free_port

        await self.close_weight_transfer()
        world_size = await self.get_world_size() + 1
        port = master_port or find_free_port(master_address)
        init_info = dict(master_address=master_address, master_port=port, world_size=world_size, rank_offset=1,
                         backend=backend, timeout_s=timeout_s)
        server = asyncio.ensure_future(self.init_weight_transfer_engine(init_info))
        group = await asyncio.to_thread(WeightTransferGroup, master_address, port, 0, world_size, backend=backend,
                                        timeout_s=timeout_s)
        try:
            result = await server
        except BaseException:
            group.close()
            raise
        self._group = group
        self._push_dtype = _torch_dtype((await self.server_info()).get("dtype"))
        self._bucket_bytes = bucket_bytes
        return result

    async def push_weights(self, named_tensors: Iterable, version: Optional[int] = None, pause_mode: str = "abort",
                           dtype=None) -> dict:
        """pause(mode) -> start -> [POST /update_weights || WeightSender.send] -> finish(version) -> resume."""
        async with self.weight_update(version, pause_mode, dtype) as update:
            await update.send(named_tensors)
        return update.result()

    @contextlib.asynccontextmanager
    async def weight_update(self, version: Optional[int] = None, pause_mode: str = "abort", dtype=None):
        """async with client.weight_update(version=step) as update: await update.send(chunk) ..."""
        if self._group is None:
            raise RuntimeError("no weight transfer group: call init_weight_transfer() first")
        update = AsyncWeightUpdate(self, self._group, dtype or self._push_dtype)
        await self.pause(mode=pause_mode)
        try:
            update.version = await self.weight_version() + 1 if version is None else version
            await self.start_weight_update()
            yield update
            if update.num_sends:
                update.weight_version = await self.finish_weight_update(update.version)
        finally:
            await self.resume()
        update.log(self.wandb_run)

    async def push_weights_shared(self, named_tensors: Iterable, version: Optional[int] = None,
                                  pause_mode: str = "abort") -> dict:
        """See RolloutClient.push_weights_shared."""
        from weight_sync import SharedWeights

        async with self.paused(pause_mode):
            with SharedWeights() as shared:
                return await self.update_weights_from_ipc(shared.share(named_tensors), version)

    @contextlib.asynccontextmanager
    async def paused(self, mode: str = "abort", clear_cache: bool = True):
        await self.pause(mode=mode, clear_cache=clear_cache)
        try:
            yield self
        finally:
            await self.resume()

    async def close_weight_transfer(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        try:
            await self.close_weight_transfer_engine()
        except Exception:  # noqa: BLE001
            pass
        group.close()


class AsyncWeightUpdate(WeightUpdate):
    async def send(self, named_tensors: Iterable) -> dict:
        from weight_sync import WeightSender

        named = [(n, t) for n, t in named_tensors]
        kw = {"bucket_bytes": self.client._bucket_bytes} if self.client._bucket_bytes else {}
        sender = WeightSender(self.group, **kw)
        send = asyncio.ensure_future(asyncio.to_thread(sender.send, named, self.dtype))
        try:
            update = await self.client.update_weights(_update_info(named, self.dtype, self.version))
        except BaseException as e:
            done, _ = await asyncio.wait({send}, timeout=ABORT_AFTER_S)
            if not done:
                self.group.abort(f"the server failed the update: {e}")
            await asyncio.gather(send, return_exceptions=True)
            raise
        self.num_sends += 1
        self.stats.append({"send": await send, "update": update})
        return self.stats[-1]
