"""Worker: one model replica (weights, KV cache tensors, forward pass) behind the executor.

The engine core reaches it only through the executor: `execute_model(scheduler_output)` for a
step, and `collective_rpc` for everything else, where any public method of the worker, or of
the worker extension class named in the config (how RL frameworks add `update_weights`-style
methods), can be called by name. Weight updates come in two calls: stage_weights receives or
reads the whole update into staging memory and checks it, commit_staged makes it live (swapped
in or copied, engine/worker/weight_buffers.py); a failed or interrupted update leaves the old
weights serving, bit for bit.

With tensor parallelism there is one Worker per rank, each holding its shard. Updates carry full
Hugging Face tensors (a trainer's own, whatever the engine's layout) and every rank keeps its
slice as it stages them; reads of the whole weights (checksum, sharing with a new replica) gather
the slices on rank 0 (`_full_weights`), so their answers are rank 0's.
"""
import ctypes
import gc
import importlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.errors import EngineStateError, InvalidRequestError
from engine.model.decoder import LlamaModel
from engine.model.parallel import TPGroup, gather_along
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.functions import import_function
from engine.worker.hf_export import DEFAULT_MAX_SHARD_BYTES, check_target, save_hf_folder, write_side_files
from engine.worker.lora import Adapter, LoRARequest, build_adapter, load_adapter, peft_key
from engine.worker.model_runner import ModelRunner
from engine.worker.sharded_state import is_sharded_state, read_rank, save_rank
from engine.worker.weight_buffers import WeightBuffers


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, tp: TPGroup | None = None):
        self.config = config
        self.rank = rank  # tensor-parallel rank in the replica
        self.model_runner = ModelRunner(config, tp)
        self.transfer_group = None  # weight_sync.WeightTransferGroup while a trainer's group is open
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # sleep level 1 on CUDA
        self._staged: dict[str, torch.Tensor] | None = None  # a checked update waiting for commit_staged
        self._received: tuple[LlamaModel, dict[str, torch.Tensor]] | None = None  # received, not yet staged
        self._buffers = WeightBuffers()  # where updates are staged (engine/worker/weight_buffers.py)
        self._receiver = None  # weight_sync.WeightReceiver of transfer_group (its bucket buffers are reused)
        self._staged_lora: Adapter | None = None  # a LoRA adapter's checked update, the same
        self._deadline = _Deadline(None)  # when the update being staged must be staged by

    @property
    def model(self) -> LlamaModel | None:
        return self.model_runner.model

    # ---- the step -------------------------------------------------------------------------
    def kv_cache_blocks(self) -> int:
        """How many KV cache blocks this rank's memory holds."""
        return self.model_runner.kv_cache_blocks()

    def initialize_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the KV cache (`num_blocks`: the same on every rank); returns its number of blocks."""
        return self.model_runner.init_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def launch_model(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """execute_model in two halves: start the step, and (the function returned) read its samples back."""
        return self.model_runner.launch(scheduler_output)

    def idle_step(self) -> None:
        self.model_runner.idle_step()

    # ---- the encoder cache (vision-language models) -----------------------------------------
    def reset_encoder_cache(self) -> bool:
        self.model_runner.reset_encoder_cache()
        return True

    def encoder_cache_stats(self) -> dict:
        r = self.model_runner
        return {"encoder_cache_hits": r.encoder_cache_hits, "encoder_cache_queries": r.encoder_cache_queries,
                "encoder_cache_usage": r.encoder_cache_rows / self.config.encoder_cache_size}

    # ---- LoRA adapters (the runner holds them) ----------------------------------------------
    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str, keep: list[int]) -> bool:
        return self.model_runner.add_lora(LoRARequest(lora_name, lora_int_id, lora_path), keep)

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.remove_lora(lora_id)

    def list_loras(self) -> list[int]:
        return self.model_runner.list_loras()

    def lora_state(self) -> list[dict]:
        """The resident adapters: name, id, their PEFT tensors (EngineCore.export_loras)."""
        return [{"name": a.request.lora_name, "id": i, "tensors": list(a.tensors.items())}
                for i, a in self.model_runner.loras.items()]

    # ---- introspection --------------------------------------------------------------------
    def get_rank(self) -> int:
        return self.rank

    def ping(self, value=None):
        return value

    def node_ip_address(self) -> str:
        """An address of this machine that other machines can reach (the default route's)."""
        import socket

        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("10.255.255.255", 1))  # no packet is sent: it only picks the interface
                return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"

    def host_key(self) -> str | None:
        """weight_sync.host_key() of this rank's machine: a trainer with the same one can push
        through shared memory (a Ray actor may run on any node)."""
        from weight_sync import host_key

        return host_key()

    def model_info(self) -> dict:
        mc = self.config.model_config
        return {"architecture": mc.architecture, "dtype": self.config.dtype, "device": self.config.device,
                "num_parameters": sum(math.prod(shape) for shape, _ in self.model.expected_weights().values())}

    # ---- weight updates ---------------------------------------------------------------------
    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int,
                             backend: str = "gloo", rank_offset: int = 1, timeout_s: float = 60.0,
                             cancel: threading.Event | None = None, group_name: str | None = None) -> int:
        """Join the trainer's group (trainer = rank 0); returns this worker's rank in it. Setting
        `cancel` (from another thread) gives up while rank 0 is not listening yet. `group_name`:
        a named torch.distributed group, as SGLang's trainers form theirs."""
        from weight_sync import WeightTransferGroup

        self.close_weight_transfer()
        rank = rank_offset + self.rank
        self.transfer_group = WeightTransferGroup(master_address, master_port, rank, world_size, backend=backend,
                                                  timeout_s=timeout_s, cancel=cancel, group_name=group_name)
        return rank

    def close_weight_transfer(self) -> bool:
        if self.transfer_group is not None:
            self.transfer_group.close()
        self.transfer_group = self._receiver = None
        return True

    def lease_weight_spare(self, holder: str, layouts: list[str] = ()) -> dict:
        """Hand the trainer `holder` the spare its next update is written into (a shared-memory
        layout; engine/worker/weight_buffers.py; `layouts`: the packs the trainer can run); each
        tensor-parallel rank lends its own, for its slices. On a CPU only (the core checks)."""
        if self.model is None:
            raise EngineStateError("the weights were dropped (sleep level 2): wake_up(['weights']) first")
        if self._staged is not None or self._received is not None:
            raise EngineStateError("an update is staged: lease the spare once it is committed or discarded", "spare")
        return self._buffers.lease(self.model, holder, tuple(layouts))

    def stage_weights(self, source: str, args: list, lora_id: int = 0, complete: bool = False,
                      deadline_s: float | None = None) -> dict:
        """Receive or read a whole update into fresh tensors, every name, shape and dtype checked
        (source: "broadcast", "disk" [path], "tensors" [named tensors], "ipc" [handles],
        "reload", "peer" [master address, port, world size, rank]); nothing live changes until
        commit_staged(). `lora_id`: an update of that LoRA adapter (see _stage_lora). `complete`:
        every weight must come (the engine core asks for it while it holds no weights).
        `deadline_s`: staging gives up that many seconds from now (TimeoutError, or over the
        trainer's group WeightDeadlineError, which breaks the group so the trainer's sender fails
        at once); nothing is staged then."""
        if lora_id:
            with self._staging_by(deadline_s):
                return self._stage_lora(lora_id, source, args)
        self.receive_weights(source, args, deadline_s)
        return self.finish_staging(complete)

    def receive_weights(self, source: str, args: list, deadline_s: float | None = None) -> None:
        """The first part of stage_weights (base weights): the bytes received or read into the
        spare, checked against the model's names, shapes and dtypes. It touches only what no step
        reads (the spare, the receiver's buffers, the trainer's group), so the engine core runs it
        in a thread while generation goes on; finish_staging, between two steps, does the rest."""
        self._received = None
        model = self.model
        if model is None:
            raise EngineStateError("the weights were dropped (sleep level 2): wake_up(['weights']) first")
        read = {"broadcast": self._receive_broadcast, "named": self._receive_named, "disk": self._read_checkpoint,
                "reload": self._read_checkpoint, "tensors": self._copy_tensors, "ipc": self._map_shared,
                "peer": self._receive_from_peer}.get(source)
        if read is None:
            raise InvalidRequestError(f"unknown weight source {source!r}")
        with self._staging_by(deadline_s):
            self._received = (model, read(model, source, args))

    @contextmanager
    def _staging_by(self, deadline_s: float | None):
        self._deadline = _Deadline(deadline_s)
        try:
            yield
        finally:
            self._deadline = _Deadline(None)

    def finish_staging(self, complete: bool = False) -> dict:
        """The rest of stage_weights, where steps cannot run beside it (a tied head's check may
        unpack live weights): the received tensors become the staged update."""
        received, self._received = self._received, None
        if received is None:  # (discarded meanwhile: an update given up at its deadline)
            raise EngineStateError("the received weight update was discarded before it was staged")
        model, staged = received
        if model is not self.model:  # (the engine slept, or loaded another model, since)
            raise EngineStateError("the weights changed while the update was received: push it again")
        model.untie_pushed(staged)
        model.split_fused_experts(staged)
        if not staged:
            raise InvalidRequestError("weight update: no tensors")
        if complete:
            missing = sorted(set(model.expected_weights()) - set(staged))
            if missing:
                raise EngineStateError(f"the weights were dropped (sleep level 2): a full update is needed, "
                                       f"missing e.g. {missing[:3]}")
        self._staged = staged
        return {"num_tensors": len(staged), "num_bytes": sum(t.numel() * t.element_size() for t in staged.values())}

    # ---- the sources of a base-weights update: each returns {HF name: checked tensor} -----------
    def _receive_broadcast(self, model: LlamaModel, source: str, args: list) -> dict[str, torch.Tensor]:
        from weight_sync import WeightReceiver

        if self.transfer_group is None:
            raise EngineStateError("no weight transfer group: call init_weight_transfer first")
        if self._receiver is None or self._receiver.group is not self.transfer_group:
            self._receiver = WeightReceiver(self.transfer_group)
        with self.transfer_group.deadline(self._deadline.left("waiting for the trainer's push")):
            return self._receiver.receive(model.accepted_weights(), select=_shard_selector(model),
                                          into=self._dest(model), write=self._packer(model))

    def _receive_named(self, model: LlamaModel, source: str, args: list) -> dict[str, torch.Tensor]:
        """SGLang's wire (weight_sync/named.py): args = [names, dtypes, shapes, flattened]. Every
        byte is received before anything is checked: that trainer broadcasts whatever we answer."""
        from weight_sync.named import named_metas, receive_named

        if self.transfer_group is None or self.transfer_group.group_name is None:
            raise EngineStateError("no named weight group: call init_weight_transfer with a group_name first")
        names, dtypes, shapes, flattened = args
        with self.transfer_group.deadline(self._deadline.left("waiting for the trainer's push")):
            pushed = receive_named(self.transfer_group, named_metas(names, dtypes, shapes), flattened)
        for name, t in pushed.items():
            model.check_weight(name, tuple(t.shape))
            if not t.is_floating_point():
                raise InvalidRequestError(f"{name} has dtype {t.dtype}: weights must be floating point")
        # a trainer's precision (bf16 into an fp32 engine) is cast, as SGLang's loader does
        stage = self._stager(model)
        return {name: stage(name, model.shard_of(name, t)) for name, t in pushed.items()}

    def _read_checkpoint(self, model: LlamaModel, source: str, args: list) -> dict[str, torch.Tensor]:
        path = self.config.model if source == "reload" else args[0]
        if is_sharded_state(path):  # this rank's slices as they are
            return model.checked_local(read_rank(path, self.rank, self.config.tensor_parallel_size), path)
        staged, stage = {}, self._stager(model)
        for name, t in model.checkpoint_tensors(path):
            self._deadline.check(f"reading {path}")
            model.check_weight(name, tuple(t.shape))
            if not t.is_floating_point():  # a float checkpoint of another precision is cast; this is not one
                raise InvalidRequestError(f"{name} has dtype {t.dtype} in {path}: weights must be floating point")
            staged[name] = stage(name, model.shard_of(name, t))
        return staged

    def _copy_tensors(self, model: LlamaModel, source: str, args: list) -> dict[str, torch.Tensor]:
        staged, stage = {}, self._stager(model)
        for name, t in args[0]:
            self._deadline.check("copying the tensors")
            model.check_weight(name, tuple(t.shape), t.dtype)
            staged[name] = stage(name, model.shard_of(name, t.detach()))
        return staged

    def _map_shared(self, model: LlamaModel, source: str, args: list) -> dict[str, torch.Tensor]:
        from weight_sync.ipc import read_shared

        if isinstance(args[0], dict) and args[0].get("kind") == "spare":  # written by the trainer into our spare
            return self._buffers.leased(model, self._rank_part(args[0]))
        shard = _shard_selector(model)

        def select(name: str, t: torch.Tensor) -> torch.Tensor:
            self._deadline.check("copying the shared tensors")
            return t if shard is None else shard(name, t)

        return read_shared(args[0], self.model_runner.device, check=model.check_weight, select=select,
                           stage=self._stager(model))

    def _rank_part(self, handles: dict) -> dict:
        """This rank's part of spare handles: {"ranks": [each rank's]} for a replica of several
        ranks (each lent its own spare, written with its slices), the handles themselves for one."""
        ranks = handles.get("ranks")
        size = self.config.tensor_parallel_size
        if ranks is None and size == 1:
            return handles
        if not isinstance(ranks, list) or len(ranks) != size or not all(isinstance(h, dict) for h in ranks):
            raise InvalidRequestError(f"a replica of {size} tensor-parallel ranks takes spare handles "
                                      f'{{"kind": "spare", "ranks": [{size} handles, one per rank]}}', "handles")
        return ranks[self.rank]

    def _receive_from_peer(self, model: LlamaModel, source: str, args: list) -> dict[str, torch.Tensor]:
        """A new data-parallel replica copies a live one (its send_weights_to_peers); `rank` is the
        replica's first (its tensor-parallel ranks follow it)."""
        from weight_sync import WeightReceiver, WeightTransferGroup

        master_address, master_port, world_size, rank = args
        group = WeightTransferGroup(master_address, master_port, rank + self.rank, world_size, backend=self._backend())
        try:
            return WeightReceiver(group).receive(model.expected_weights(), select=_shard_selector(model),
                                                 into=self._dest(model), write=self._packer(model))
        finally:
            group.close()

    def _dest(self, model: LlamaModel) -> Callable[[str], torch.Tensor]:
        """Where a base-weight update writes each tensor plain (see engine/worker/weight_buffers.py)."""
        return lambda name: self._buffers.dest(model, name)

    def _packer(self, model: LlamaModel) -> Callable[[str, torch.Tensor], torch.Tensor | None]:
        """A base-weight update's tensor packed for the matmul kernels as it is staged, or None
        where it is staged plain (WeightBuffers.write)."""
        return lambda name, t: self._buffers.write(model, name, t)

    def _stager(self, model: LlamaModel) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """Stages a base-weight update's tensor (cast to the model's dtype where it differs):
        packed where it can be, else copied into its place."""
        dest, pack = self._dest(model), self._packer(model)

        def stage(name: str, t: torch.Tensor) -> torch.Tensor:
            packed = pack(name, t)
            return packed if packed is not None else dest(name).copy_(t)

        return stage

    def _stage_lora(self, lora_id: int, source: str, args: list) -> dict:
        """A loaded adapter's new weights: "disk" a whole PEFT folder; "broadcast", "tensors" and
        "ipc" some of its tensors by PEFT name (the trainer's `...lora_A.default.weight` names
        too), each of the shape it has now, any floating dtype."""
        runner = self.model_runner
        old = runner.loras.get(lora_id)
        if old is None:  # (the core checked; a worker that evicted it meanwhile cannot happen: pinned or in use)
            raise InvalidRequestError(f"LoRA adapter {lora_id} is not loaded", "lora")
        mc, name = self.config.model_config, old.request.lora_name
        if source == "disk":
            adapter = load_adapter(LoRARequest(name, lora_id, args[0]), mc, self.config.max_lora_rank,
                                   runner.dtype, runner.device, runner.partition)
            self._staged_lora = adapter
            return {"num_tensors": len(adapter.tensors),
                    "num_bytes": sum(t.numel() * t.element_size() for t in adapter.tensors.values())}
        accepted = {k: (tuple(t.shape), runner.dtype) for k, t in old.tensors.items()}
        check = _lora_tensor_check(name, accepted)
        if source == "broadcast":
            from weight_sync import WeightReceiver

            if self.transfer_group is None:
                raise EngineStateError("no weight transfer group: call init_weight_transfer first")
            with self.transfer_group.deadline(self._deadline.left("waiting for the trainer's push")):
                pushed = WeightReceiver(self.transfer_group).receive(accepted)
        elif source == "tensors":
            pushed = {}
            for key, t in args[0]:
                check(key, tuple(t.shape), t.dtype)
                pushed[key] = t.detach()
        elif source == "ipc":
            from weight_sync.ipc import read_shared

            pushed = read_shared(args[0], torch.device("cpu"), check=check)
        else:
            raise InvalidRequestError(f"a LoRA adapter cannot be updated from {source!r}")
        if not pushed:
            raise InvalidRequestError("weight update: no tensors")
        tensors = dict(old.tensors)
        tensors.update({peft_key(k): t.to("cpu", torch.float32, copy=True) for k, t in pushed.items()})
        self._staged_lora = build_adapter(old.request, tensors, old.rank, old.scale, mc, runner.dtype, runner.device,
                                          runner.partition)
        return {"num_tensors": len(pushed), "num_bytes": sum(t.numel() * t.element_size() for t in pushed.values())}

    def send_weights_to_peers(self, master_address: str, master_port: int, world_size: int) -> dict:
        """Broadcast the live weights to new replicas (their stage_weights("peer", ...)): rank 0 of a
        group of its own, closed afterwards (the other tensor-parallel ranks only help gather)."""
        from weight_sync import WeightSender, WeightTransferGroup

        weights = list(self._full_weights())
        if self.rank != 0:
            return None
        group = WeightTransferGroup(master_address, master_port, 0, world_size, backend=self._backend())
        try:
            return WeightSender(group).send(weights)
        finally:
            group.close()

    def _full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor whole, in one fixed order: the model's own views, or with tensor
        parallelism the ranks' slices gathered on rank 0. Every rank must run through it (the
        gathers are collectives); ranks other than 0 yield nothing."""
        model = self.model
        if model.tp is None:
            yield from model.hf_views()
            return
        for name, view in model.hf_views():
            shard = model.hf_shard(name)
            if shard.dim is None:
                if self.rank == 0:
                    yield name, view
                continue
            parts = gather_along(model.tp, view.contiguous(), shard.dim, [n for _, n in shard.ranges])
            if parts is not None:
                yield name, shard.assemble(parts)

    def _backend(self) -> str:
        return "nccl" if self.model_runner.device.type == "cuda" else "gloo"

    def commit_staged(self) -> bool:
        """Make the staged tensors live (cannot fail on good input: all checked)."""
        if self._staged_lora is not None:
            adapter, self._staged_lora = self._staged_lora, None
            self.model_runner.replace_lora(adapter)
            return True
        assert self._staged is not None, "nothing staged"
        staged, self._staged = self._staged, None
        self._buffers.commit(self.model, staged)
        del staged
        if self.model_runner.device.type != "cpu":  # staged in fresh memory (on a CPU: in the kept spare)
            torch.cuda.empty_cache()  # (no gc pass: a full one over the frozen heap costs ~0.3 s a push)
        else:  # what an update freed (a receive's temporaries) glibc keeps, and RSS crept ~6 MB a push
            _trim_heap()
        return True

    def discard_staged(self) -> bool:
        self._staged = self._staged_lora = self._received = None
        if self.model_runner.device.type != "cpu":
            torch.cuda.empty_cache()
        return True

    def weights_checksum(self) -> str:
        from weight_sync import weights_checksum

        if self.model.ep is not None:  # this replica's experts (and the rest): combined by the frontend
            from weight_sync.checksum import tensor_entries

            return {"entries": tensor_entries((n, v) for n, v in self.model.hf_views() if v.numel())}
        weights = list(self._full_weights())
        return weights_checksum(weights) if self.rank == 0 else None

    # ---- saving and inspecting the model ---------------------------------------------------
    def save_weights(self, folder: str, overwrite: bool = False,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict | None:
        """Write the live weights (pushes included) as a Hugging Face folder that transformers
        loads (engine/worker/hf_export.py); returns {"path", "files", "bytes", "tensors"}. Every
        rank checks the target, then goes through the gathers of _full_weights; rank 0 writes and
        answers."""
        if self.model is None:
            raise EngineStateError("the weights were dropped (sleep level 2): push or reload weights before saving")
        if self.model.ep is not None:
            raise EngineStateError("saving the weights of an expert-parallel engine (each replica holds some experts) "
                                   "is not supported yet")
        target = check_target(folder, overwrite, [self.config.model, self.config.tokenizer])
        weights = self._full_weights()
        try:
            if self.rank != 0:
                return None
            return save_hf_folder(target, weights, self.config.model, self.config.tokenizer, self.config.dtype,
                                  max_shard_bytes)
        finally:
            for _ in weights:  # a failed write still runs the gathers the other ranks wait in
                pass

    def save_sharded_state(self, path: str, pattern: str | None = None, max_size: int | None = None) -> dict:
        """This rank's slices of the live weights into `path` (engine/worker/sharded_state.py);
        rank 0 adds the metadata and the model folder's config and tokenizer files."""
        if self.model is None:
            raise EngineStateError("the weights were dropped (sleep level 2): push or reload weights before saving")
        c = self.config
        saved = save_rank(path, self.rank, c.tensor_parallel_size, c.dtype, list(self.model.hf_views()), pattern,
                          max_size)
        if self.rank == 0:
            write_side_files(Path(path), c.model, c.tokenizer, c.dtype)
        return saved

    def apply_model(self, fn: str):
        """fn(model) on this worker's model (engine.model.decoder.LlamaModel), as vLLM's
        WorkerBase.apply_model; `fn` is an import path (engine/worker/functions.py), never code."""
        if self.model is None:
            raise EngineStateError("the weights were dropped (sleep level 2): wake_up(['weights']) first")
        self.model_runner.drop_step_captures()  # fn may rebind tensors the graphs and the plan read
        return import_function(fn)(self.model)

    # ---- sleep / wake -----------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Level 1: KV cache freed, weights offloaded to host memory (on a CPU engine they are
        already there; their prepacked copies are dropped). Level 2: weights freed too."""
        from weight_sync.ipc import forget_shared

        runner = self.model_runner
        runner.free_kv_cache()
        self._buffers.release()
        forget_shared()
        if level == 2:  # (a second sleep goes deeper, never shallower)
            runner.model, self._offloaded = None, None
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
                runner.model = runner.new_model()
                # packed like any awake model's: what a push's staging reads of the model (which
                # projections take their panels, WeightBuffers) is then what it will be once filled
                runner.model.repack()
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


class _Deadline:
    """When the update being staged must be staged by (None: whenever it is)."""

    def __init__(self, seconds: float | None):
        self.at = None if seconds is None else time.monotonic() + seconds

    def check(self, what: str) -> None:
        if self.at is not None and time.monotonic() >= self.at:
            raise TimeoutError(f"the weight update's deadline passed while {what}; nothing was staged")

    def left(self, what: str) -> float | None:
        """Seconds left (None: no deadline); TimeoutError if none are."""
        self.check(what)
        return None if self.at is None else self.at - time.monotonic()


def _shard_selector(model: LlamaModel) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """What a tensor-parallel rank or an expert-parallel replica keeps of each full tensor it
    receives (None: all of it)."""
    return None if model.tp is None and model.ep is None else model.shard_of


def _lora_tensor_check(name: str, accepted: dict[str, tuple]) -> Callable:
    """check(key, shape, dtype=None) for one pushed tensor of LoRA adapter `name`: a PEFT name it
    has (trainer names like `...lora_A.default.weight` too), its current shape, a floating dtype."""

    def check(key: str, shape: tuple, dtype: torch.dtype | None = None) -> None:
        want = accepted.get(peft_key(key))
        if want is None:
            raise InvalidRequestError(f"LoRA adapter {name!r} has no tensor {key!r} (it has e.g. "
                                      f"{next(iter(accepted))!r})")
        if tuple(shape) != want[0]:
            raise InvalidRequestError(f"LoRA adapter {name!r}: {key} has shape {list(shape)}, "
                                      f"expected {list(want[0])}")
        if dtype is not None and not dtype.is_floating_point:
            raise InvalidRequestError(f"LoRA adapter {name!r}: {key} has dtype {dtype}: weights must be "
                                      "floating point")

    return check


def _trim_heap() -> None:
    """Hand the glibc heap's free pages back to the OS (a few ms; no collection)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _release_memory(device: torch.device) -> None:
    """Hand freed memory back: CUDA caching allocator -> driver; glibc heap -> the OS."""
    frozen = gc.get_freeze_count() > 0  # (the engine-core process freezes what start-up made,
    if frozen:                          # the model among it: what sleep dropped must be collectable)
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # cuBLAS's per-stream workspaces, which
            torch._C._cuda_clearCublasWorkspaces()             # empty_cache() leaves in place
    else:
        _trim_heap()


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

