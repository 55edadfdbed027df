"""EngineCore: the owner of scheduling state, and of the pause and sleep state. One step:

    schedule -> executor.execute_model (every worker) -> scheduler.update_from_output

With async_scheduling the steps run in a thread of their own, one in flight while the next is
scheduled (engine/core/scheduler.py: placeholders): step() schedules step N+1, queues it (the
step thread launches it as soon as it launched step N: N+1's placeholder tokens are N's samples,
gathered on the device), reads N's samples back and returns N's outputs, so scheduling and output
handling overlap the forward pass, and on a GPU the two steps' kernels run back to back.
Every other public method but the request path (add_request, add_stream_input, abort_requests)
and a few reads first finishes the step in flight (`_drains_first`; its outputs join the pending
ones), and so does a Deferred's finish: no call ever runs beside a step, but the receive of a
weight update (stage_weights), which touches nothing a step reads and which every call that may
touch the weights waits for.

It speaks token ids only (EngineCoreRequest in, EngineCoreOutput out). `LLM(multiprocess=False)`
drives it in process; normally it runs inside the engine-core process
(engine/process/core_proc.py), whose busy loop calls the same methods. The methods named in
engine/process/utility.py's table are reachable as utility calls, no others; one that must wait
for running requests (pause mode "wait", a sleep that pauses) returns a `Deferred`, which the
caller of the utility resolves once its condition holds.

Pause (engine/core/pause.py), sleep, weight-version (and the requests' rules about it,
engine/core/staleness.py) and LoRA (engine/core/lora_registry.py) state live here and nowhere
above or below: the frontends, the HTTP server and its metrics ask the core (`is_paused`,
`is_sleeping`, `get_stats`); the scheduler reads the pause and the pins; the workers hold tensors
and are told what to keep.

    pause_generation(mode)
                   "abort": end every admitted request now (finish_reason abort), hold new ones;
                   "wait": admitted requests run to completion, new ones are held;
                   "keep": nothing runs; requests keep their KV and continue after resume.
                   Any later pause or resume replaces the mode, so no sequence of calls wedges.
                   With timeout_s, the pause lifts itself (logged) if nobody resumed in time.
    resume_generation()
                   admit the held requests; frozen ones continue.
    sleep(level)   pauses first (its `mode`) unless already paused, then frees the KV cache and
                   offloads (1) or drops (2) the weights; the wake-up that leaves nothing asleep
                   resumes what the sleep paused (an explicit pause stays).
"""
import functools
import inspect
import logging
import os
import resource
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.config import EngineConfig
from engine.core.kv_cache import KVCacheManager
from engine.core.lora_registry import LoRARegistry
from engine.core.pause import Pause, PauseState
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.errors import EngineStateError, InvalidRequestError
from engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, StreamInput
from engine.routed_experts import check_routed_experts
from engine.step_io import ModelRunnerOutput, SchedulerOutput
from engine.worker.executor import InprocExecutor, StepThreadExecutor, beside_steps
from engine.worker.hf_export import DEFAULT_MAX_SHARD_BYTES
from engine.worker.multiproc_executor import MultiprocExecutor
from engine.worker.profiler import StepProfiler, phase
from weight_sync.protocol import one_thread

logger = logging.getLogger("engine")
PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_PARTS = ("weights", "kv_cache")


@dataclass
class Deferred:
    """A utility call's result that is ready later: `done()` is checked after every step and
    every input (and every few ms while idle); once it holds, `finish()` gives the result (or
    raises the call's error). `needs_steps`: only engine steps can make it done (a drain), as
    opposed to work in a thread of its own (`thread`)."""

    done: Callable[[], bool]
    finish: Callable[[], Any]
    needs_steps: bool = True
    thread: threading.Thread | None = None

    @classmethod
    def in_thread(cls, fn: Callable[[], Any], name: str, then: Callable[[Any], Any] | None = None) -> "Deferred":
        """Run `fn` in a thread while the engine goes on serving; its result is the answer, or
        `then(result)`'s, run in the caller's thread once `fn` returned."""
        box: dict = {}

        def run():
            beside_steps.active = True  # its executor calls do not queue behind the steps
            try:
                box["result"] = fn()
            except BaseException as e:  # raised again by finish(), to the caller
                box["error"] = e

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()

        def finish():
            if "error" in box:
                raise box["error"]
            return box["result"] if then is None else then(box["result"])

        return cls(lambda: not thread.is_alive(), finish, needs_steps=False, thread=thread)


