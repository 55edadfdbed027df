"""EngineCore: the owner of scheduling state. One step = schedule -> execute -> update.

It speaks token ids only (EngineCoreRequest in, EngineCoreOutput out). `LLM` can drive it in
process; normally it runs inside the engine-core process (engine/core_proc.py), whose busy
loop calls the same methods. Public methods are reachable by name as utility calls.
"""
import logging
import resource
from typing import Any, Optional

import torch

from engine.config import EngineConfig
from engine.errors import EngineStateError, InvalidRequestError
from engine.kv_cache import KVCacheManager
from engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, StreamInput
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerStats
from engine.worker import worker_class

logger = logging.getLogger("engine")


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.workers = [worker_class(config.worker_extension_cls)(config, rank=0)]
        self.runner = self.workers[0].model_runner
        num_blocks = self.runner.init_kv_cache()
        capacity = num_blocks * config.block_size
        if capacity < config.max_model_len:
            logger.warning("KV cache holds %d tokens < max_model_len %d; capping max_model_len",
                           capacity, config.max_model_len)
            config.max_model_len = capacity
        self.max_model_len = config.max_model_len
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.weight_version = 0
        self.num_generated_tokens = 0
        self.kv_asleep = False  # the KV cache is freed
        self.weights_asleep = False  # the weights are offloaded (level 1) or dropped (level 2)
        self._pending_outputs: list[EngineCoreOutput] = []  # produced outside step() (stream input)

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_can_generate()
        self._check_prompt(request.prompt_token_ids, request.request_id)
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        self.scheduler.add_request(Request(request))

    def add_stream_input(self, chunk: StreamInput) -> None:
        """Append the next input chunk to a streaming request (or close its input)."""
        req = self.scheduler.requests.get(chunk.request_id)
        if req is None or not req.streaming:
            raise InvalidRequestError(f"no streaming request {chunk.request_id!r} is running")
        if chunk.prompt_token_ids:
            self._check_prompt(req.all_token_ids + chunk.prompt_token_ids, chunk.request_id)
        out = self.scheduler.add_stream_input(req, chunk)
        if out is not None:
            self._pending_outputs.append(self._output(out, [], None))

    def _check_prompt(self, ids: list[int], request_id: str) -> None:
        if not ids:
            raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"request {request_id!r}: {len(ids)} tokens do not fit the context "
                                      f"(max_model_len {self.max_model_len})")
        vocab = self.config.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"request {request_id!r}: token ids must be in [0, {vocab})")

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        """Abort; returns the final outputs (finish_reason abort) of the requests that existed."""
        aborted = self.scheduler.abort(request_ids)
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], weight_version=self.weight_version,
                                 finish_reason=FinishReason.ABORT) for r in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Whether step() would compute something (idle streaming requests wait for input)."""
        if self._pending_outputs:
            return True
        return self._can_run() and bool(self.scheduler.running or self.scheduler.waiting)

    def _can_run(self) -> bool:
        return not (self.scheduler.paused or self.kv_asleep or self.weights_asleep) and self.runner.weights_valid

    def _check_can_generate(self) -> None:
        if self.is_sleeping():
            raise EngineStateError("the engine is asleep: call wake_up() before generating")
        if not self.runner.weights_valid:
            raise EngineStateError("the engine holds no weights (it slept at level 2): push weights "
                                   "or call reload_weights() before generating")

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self._can_run():
            return outputs
        so = self.scheduler.schedule()
        if not so.scheduled:
            return outputs
        ro = self.runner.execute(so, self.kv)
        for rid, (lps, top) in ro.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.prompt_logprobs.extend(lps)
                if top is not None:
                    req.prompt_top_logprobs.extend(top)
        for req in self.scheduler.update_after_step(so, ro.sampled):
            outputs.append(self._output(req, [req.last_sampled], ro))
        self.scheduler.start_pending_chunks()
        self.num_generated_tokens += len(ro.sampled)
        return outputs

    def _output(self, req: Request, tokens: list[int], ro) -> EngineCoreOutput:
        rid = req.request_id
        o = EngineCoreOutput(request_id=rid, new_token_ids=tokens, weight_version=self.weight_version,
                             finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                             num_cached_tokens=req.num_cached_tokens, resumable=req.resumable)
        if ro is not None and rid in ro.logprobs:
            o.new_logprobs = [ro.logprobs[rid]]
            if rid in ro.top_logprobs:
                o.new_top_logprobs = [ro.top_logprobs[rid]]
        if req.prompt_logprobs is not None and tokens and req.num_output_tokens == 1:
            o.prompt_logprobs = req.prompt_logprobs
            o.prompt_top_logprobs = req.prompt_top_logprobs
        return o

    # ---- utility methods (callable by name from the frontend) ----------------------------
    def reset_prefix_cache(self) -> bool:
        self.kv.reset_prefix_cache()
        return True

    def reset_encoder_cache(self) -> bool:
        """Text-only models have no encoder cache: nothing to clear."""
        return True

    def get_stats(self) -> dict:
        s: SchedulerStats = self.scheduler.stats()
        return dict(num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.kv_usage,
                    prefix_hit_rate=s.prefix_hit_rate, num_preemptions=s.num_preemptions,
                    num_prefill_tokens=s.num_prefill_tokens, num_generated_tokens=self.num_generated_tokens,
                    num_free_blocks=self.kv.num_free_blocks, num_blocks=self.kv.num_blocks,
                    weight_version=self.weight_version, is_paused=self.scheduler.paused,
                    is_sleeping=self.is_sleeping(),
                    peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    def get_weight_version(self) -> int:
        return self.weight_version

    def set_weight_version(self, version: int) -> int:
        """Relabel the current weights (vLLM's finish_weight_update sets the version after the
        transfer); tokens produced from now on carry it."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidRequestError(f"weight version must be an int, got {version!r}")
        self.weight_version = version
        return version

    # ---- RL control: pause, weights, sleep --------------------------------------------------
    def abort_all(self) -> int:
        """Abort every request; their final outputs (finish_reason abort) follow as outputs."""
        ids = list(self.scheduler.requests)
        self._pending_outputs.extend(self.abort_requests(ids))
        return len(ids)

    def pause_scheduling(self) -> bool:
        """Freeze running requests in place (pause mode "keep"); they keep their KV blocks."""
        self.scheduler.paused = True
        return True

    def resume_scheduling(self) -> bool:
        self.scheduler.paused = False
        return True

    def is_scheduling_paused(self) -> bool:
        return self.scheduler.paused

    def _check_can_update(self) -> None:
        if self.scheduler.has_active() and not self.scheduler.paused:
            raise EngineStateError("requests are running: pause generation before updating the weights")

    def _after_update(self, version: Optional[int]) -> int:
        """A successful update: new version, and no KV computed by the old weights is reused."""
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        self.kv.reset_prefix_cache()
        self.reset_encoder_cache()
        return self.weight_version

    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int,
                             backend: str = "gloo", timeout_s: float = 60.0) -> list[int]:
        """Every worker joins the trainer's group (trainer rank 0, workers 1..N)."""
        return self.collective_rpc("init_weight_transfer", [master_address, master_port, world_size],
                                   {"backend": backend, "timeout_s": timeout_s})

    def close_weight_transfer(self) -> bool:
        self.collective_rpc("close_weight_transfer")
        return True

    def update_weights(self, version: Optional[int] = None) -> dict:
        """Receive one broadcast push from the trainer and swap it in (between steps)."""
        self._check_can_update()
        stats = self.collective_rpc("receive_weights")[0]
        return dict(stats, weight_version=self._after_update(version))

    def update_weights_from_disk(self, path: str, version: Optional[int] = None) -> dict:
        self._check_can_update()
        stats = self.collective_rpc("update_weights_from_disk", [path])[0]
        return dict(stats, weight_version=self._after_update(version))

    def update_weights_from_tensors(self, named_tensors, version: Optional[int] = None) -> dict:
        self._check_can_update()
        stats = self.collective_rpc("update_weights_from_tensors", [list(named_tensors)])[0]
        return dict(stats, weight_version=self._after_update(version))

    def update_weights_from_ipc(self, handles: dict, version: Optional[int] = None) -> dict:
        self._check_can_update()
        try:
            stats = self.collective_rpc("update_weights_from_ipc", [handles])[0]
        except InvalidRequestError:
            raise
        except (ValueError, TypeError, KeyError) as e:  # malformed handles are bad input
            raise InvalidRequestError(f"weight update from IPC handles: {e}") from e
        return dict(stats, weight_version=self._after_update(version))

    def reload_weights(self, version: Optional[int] = None) -> dict:
        """Explicitly reload the startup checkpoint (a level-2 sleep never does it by itself)."""
        self._check_can_update()
        stats = self.collective_rpc("reload_weights")[0]
        return dict(stats, weight_version=self._after_update(version))

    def weights_checksum(self) -> str:
        return self.collective_rpc("weights_checksum")[0]

    def sleep(self, level: int = 1) -> bool:
        """Free the KV cache (and at level 2 the weights). Requests still in the engine (pause
        "keep") lose their KV and are recomputed after wake-up."""
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
        if self.scheduler.has_active() and not self.scheduler.paused:
            raise EngineStateError("requests are running: pause generation before sleeping")
        self.scheduler.preempt_all()
        self.kv.reset_prefix_cache()
        self.collective_rpc("sleep", [level])
        self.kv_asleep = self.weights_asleep = True
        return True

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        tags = list(tags or ["weights", "kv_cache"])
        if not set(tags) <= {"weights", "kv_cache"}:
            raise InvalidRequestError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {tags}")
        self.collective_rpc("wake_up", [tags])
        self.kv_asleep = self.kv_asleep and "kv_cache" not in tags
        self.weights_asleep = self.weights_asleep and "weights" not in tags
        return True

    def is_sleeping(self) -> bool:
        return self.kv_asleep or self.weights_asleep

    def collective_rpc(self, method: str, args: Optional[list] = None, kwargs: Optional[dict] = None) -> list[Any]:
        """Run a public worker method on every worker; one result per worker."""
        if not isinstance(method, str) or method.startswith("_"):
            raise ValueError(f"collective_rpc: {method!r} is not a public worker method")
        results = []
        for w in self.workers:
            fn = getattr(w, method, None)
            if not callable(fn):
                raise ValueError(f"collective_rpc: the worker has no method {method!r}")
            results.append(fn(*(args or ()), **(kwargs or {})))
        return results

    def shutdown(self) -> None:
        self.scheduler.abort(list(self.scheduler.requests))
