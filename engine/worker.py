"""Worker: one model replica (weights, KV cache tensors, forward pass) behind the executor.

The engine core reaches it only through the executor: `execute_model(scheduler_output)` for a
step, and `collective_rpc` for everything else, where any public method of the worker, or of
the worker extension class named in the config (how RL frameworks add `update_weights`-style
methods), can be called by name. Weight updates stage and check the whole update first, then
copy it in: a failed or interrupted update leaves the old weights serving, bit for bit.
"""
import ctypes
import gc
import importlib
from typing import Iterable

import torch

from engine.config import EngineConfig
from engine.errors import EngineStateError, InvalidRequestError
from engine.model import LlamaModel
from engine.model_runner import ModelRunner
from engine.step_io import ModelRunnerOutput, SchedulerOutput


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.model_runner = ModelRunner(config)
        self.transfer_group = None  # weight_sync.WeightTransferGroup while a trainer's group is open
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # sleep level 1 on CUDA

    @property
    def model(self) -> LlamaModel | None:
        return self.model_runner.model

    # ---- the step -------------------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        """Allocate the KV cache; returns its number of blocks."""
        return self.model_runner.init_kv_cache()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    # ---- introspection --------------------------------------------------------------------
    def get_rank(self) -> int:
        return self.rank

    def ping(self, value=None):
        return value

    def model_info(self) -> dict:
        mc = self.config.model_config
        return {"architecture": mc.architecture, "dtype": self.config.dtype, "device": self.config.device,
                "num_parameters": sum(v.numel() for _, v in self.model.hf_views())}

    # ---- weight updates ---------------------------------------------------------------------
    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int,
                             backend: str = "gloo", rank_offset: int = 1, timeout_s: float = 60.0) -> int:
        """Join the trainer's group (trainer = rank 0); returns this worker's rank in it."""
        from weight_sync import WeightTransferGroup

        self.close_weight_transfer()
        rank = rank_offset + self.rank
        self.transfer_group = WeightTransferGroup(master_address, master_port, rank, world_size, backend=backend,
                                                  timeout_s=timeout_s)
        return rank

    def close_weight_transfer(self) -> bool:
        if self.transfer_group is not None:
            self.transfer_group.close()
        self.transfer_group = None
        return True

    def receive_weights(self) -> dict:
        """Receive one broadcast push (metadata, then buckets) and swap it in."""
        from weight_sync import WeightReceiver

        if self.transfer_group is None:
            raise EngineStateError("no weight transfer group: call init_weight_transfer first")
        return self._apply(WeightReceiver(self.transfer_group).receive(self.model.expected_weights()))

    def update_weights_from_disk(self, path: str) -> dict:
        """Load a safetensors checkpoint (the loader of start-up), cast to the engine's dtype, swap it in."""
        expected = self.model.expected_weights()
        staged = {}
        for name, t in self.model.checkpoint_tensors(path):
            self.model.check_weight(name, tuple(t.shape))
            staged[name] = t.to(expected[name][1])
        return self._apply(staged)

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Tensors handed over in this process (same checks as a push, dtypes must match)."""
        staged = {}
        for name, t in named_tensors:
            self.model.check_weight(name, tuple(t.shape), t.dtype)
            staged[name] = t.detach().to(self.model_runner.device, copy=True)
        return self._apply(staged)

    def update_weights_from_ipc(self, handles: dict) -> dict:
        """Tensors shared by a process on this machine (weight_sync.ipc: CUDA IPC or shared memory);
        every name, shape and dtype is checked before anything is copied."""
        from weight_sync.ipc import read_shared

        return self._apply(read_shared(handles, self.model_runner.device, check=self.model.check_weight))

    def _apply(self, staged: dict[str, torch.Tensor]) -> dict:
        if not staged:
            raise InvalidRequestError("weight update: no tensors")
        runner = self.model_runner
        if not runner.weights_valid:
            missing = sorted(set(self.model.expected_weights()) - set(staged))
            if missing:
                raise EngineStateError(f"the weights were dropped (sleep level 2): a full update is needed, "
                                       f"missing e.g. {missing[:3]}")
        with torch.no_grad():
            for name, t in staged.items():
                self.model.hf_view(name).copy_(t)
        self.model.repack()
        runner.weights_valid = True
        return {"num_tensors": len(staged), "num_bytes": sum(t.numel() * t.element_size() for t in staged.values())}

    def reload_weights(self) -> dict:
        """Reload the checkpoint the engine was started from (explicit, never implicit)."""
        self.model.load_weights(self.config.model)
        self.model_runner.weights_valid = True
        return {"path": self.config.model}

    def weights_checksum(self) -> str:
        from weight_sync import weights_checksum

        if not self.model_runner.weights_valid:
            raise EngineStateError("the engine holds no weights (sleep level 2)")
        return weights_checksum(self.model.hf_views())

    # ---- sleep / wake -----------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Level 1: KV cache freed, weights offloaded to host memory (on a CPU engine they are
        already there; their prepacked copies are dropped). Level 2: weights freed too."""
        runner = self.model_runner
        runner.free_kv_cache()
        if level == 2:  # (a second sleep goes deeper, never shallower)
            runner.model, self._offloaded = None, None
            runner.weights_valid = False
        elif runner.model is None or self._offloaded:
            pass  # already dropped (level 2) or offloaded
        elif runner.device.type == "cuda":
            self._offloaded = [(t, t.to("cpu", non_blocking=False).pin_memory()) for t in _tensors(runner.model)]
            for t, _ in self._offloaded:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        else:
            runner.model.drop_packed()
        _release_memory(runner.device)

    def wake_up(self, tags: list[str]) -> None:
        runner = self.model_runner
        if "weights" in tags:
            if runner.model is None:  # level 2: fresh (zero) tensors; a push or reload must fill them
                runner.model = LlamaModel(self.config.model_config, runner.dtype, runner.device,
                                          self.config.max_model_len)
            elif self._offloaded:
                for t, host in self._offloaded:
                    t.data = host.to(t.device)
                self._offloaded = None
                runner.model.repack()
            else:
                runner.model.repack()
        if "kv_cache" in tags and runner.kv_cache is None:
            runner.init_kv_cache()


def _tensors(model: LlamaModel) -> list[torch.Tensor]:
    seen, out = set(), []
    for _, v in model.hf_views():
        base = v._base if v._base is not None else v
        if id(base) not in seen:
            seen.add(id(base))
            out.append(base)
    return out


def _release_memory(device: torch.device) -> None:
    """Hand freed memory back: CUDA caching allocator -> driver; glibc heap -> the OS."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def worker_class(extension: str | None) -> type:
    """Worker, or Worker with the extension class mixed in ("package.module.Class" or
    "package.module:Class"); the extension's methods see `self` as the worker."""
    if not extension:
        return Worker
    module_name, _, cls_name = extension.replace(":", ".").rpartition(".")
    try:
        ext = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"worker_extension_cls {extension!r} cannot be imported: {e}") from e
    if not isinstance(ext, type):
        raise ValueError(f"worker_extension_cls {extension!r} is not a class")
    return type(f"Worker[{cls_name}]", (ext, Worker), {})