def stale_version(version: int, live: int) -> EngineStateError | None:
    """The refusal for a weight version that does not increase, or None. Versions increase
    strictly so that a token's version names one set of weights."""
    if version <= live:
        return EngineStateError(f"weight versions must increase: {version} is not above the live version {live}",
                                "weight_version")
    return None


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        # async scheduling: the worker lives in the thread that runs the steps (StepThreadExecutor)
        threads, cpus = torch.get_num_threads(), config.rank_cpus(0)
        self.executor = None
        if config.tensor_parallel_size > 1:  # the other ranks start first: they inherit this process's
            # cores, and must see all of them to pin themselves to theirs
            self.executor = (StepThreadExecutor(lambda: MultiprocExecutor(config), threads, config.device, cpus)
                             if config.async_scheduling else MultiprocExecutor(config))
        self._cpus_before = os.sched_getaffinity(0) if cpus is not None else None  # restored at shutdown:
        if cpus is not None:  # a data- or tensor-parallel rank on its own cores (an in-process core pins its caller)
            os.sched_setaffinity(0, cpus)
        if self.executor is None:  # (pinned first: the threads the worker starts inherit the pinning)
            self.executor = (StepThreadExecutor(lambda: InprocExecutor(config), threads, config.device)
                             if config.async_scheduling else InprocExecutor(config))
        num_blocks = self.executor.initialize_kv_cache()
        capacity = num_blocks * config.block_size
        if capacity < config.max_model_len:
            logger.warning("KV cache holds %d tokens < max_model_len %d; capping max_model_len",
                           capacity, config.max_model_len)
            config.max_model_len = capacity
        self.max_model_len = config.max_model_len
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.pause = Pause()  # owned here; the scheduler reads it
        self.loras = LoRARegistry()  # owned here; the scheduler reads its pins, the worker caches the tensors
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   config.max_loras if config.enable_lora else 0, self.pause, self.loras.pinned)
        self.weight_version = 0
        # the version the last steps generated with, and whether weight_version moved since (requests'
        # version rules, engine/core/staleness.py, apply the move before the next step generates)
        self._steps_version, self._version_moved = 0, False
        self.num_generated_tokens = 0
        self.forming_group: Deferred | None = None  # init_weight_transfer while its group forms
        self.staging: Deferred | None = None  # stage_weights while its bytes are received beside the steps
        self.staged_update: str | None = None  # the update_id of what the workers stage or hold staged
        self.group_cancel = threading.Event()  # set by close_weight_transfer to stop the forming
        self.in_weight_group = False  # this replica's workers joined the trainer's group (it formed)
        self.asleep: set[str] = set()  # parts freed by sleep: "weights", "kv_cache"
        self.needs_weights = False  # a level-2 sleep dropped the weights: a push or reload refills them
        self._pending_outputs: list[EngineCoreOutput] = []  # produced outside step() (aborts, stream input)
        # expert parallelism: the replicas' group (one worker per replica: tensor parallelism is refused),
        # and whether every step of any replica is a forward pass on all of them, an idle one where this
        # replica has nothing to run (set by the engine-core process: engine/process/waves.py)
        self.ep_group = self.executor.worker.model_runner.ep if isinstance(self.executor, InprocExecutor) else None
        self.lockstep = False
        self.profiler = StepProfiler(config.profiler_dir, config.data_parallel_rank, config.device,
                                     all_threads=config.async_scheduling)
        # async scheduling: the step in flight (its SchedulerOutput and the future of its ModelRunnerOutput)
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        self._resident: set[int] | None = None  # the worker's LoRA adapters, None: ask it (_resident_loras)

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_can_generate()
        self._check_routed_experts(request.sampling_params)
        self._check_prompt(request.prompt_token_ids, request.request_id)
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", "request_id")
        if request.lora_id:
            self._check_lora(request.lora_id, "lora_request")
            pinned = self.loras.pinned
            if request.lora_id not in pinned and len(pinned) >= self.config.max_loras:
                raise EngineStateError(f"LoRA adapter {request.lora_id} cannot run: every LoRA slot (max_loras "
                                       f"{self.config.max_loras}) holds a pinned adapter {sorted(pinned)}",
                                       "lora_request")
        self.scheduler.add_request(Request(request), self.weight_version)

    def add_stream_input(self, chunk: StreamInput) -> None:
        """Append the next input chunk to a streaming request (or close its input)."""
        req = self.scheduler.requests.get(chunk.request_id)
        if req is None or req.stream is None:
            raise InvalidRequestError(f"no streaming request {chunk.request_id!r} is running")
        if chunk.sampling_params is not None:
            self._check_routed_experts(chunk.sampling_params)
        if chunk.prompt_token_ids:
            self._check_prompt(req.all_token_ids + chunk.prompt_token_ids, chunk.request_id)
        out = self.scheduler.add_stream_input(req, chunk)
        if out is not None:
            self._pending_outputs.append(out)

    def _check_prompt(self, ids: list[int], request_id: str) -> None:
        if not ids:
            raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"request {request_id!r}: {len(ids)} tokens do not fit the context "
                                      f"(max_model_len {self.max_model_len})")
        vocab = self.config.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"request {request_id!r}: token ids must be in [0, {vocab})")

    def _check_routed_experts(self, params) -> None:
        c = self.config
        check_routed_experts(params.return_routed_experts, c.enable_return_routed_experts,
                             c.model_config.architecture, c.model_config.moe is not None)

    def _check_can_generate(self) -> None:
        if self.asleep:
            raise EngineStateError("the engine is asleep: call wake_up() before generating")
        if self.needs_weights:
            raise EngineStateError("the engine holds no weights (it slept at level 2): push weights or reload the "
                                   "start-up checkpoint (reload_weights(), POST /reload_weights) before generating")

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        """Abort; returns the final outputs (finish_reason abort) of the requests that existed."""
        aborted = self.scheduler.abort(request_ids)
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], weight_version=self.weight_version,
                                 finish_reason=FinishReason.ABORT) for r in aborted]

    def abort_all(self) -> int:
        """Abort every request but those that never ran (held by a pause, or awaiting a weight
        version: a pause before the push they wait for must not end them); their final outputs
        follow as outputs."""
        held = {r.request_id for r in (*self.scheduler.held, *self.scheduler.versions.awaiting)}
        ids = [rid for rid in self.scheduler.requests if rid not in held]
        self._pending_outputs.extend(self.abort_requests(ids))
        return len(ids)

    def has_work(self) -> bool:
        """Whether step() would compute or hand out something."""
        self._expire_pause()
        self._apply_version_move()
        return (bool(self._pending_outputs) or self._in_flight is not None
                or (self._can_run() and self.scheduler.can_step()))

    def seconds_to_next_event(self) -> float | None:
        """How long the core may sit idle before something is due (a pause's deadline)."""
        return self.pause.seconds_to_deadline()

    def _can_run(self) -> bool:
        return not self.asleep and not self.needs_weights

    def _apply_version_move(self) -> None:
        """Apply a move of the base model's weight_version to the requests' version rules (stale
        ones finish or restart, those waiting for it are admitted) before anything generates again.
        During a keep pause nothing generates: it waits for the resume, so the versions an update
        in several chunks passes through never count, only the one finish_weight_update gives it."""
        if not self._version_moved or self.pause.state is PauseState.PAUSED_ALL:
            return
        self._version_moved = False
        old, self._steps_version = self._steps_version, self.weight_version
        self._pending_outputs += self.scheduler.weights_changed(old, self.weight_version)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        self._apply_version_move()
        outputs = self.take_pending_outputs()
        scheduler_output = None
        if self._can_run() and self.scheduler.can_step():
            with phase("schedule"):
                scheduler_output = self.scheduler.schedule()
                outputs += self._load_step_loras(scheduler_output)
        elif self.lockstep and self._can_run():  # the other replicas' tokens still need our experts
            self.executor.collective_rpc("idle_step")
        if not isinstance(self.executor, StepThreadExecutor):
            if scheduler_output is not None:
                outputs += self._apply(scheduler_output, self.executor.execute_model(scheduler_output))
            return outputs
        last, self._in_flight = self._in_flight, None
        if scheduler_output is not None:  # queued before the last step's samples are read back: the
            # step thread launches it as soon as it launched that one (its placeholders wait on the device)
            self._in_flight = (scheduler_output, self.executor.submit(scheduler_output))
        if last is not None:
            outputs += self._apply(last[0], last[1].result())
        return outputs

    def drain(self) -> list[EngineCoreOutput]:
        """Finish the step in flight (async scheduling) and return its outputs: anything but a
        step that reaches the workers (a utility call) first drains."""
        last, self._in_flight = self._in_flight, None
        return self._apply(last[0], last[1].result()) if last is not None else []

    def _apply(self, scheduler_output: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        with phase("outputs"):
            outputs = self.scheduler.update_from_output(scheduler_output, result, self.weight_version,
                                                        self.loras.version)
        self.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    # ---- pause / resume -------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True, timeout_s: float | None = None,
                         recompute_kv: bool = False, unless_paused: bool = False):
        """Pause generation (see the module docstring); "wait" answers once the admitted requests
        finished. `timeout_s`: resume by itself (logged) if nobody resumed within it, so a trainer
        that dies while generation is paused does not hang every rollout. `recompute_kv` (mode
        "keep"): when new weights go live during this pause, the frozen requests drop their KV and
        recompute it (prompt and tokens so far) under the new weights, so every later token is
        what the new weights give for the whole sequence (SGLang's retract); by default they keep
        the KV the old weights computed (vLLM's keep), which is cheaper. Returns {"aborted": n
        (requests an abort-mode pause ended), "kept": n (requests a keep-mode pause froze; they
        continue after resume), "mode": mode}. `unless_paused`: a pause (or a sleep) in place stays
        exactly as it is (its mode, timeout, recompute) and nothing changes; the answer then also
        says "was_paused": one call that pauses only what runs (POST /weights/update)."""
        if timeout_s is not None and not timeout_s > 0:
            raise InvalidRequestError(f"pause timeout_s must be positive, got {timeout_s}", "timeout_s")
        was_paused = self.pause.active
        if unless_paused and was_paused:
            return {"aborted": 0, "kept": 0, "mode": mode, "was_paused": True}
        num_aborted = self._set_pause(mode, timeout_s=timeout_s, recompute_kv=recompute_kv)
        kept = len(self.scheduler.requests) - len(self.scheduler.held) - len(self.scheduler.versions.awaiting) \
            if mode == "keep" else 0

        def finish() -> dict:
            if clear_cache:
                self.reset_prefix_cache()
            answer = {"aborted": num_aborted, "kept": kept, "mode": mode}
            return dict(answer, was_paused=was_paused) if unless_paused else answer

        return Deferred(self._drained, finish) if mode == "wait" else finish()

    def _set_pause(self, mode: str, by_sleep: bool = False, timeout_s: float | None = None,
                   recompute_kv: bool = False) -> int:
        """Pause (an explicit one outlives a later wake-up: by_sleep False); returns how many
        requests an abort-mode pause ended."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}", "mode")
        num_aborted = self.abort_all() if mode == "abort" else 0
        self.pause.enter(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW, by_sleep, timeout_s,
                         recompute_kv)
        self.scheduler.pause_changed()
        return num_aborted

    def _expire_pause(self) -> None:
        if self.pause.due():
            seconds = self.resume_generation()["paused_seconds"]
            logger.warning("generation was paused for %.1f s, past the pause's timeout_s, and nobody resumed "
                           "it: resumed", seconds)

    def _drained(self) -> bool:
        """No admitted request runs any more, none can (asleep, no weights: waiting would block the
        caller until someone else wakes the engine), or the pause that waited was replaced."""
        return not self.scheduler.has_active() or self.pause.state is not PauseState.PAUSED_NEW or not self._can_run()

    def resume_generation(self) -> dict:
        """Resume generation; returns how long it was paused ({"paused_seconds": s or None})."""
        seconds = self.pause.lift()
        self.scheduler.pause_changed()
        return {"paused_seconds": seconds}

    def is_paused(self) -> bool:
        return self.pause.active

    # ---- sleep / wake ---------------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort"):
        """Pause (with `mode`) unless paused, then free the KV cache and offload (level 1) or drop
        (level 2) the weights. Requests kept by a "keep" pause lose their KV and recompute later."""
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"sleep mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        paused_here = not self.is_paused()
        if paused_here:
            self._set_pause(mode, by_sleep=True)

        def finish() -> bool:
            try:
                if not self.pause.active and self.scheduler.has_active():
                    raise EngineStateError("generation was resumed before the engine could sleep")
                self.scheduler.preempt_all()
                self.kv.reset_prefix_cache()
                self.executor.collective_rpc("sleep", [level])
            except Exception:
                if paused_here and self.pause.by_sleep:
                    self.resume_generation()
                raise
            self.asleep = set(SLEEP_PARTS)
            self.needs_weights = self.needs_weights or level == 2
            return True

        if self._drained():
            return finish()
        return Deferred(self._drained, finish)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Restore the tagged parts (both by default). Returns {"is_sleeping": anything still
        asleep, "paused_seconds": how long the pause lasted if this wake-up resumed generation}."""
        tags = list(tags or SLEEP_PARTS)
        if not set(tags) <= set(SLEEP_PARTS):
            raise InvalidRequestError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {tags}")
        self.executor.collective_rpc("wake_up", [tags])
        self.asleep -= set(tags)
        resumed = self.resume_generation() if not self.asleep and self.pause.by_sleep else {"paused_seconds": None}
        return {"is_sleeping": self.is_sleeping(), **resumed}

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    # ---- weights ----------------------------------------------------------------------------
    def _check_weights_awake(self) -> None:
        if "weights" in self.asleep:
            raise EngineStateError("the weights are asleep: wake_up(tags=['weights']) before updating them")

    def _check_can_update(self) -> None:
        self._check_weights_awake()
        if self._generating():
            raise EngineStateError("requests are running: pause generation before updating the weights")

    def _generating(self) -> bool:
        """Admitted requests run (not frozen by a keep pause, nor stopped by sleep or no weights)."""
        return self._can_run() and self.scheduler.has_active() and self.pause.state is not PauseState.PAUSED_ALL

    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int,
                             backend: str = "gloo", timeout_s: float = 60.0,
                             replica_ranks: list[int] | None = None, rank_offset: int = 1,
                             group_name: str | None = None) -> list[int]:
        """Every worker joins the trainer's group: the trainer is rank 0, then the workers of the
        live replicas in the order of `replica_ranks` (their data_parallel_ranks, as the frontend
        sees them now: replicas come and go, so positions are counted afresh at every init; None:
        this replica alone), from `rank_offset` on (SGLang's trainers put several servers in one
        group). `group_name`: a named torch.distributed group (SGLang's recipe). Returns the
        workers' ranks. A replica that `replica_ranks` leaves out (a trainer on its machine pushes
        to it through shared memory instead) leaves any group it was in and joins none: []."""
        if replica_ranks is None:
            replica_ranks = [self.config.data_parallel_rank]
        if self.config.data_parallel_rank not in replica_ranks:
            self.close_weight_transfer()
            return []
        rank_offset += replica_ranks.index(self.config.data_parallel_rank) * self.config.tensor_parallel_size
        if self.group_cancel.is_set():  # a cancelled forming stops within a connect attempt
            deadline = time.monotonic() + 2.0
            while not self.forming_group.done() and time.monotonic() < deadline:
                time.sleep(0.01)
        if self.forming_group is not None and not self.forming_group.done():
            raise EngineStateError("a weight transfer group is already being formed: wait for that call's answer "
                                   "(at most its timeout_s) or close_weight_transfer() first")
        cancel = self.group_cancel = threading.Event()

        def form() -> list[int]:
            self.in_weight_group = False
            ranks = self.executor.collective_rpc(
                "init_weight_transfer", [master_address, master_port, world_size],
                {"backend": backend, "rank_offset": rank_offset, "timeout_s": timeout_s, "cancel": cancel,
                 "group_name": group_name})
            if cancel.is_set():  # closed (the caller went away) just as it formed
                from weight_sync import WeightGroupError

                self.executor.collective_rpc("close_weight_transfer")
                raise WeightGroupError("the weight transfer group was closed while it formed")
            self.in_weight_group = True
            return ranks

        # Forming the group waits for every rank (up to timeout_s): in a thread, so that
        # generation goes on meanwhile; the answer comes when every rank joined.
        self.forming_group = Deferred.in_thread(form, "weight-group")
        return self.forming_group

    def lease_weight_spare(self, holder: str, layouts: list[str] | None = None,
                           replicas: list[int] | None = None) -> dict | None:
        """Lend the trainer `holder` the memory the next update is staged in, to write its tensors
        into directly (Worker.lease_weight_spare): a CPU replica only. A replica of several
        tensor-parallel ranks lends one per rank, {"ranks": [leases]}, each written with that
        rank's slices (SpareWriter). Every replica lends its own,
        which the trainer writes one after the other (`replica` names this one's data-parallel
        rank; an update's handles say which lease each replica's part is: replica_part).
        `replicas`: only those lend (the ones on the trainer's machine); None from the others."""
        if replicas is not None and self.config.data_parallel_rank not in replicas:
            return None
        self._check_has_weights("to lease its spare")
        if "weights" in self.asleep:
            raise EngineStateError("the weights are asleep: wake_up(tags=['weights']) first", "spare")
        cfg = self.config
        if not cfg.device.startswith("cpu"):
            raise InvalidRequestError("the weight spare is lent by a CPU replica only: share the tensors in a segment "
                                      "of the trainer's own", "spare")
        leases = self.executor.collective_rpc("lease_weight_spare", [holder, layouts or []])
        lease = leases[0] if len(leases) == 1 else {"ranks": leases}
        return dict(lease, replica=cfg.data_parallel_rank)

    def close_weight_transfer(self) -> bool:
        """Leave the group, or stop forming it (a group that forms meanwhile is closed at once)."""
        self.in_weight_group = False
        if self.forming_group is not None and not self.forming_group.done():
            self.group_cancel.set()
            return True
        self.executor.collective_rpc("close_weight_transfer")
        return True

    # A weight update has two phases so that it is atomic across data-parallel replicas: every
    # replica stages it (received / read, checked; nothing live changes), then it goes live on
    # all of them only if all staged (engine.process.core_client.weight_update_plan drives it).
    def stage_weights(self, source: str, args: list, lora_id: int = 0, deadline_s: float | None = None,
                      update_id: str | None = None):
        """Stage an update from `source` ("broadcast": one push from the trainer's WeightSender;
        "disk" [path]; "tensors" [named tensors]; "ipc" [handles]; "reload": the start-up
        checkpoint; "peer": a live replica's weights, see send_weights_to_peers) on every worker.
        Returns its stats and the current weight_version. With `lora_id`: an update of that
        loaded LoRA adapter's tensors (PEFT names; "disk": a PEFT folder), its version instead.
        `deadline_s`: the workers give up staging that many seconds from now (Worker.stage_weights).
        `update_id` names the update for its commit and discard: the workers hold one update, and a
        later stage replaces it (two frontends updating at once, e.g. through two API servers), so
        the earlier one's commit is refused rather than making the later one's tensors live.

        Where the config allows (EngineConfig.stages_weights_beside_steps; base weights) and
        requests are generating, the bytes are received in a thread while they go on with the live
        weights (Worker.receive_weights touches only the spare): a Deferred, answered once they are
        all here and checked; only the commit needs generation paused. Meanwhile every call that
        may touch the weights waits for the receive (_drains_first), as it waited for a staging
        that held the loop. Elsewhere generation must be paused first, as for the commit; with
        nothing generating the loop stages it itself, with all its threads (a thread beside it
        would hold a second OpenMP team, and every parallel copy would wait on a futex wake-up)."""
        unpaused = self.config.stages_weights_beside_steps and not lora_id  # (staging touches nothing a step reads)
        if unpaused:
            self._check_weights_awake()
        else:
            self._check_can_update()
        if lora_id:  # the update pins it: it must be resident, and its pin must strand no request
            self._check_lora(lora_id, "lora")
            self._check_pin(lora_id)
            self._make_resident(lora_id)
        if args and isinstance(args[0], dict) and (source == "broadcast" or source == "ipc" and "replicas" in args[0]):
            source, args = self._own_part(source, args[0])
        self.staged_update = update_id
        written = source == "ipc" and bool(args) and isinstance(args[0], dict) and args[0].get("kind") == "spare"
        if not (unpaused and self._generating()) or written:  # (a spare the trainer wrote: views are all to make)
            with _malformed_handles(source):
                stats = self.executor.collective_rpc("stage_weights",
                                                     [source, args, lora_id, self.needs_weights, deadline_s])[0]
            if lora_id:
                if source == "disk":
                    stats["lora_path"] = args[0]
                return dict(stats, weight_version=self.loras.get(lora_id).version)
            return dict(stats, weight_version=self.weight_version)

        def receive() -> None:
            # one thread's torch ops (a disk read's casts and copies): a second OpenMP team beside
            # the steps' would slow every parallel region of theirs (engine/worker/executor.py)
            with one_thread(), _malformed_handles(source):
                self.executor.collective_rpc("receive_weights", [source, args, deadline_s])

        def finish(_) -> dict:
            if self.staged_update != update_id:  # (the workers' staging memory holds another update's now)
                raise self._superseded(update_id)
            with _malformed_handles(source):
                stats = self.executor.collective_rpc("finish_staging", [self.needs_weights])[0]
            return dict(stats, weight_version=self.weight_version)

        self.staging = Deferred.in_thread(receive, "weight-receive", then=finish)
        return self.staging

    def _superseded(self, update_id: str | None) -> EngineStateError:
        return EngineStateError(f"weight update {update_id} was replaced by another one staged since (two updates at "
                                "once, through different frontends?): it is dropped, push it again")

    def _wait_for_staging(self) -> None:
        """Block until a receive running beside the steps is over (its Deferred answers later)."""
        if self.staging is not None:
            self.staging.thread.join()
            self.staging = None

    def _own_part(self, source: str, handles: dict) -> tuple[str, list]:
        """What this replica stages from handles that name replicas ({"replicas": [parts, each with
        its "replica"]}: every replica's spare written, or a segment shared for several). "ipc":
        every replica needs its part. "broadcast" (a trainer on the machine of some replicas):
        those it names read their part through shared memory, the others receive the push over
        the group, which the named ones must not be in (the trainer's broadcast would wait on them)."""
        rank = self.config.data_parallel_rank
        mine = replica_part(handles, rank)
        if mine is None and source == "ipc":
            raise InvalidRequestError(f"the push has no part for replica {rank} (a replica that joined since the "
                                      "lease has none; lease the spares again)", "handles")
        if mine is None:
            return "broadcast", []
        if source == "broadcast" and self.in_weight_group:
            raise InvalidRequestError(f"replica {rank} is in the weight transfer group and the push names shared-memory "
                                      "handles for it too: form the group without it (init_weight_transfer's "
                                      "replicas)", "handles")
        return "ipc", [mine]

    def commit_weights(self, version: int, lora_id: int = 0, lora_path: str | None = None,
                       update_id: str | None = None) -> dict:
        """Make the staged update live under `version` (weight_update_plan has checked that it
        increases; a replica that joins by scaling takes the live version); no KV computed by
        the old weights is reused (prefix and encoder caches cleared, in this same call so that
        no step runs between the swap and the reset). With `lora_id`: that adapter's version;
        the adapter is pinned from now on (the pushed weights exist nowhere else), `lora_path` (a
        disk update) becomes its folder. Returns {"weight_version", "swap_s" (the copy into the
        live weights), "clear_cache_s" (then the cache resets)}."""
        self._check_can_update()  # (staging beside the steps did not ask for a pause)
        if update_id is not None and update_id != self.staged_update:
            raise self._superseded(update_id)
        t0 = time.monotonic()
        self.executor.collective_rpc("commit_staged")
        self.staged_update = None
        swapped = time.monotonic()
        if self.pause.recompute_kv and self.pause.state is PauseState.PAUSED_ALL:
            self.scheduler.preempt_all()  # the frozen requests recompute under the new weights
        self.reset_prefix_cache()
        if lora_id:
            self.loras.pushed(lora_id, version, lora_path)
        else:
            self.weight_version = int(version)
            self.needs_weights = False
            self._version_moved = True
            self.reset_encoder_cache()
        return {"weight_version": int(version), "swap_s": swapped - t0, "clear_cache_s": time.monotonic() - swapped}

    def send_weights_to_peers(self, master_address: str, master_port: int, world_size: int) -> dict:
        """Share the live weights with replicas that join (scaling up): they stage them with
        stage_weights("peer", [master_address, master_port, world_size, rank])."""
        self._check_has_weights("to share")
        return self.executor.collective_rpc("send_weights_to_peers", [master_address, master_port, world_size])[0]

    def discard_weights(self, update_id: str | None = None) -> bool:
        """Drop the staged update: the one `update_id` names, if the workers still hold it (False
        if another one replaced it)."""
        if update_id is not None and update_id != self.staged_update:
            return False
        self.executor.collective_rpc("discard_staged")
        self.staged_update = None
        return True

    def weights_checksum(self) -> str:
        self._check_has_weights("to checksum")
        return self.executor.collective_rpc("weights_checksum")[0]

    def save_weights(self, folder: str, overwrite: bool = False,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
        """Write the live weights (pushes included) as a Hugging Face safetensors folder that
        transformers loads (Worker.save_weights); the engine does not step meanwhile, so no update
        lands halfway. Returns {"path", "files", "bytes", "tensors", "weight_version"}."""
        self._check_has_weights("to save")
        if "weights" in self.asleep:
            raise EngineStateError("the weights are asleep: wake_up(tags=['weights']) before saving them")
        if max_shard_bytes < 1:
            raise InvalidRequestError(f"max_shard_bytes must be at least 1, got {max_shard_bytes}", "max_shard_bytes")
        saved = self.executor.collective_rpc("save_weights", [folder, overwrite, max_shard_bytes])[0]
        return dict(saved, weight_version=self.weight_version)

    def _check_has_weights(self, why: str) -> None:
        if self.needs_weights:
            raise EngineStateError(f"the engine holds no weights {why} (it slept at level 2): push weights or "
                                   "reload the start-up checkpoint first")

    def get_weight_version(self, lora_id: int = 0) -> int:
        """The live weights' version, or that of the loaded LoRA adapter `lora_id`."""
        if lora_id:
            self._check_lora(lora_id, "lora")
            return self.loras.get(lora_id).version
        return self.weight_version

    def set_weight_version(self, version: int, above: int | None = None) -> int:
        """Relabel the current weights (vLLM's finish_weight_update sets the version after the
        transfer); tokens produced from now on carry it. It must exceed `above` (default: the
        live version; a weight update in several chunks passes the version from before its
        first chunk, since generation stayed paused while the chunks went live)."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidRequestError(f"weight version must be an int, got {version!r}", "weight_version")
        if version != self.weight_version and (error := stale_version(version, self.weight_version
                                                                     if above is None else above)):
            raise error
        self._version_moved = self._version_moved or version != self.weight_version
        self.weight_version = version
        return version

    # ---- caches, stats, workers -----------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        self.kv.reset_prefix_cache()
        return True

    def reset_encoder_cache(self) -> bool:
        """Forget every cached vision-encoder output (a vision-language model; else a no-op).
        Every weight update does it too."""
        if self.config.model_config.vision:
            self.executor.collective_rpc("reset_encoder_cache")
        return True

    def reset_mm_cache(self) -> bool:
        """vLLM's name for the multimodal cache; the encoder cache is the only one here (images
        are preprocessed per request in the frontend, nothing of them is kept there)."""
        return self.reset_encoder_cache()

    def get_stats(self) -> dict:
        s = self.scheduler.stats()
        return dict(num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.kv_usage,
                    prefix_hit_rate=s.prefix_hit_rate, num_preemptions=s.num_preemptions,
                    num_prefill_tokens=s.num_prefill_tokens, num_generated_tokens=self.num_generated_tokens,
                    num_stale_finished=s.num_stale_finished, num_stale_restarted=s.num_stale_restarted,
                    num_free_blocks=self.kv.num_free_blocks, num_blocks=self.kv.num_blocks,
                    weight_version=self.weight_version, has_weights=not self.needs_weights,
                    is_paused=self.is_paused(),
                    pause_state=self.pause.state.value, paused_seconds=self.pause.seconds(),
                    is_sleeping=self.is_sleeping(),
                    peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    **(self.executor.collective_rpc("encoder_cache_stats")[0] if self.config.model_config.vision
                       else {}))

    # ---- LoRA adapters (engine/worker/lora.py: the residency rule; the worker's runner holds them) --------
    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        """Register a PEFT adapter under this id; False if the id is registered already (it keeps
        its adapter, as in vLLM). It is checked now (a bad one is refused and nothing changes) and
        loaded if a slot is free or can be freed; otherwise it loads when a request needs it."""
        if not isinstance(lora_int_id, int) or isinstance(lora_int_id, bool) or lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an int >= 1, got {lora_int_id!r}", "lora_int_id")
        if not self.config.enable_lora:
            raise EngineStateError("LoRA is off: start the engine with enable_lora=True (--enable-lora)")
        if self.loras.is_registered(lora_int_id):
            return False
        keep = self._loras_to_keep({r.lora_id for r in self.scheduler.requests.values()})
        try:
            self.executor.collective_rpc("add_lora", [lora_name, lora_int_id, lora_path, keep])
        except EngineStateError:
            pass  # every slot is pinned or in use: the runner checked the adapter before it looked for one
        if self.loras.register(lora_int_id, lora_name, lora_path):
            self.kv.reset_prefix_cache()  # other weights under this id: no KV of the old ones is reused
        return True

    def _loras_to_keep(self, in_use: set[int]) -> list[int]:
        """The adapters the worker must not evict: pinned ones and those requests use."""
        return sorted((in_use | self.loras.pinned) - {0})

    def _check_lora(self, lora_id: int, param: str) -> None:
        if not self.loras.is_registered(lora_id):
            raise InvalidRequestError(f"LoRA adapter {lora_id} is not loaded (add_lora first)", param)

    def _make_resident(self, lora_id: int) -> None:
        """Load a registered adapter that was evicted (from its folder), evicting the least recently
        used adapter that is neither pinned nor used by a running request. EngineStateError when
        every slot is."""
        if lora_id not in self._resident_loras():
            entry = self.loras.get(lora_id)
            keep = self._loras_to_keep({r.lora_id for r in self.scheduler.running})
            self._resident = None  # (it may evict one, or fail halfway)
            self.executor.collective_rpc("add_lora", [entry.name, lora_id, entry.path, keep])

    def _resident_loras(self) -> set[int]:
        """The adapters the worker holds, as it said when last asked: only the core's calls change
        them, and every control call forgets the answer (_drains_first), so a step that needs them
        asks the worker once after a change, not every step (with async scheduling the question
        would wait for the step in flight)."""
        if self._resident is None:
            self._resident = set(self.executor.collective_rpc("list_loras")[0])
        return self._resident

    def _load_step_loras(self, so) -> list[EngineCoreOutput]:
        """Make the adapters of the step's requests resident (the scheduler admitted no more than
        max_loras of them with the pinned ones, so slots exist). An adapter whose folder no longer
        loads fails its requests (an error output each) and leaves the step."""
        needed = {self.scheduler.requests[sr.request_id].lora_id for sr in so.scheduled} - {0}
        if not needed or needed <= self._resident_loras():
            return []
        failed: dict[str, Exception] = {}
        for lora_id in sorted(needed):
            try:
                self._make_resident(lora_id)
            except InvalidRequestError as e:
                failed.update({sr.request_id: e for sr in so.scheduled
                               if self.scheduler.requests[sr.request_id].lora_id == lora_id})
        if not failed:
            return []
        so.scheduled = [sr for sr in so.scheduled if sr.request_id not in failed]
        self.scheduler.abort(failed)
        return [EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT, error=str(e),
                                 error_type=type(e).__name__) for rid, e in failed.items()]

    def export_loras(self) -> list[dict]:
        """The registered adapters as a new replica needs them (scaling up): name, id, folder,
        version, pin, and a pushed adapter's tensors (they exist nowhere else; it is pinned, so
        resident)."""
        resident = {a["id"]: a for a in self.executor.collective_rpc("lora_state")[0]}
        return [dict(name=e.name, id=i, path=e.path, version=e.version, pinned=i in self.loras.pinned,
                     tensors=resident[i]["tensors"] if e.pushed else None)
                for i, e in self.loras.registered().items()]

    def import_loras(self, loras: list[dict]) -> bool:
        """Register what export_loras gave (a replica that joins by scaling); pinned ones first,
        so that they get their slots."""
        for a in sorted(loras, key=lambda a: not a["pinned"]):
            self.add_lora(a["name"], a["id"], a["path"])
            if a["tensors"] is not None:
                self._make_resident(a["id"])
                self.executor.collective_rpc("stage_weights", ["tensors", [a["tensors"]], a["id"]])
                self.executor.collective_rpc("commit_staged")
                self.loras.pushed(a["id"], a["version"], None)
            if a["pinned"]:
                self.pin_lora(a["id"])
            self.loras.get(a["id"]).version = a["version"]
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Unregister an adapter (False if it is not registered); refused while requests use it."""
        if not self.loras.is_registered(lora_id):
            return False
        if any(r.lora_id == lora_id for r in self.scheduler.requests.values()):
            raise EngineStateError(f"LoRA adapter {lora_id} is in use by requests in the engine")
        self.loras.unregister(lora_id)
        self.executor.collective_rpc("remove_lora", [lora_id])
        return True

    def pin_lora(self, lora_id: int) -> bool:
        """Keep this adapter resident (it holds one of the max_loras slots from now on)."""
        self._check_lora(lora_id, "lora_id")
        self._check_pin(lora_id)
        self._make_resident(lora_id)
        self.loras.pinned.add(lora_id)
        return True

    def _check_pin(self, lora_id: int) -> None:
        """A pin must leave a slot for every adapter that requests in the engine use (else they
        would wait forever)."""
        if lora_id in self.loras.pinned:
            return
        pinned = self.loras.pinned | {lora_id}
        stranded = sorted({r.lora_id for r in self.scheduler.requests.values()} - pinned - {0})
        if stranded and len(pinned) >= self.config.max_loras:
            raise EngineStateError(f"pinning LoRA adapter {lora_id} would leave no slot (max_loras "
                                   f"{self.config.max_loras}) for the adapters {stranded} that requests in the "
                                   "engine use", "lora_id")

    def list_loras(self) -> list[int]:
        """The resident adapters (at most max_loras); registered ones beyond them load on demand."""
        return self.executor.collective_rpc("list_loras")[0]

    def start_profile(self) -> bool:
        return self.profiler.start()

    def stop_profile(self) -> list[str]:
        """Write the trace; returns its path (engine/worker/profiler.py)."""
        return self.profiler.stop()

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        """Run a public worker method on every worker; one result per worker."""
        return self.executor.collective_rpc(method, args, kwargs)

    def save_sharded_state(self, path: str, pattern: str | None = None, max_size: int | None = None) -> dict:
        """Every rank writes its slices of the live weights into `path` (engine/worker/sharded_state.py)."""
        self._check_has_weights("to save")
        if "weights" in self.asleep:
            raise EngineStateError("the weights are asleep: wake_up(tags=['weights']) before saving them")
        saved = self.executor.collective_rpc("save_sharded_state", [path, pattern, max_size])
        return {"path": os.path.abspath(path), "files": [s["files"] for s in saved],
                "bytes": sum(s["bytes"] for s in saved), "weight_version": self.weight_version}

    def apply_model(self, fn: str) -> list[Any]:
        """fn(model) on every worker, one result per worker; `fn` is the function's import path
        (Worker.apply_model)."""
        return self.executor.collective_rpc("apply_model", [fn])

    def shutdown(self) -> None:
        self.scheduler.abort(list(self.scheduler.requests))
        self.executor.shutdown()
        if self._cpus_before is not None:
            os.sched_setaffinity(0, self._cpus_before)


