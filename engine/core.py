"""EngineCore: the owner of scheduling state. One step = schedule -> execute -> update.

It speaks token ids only (EngineCoreRequest in, EngineCoreOutput out). `LLM` drives it in
process; the engine-core process (issue 3) drives the same class from its busy loop.
"""
import logging
import time

import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerStats

logger = logging.getLogger("engine")


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.runner = ModelRunner(config)
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

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        ids = request.prompt_token_ids
        if not ids or len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt of {len(ids)} tokens does not fit max_model_len {self.max_model_len}")
        vocab = self.config.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        self.scheduler.add_request(Request(request))

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        if not so.scheduled:
            return []
        ro = self.runner.execute(so, self.kv)
        for rid, (lps, top) in ro.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.prompt_logprobs.extend(lps)
                if top is not None:
                    req.prompt_top_logprobs.extend(top)
        progressed = self.scheduler.update_after_step(so, ro.sampled)
        outputs = []
        v = self.weight_version
        for req in progressed:
            rid = req.request_id
            o = EngineCoreOutput(request_id=rid, new_token_ids=[req.all_token_ids[-1]], weight_version=v,
                                 finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                                 num_cached_tokens=req.num_cached_tokens)
            if rid in ro.logprobs:
                o.new_logprobs = [ro.logprobs[rid]]
                if rid in ro.top_logprobs:
                    o.new_top_logprobs = [ro.top_logprobs[rid]]
            if req.prompt_logprobs is not None and req.num_output_tokens == 1:
                o.prompt_logprobs = req.prompt_logprobs
                o.prompt_top_logprobs = req.prompt_top_logprobs
            outputs.append(o)
        self.num_generated_tokens += len(progressed)
        return outputs

    def abort_outputs(self, request_ids) -> list[EngineCoreOutput]:
        """Abort and return the matching final outputs (finish_reason abort)."""
        aborted = self.scheduler.abort(request_ids)
        return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], weight_version=self.weight_version,
                                 finish_reason=FinishReason.ABORT) for r in aborted]

    def reset_prefix_cache(self) -> bool:
        self.kv.reset_prefix_cache()
        return True

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.stats()