def replica_part(handles: dict, replica: int) -> dict | None:
    """This replica's part of handles for several replicas, {"replicas": [parts, each with its
    "replica"]}; None where none names it."""
    parts = handles.get("replicas")
    if not isinstance(parts, list) or not all(isinstance(h, dict) and "replica" in h for h in parts):
        raise InvalidRequestError('handles for several replicas are {"replicas": [handles, each with its "replica"]}',
                                  "handles")
    mine = [h for h in parts if h["replica"] == replica]
    if len(mine) > 1:
        raise InvalidRequestError(f"the push has {len(mine)} parts for replica {replica} (one each)", "handles")
    return mine[0] if mine else None


@contextmanager
def _malformed_handles(source: str):
    """Malformed IPC handles are bad input (InvalidRequestError), not an engine failure."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as e:
        if source != "ipc" or isinstance(e, InvalidRequestError):
            raise
        raise InvalidRequestError(f"weight update from IPC handles: {e}") from e


def _drains_first(fn: Callable) -> Callable:
    """`fn` after the step in flight finished (async scheduling; its outputs are kept for
    take_pending_outputs), and after a weight update's receive beside the steps, unless `fn`
    cannot touch the weights (_BESIDE_STAGING); a Deferred it returns drains again before its
    finish. What the core knew of the worker's LoRA adapters is forgotten."""
    waits = fn.__name__ not in _BESIDE_STAGING

    @functools.wraps(fn)
    def call(self: EngineCore, *args, **kwargs):
        if waits:
            self._wait_for_staging()
        self._pending_outputs += self.drain()
        try:
            result = fn(self, *args, **kwargs)
        finally:
            self._resident = None  # (it may have loaded, evicted, pushed or dropped LoRA adapters)
        if isinstance(result, Deferred):
            finish = result.finish

            def drained_finish():
                self._pending_outputs += self.drain()
                try:
                    return finish()
                finally:
                    self._resident = None

            result.finish = drained_finish
        return result
    return call


# The calls that never drain: the request path (it only queues work for the scheduler), the loop's
# own, and reads of the core's state. Everything else may reach the workers or change what a step
# sees (a pause, a version, the KV cache), so it waits for the step in flight: new methods too.
_UNDRAINED = {"add_request", "add_stream_input", "abort_requests", "has_work", "seconds_to_next_event",
              "take_pending_outputs", "step", "drain", "shutdown", "is_paused", "is_sleeping", "get_weight_version"}
# The calls a receive beside the steps lets through (the pause that comes before the commit among
# them): they touch neither the weights, the spare nor the trainer's group.
_BESIDE_STAGING = {"pause_generation", "resume_generation", "get_stats", "reset_prefix_cache", "reset_encoder_cache",
                   "reset_mm_cache", "set_weight_version"}
for _name, _fn in list(vars(EngineCore).items()):
    if not _name.startswith("_") and _name not in _UNDRAINED and inspect.isfunction(_fn):
        setattr(EngineCore, _name, _drains_first(_fn))
