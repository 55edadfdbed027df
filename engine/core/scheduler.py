"""Continuous batching without phases (vLLM v1): every request has num_computed_tokens and a
target (num_tokens); each step hands out tokens from a budget until requests catch up.
That one rule covers chunked prefill, prefix-cache hits, decode, and recompute after
preemption. Running requests go first, in arrival order; when blocks run out, the most
recently admitted running request is preempted (its blocks freed, recomputed later).

    schedule() -> SchedulerOutput (everything the workers need) -> workers -> ModelRunnerOutput
    -> update_from_output() -> EngineCoreOutputs (one per request that got a token)

Queues: waiting -> running; idle (streaming-input requests between chunks, holding their
blocks: engine/core/streaming.py); held (requests that arrived while generation is paused);
versions.awaiting (requests whose min_weight_version the live weights have not reached: no blocks;
engine/core/staleness.py, which also says which requests a new weight version leaves stale).
The pause is the engine core's (engine/core/pause.py): the scheduler reads it.

A request's computed tokens are counted when they are scheduled, and a step that samples leaves a
placeholder until its output arrives, so the next step can be scheduled while this one runs (async
scheduling, engine/core/engine_core.py): a running request whose sample is still in flight gets a
one-token decode of that placeholder (the worker fills it in), unless the sample may end it
(max_tokens, the context). An output is applied only while it still extends its request: one that
step N ended (a stop token, the end of a streaming chunk) drops step N+1's token.

LoRA slots (vLLM's rule): the running requests use at most max_loras adapters, pinned ones
counted (they keep their slot), so the worker can hold every adapter of a step. A waiting request
whose adapter has no slot waits; so do the requests behind it that would keep an unpinned
adapter's slot busy (otherwise a stream of them could starve it), while base-model requests and
those of pinned adapters pass it.
"""
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from engine.core.kv_cache import KVCacheManager
from engine.core.pause import Pause, PauseState
from engine.core.request import Request, RequestStatus
from engine.core.staleness import VersionRules
from engine.core.streaming import StreamState
from engine.protocol import EngineCoreOutput, FinishReason, StreamInput
from engine.step_io import (PLACEHOLDER_TOKEN, ModelRunnerOutput, NewRequestData, ScheduledRequest,
                            SchedulerOutput)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int  # held requests (arrived while paused) and those awaiting a weight version included
    kv_usage: float
    prefix_hit_rate: float
    num_preemptions: int
    num_prefill_tokens: int  # prompt tokens computed (not served from the cache) so far
    num_stale_finished: int = 0  # requests max_weight_staleness ended (finish_reason "stale")
    num_stale_restarted: int = 0  # ... and restarted from their prompts (stale_action "restart")


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 max_loras: int = 0, pause: Pause | None = None, pinned_loras: set[int] | None = None):
        self.kv = kv
        self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len = (
            max_num_seqs, max_num_batched_tokens, max_model_len)
        self.max_loras = max_loras  # LoRA slots (0: no adapters)
        self.pinned_loras = pinned_loras if pinned_loras is not None else set()  # the core's LoRARegistry.pinned
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.idle: dict[str, Request] = {}  # streaming-input requests waiting for their next chunk
        self.held: deque[Request] = deque()  # arrived while paused; admitted on resume
        self.versions = VersionRules()  # requests waiting for a weight version; stale counts
        self.requests: dict[str, Request] = {}
        self.pause = pause or Pause()  # the engine core's: it changes it, then calls pause_changed()
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        # what the workers learn with the next SchedulerOutput
        self._new_requests: list[NewRequestData] = []
        self._finished_ids: list[str] = []

    # ---- requests in ----------------------------------------------------------------------
    def add_request(self, req: Request, weight_version: int = 0) -> None:
        """Admit req; `weight_version`: the live one (a min_weight_version above it waits)."""
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id!r}"
        self.requests[req.request_id] = req
        self._announce(req)
        if self.versions.must_wait(req, weight_version):
            req.status = RequestStatus.AWAITING_WEIGHTS
            self.versions.awaiting.append(req)
        else:
            self._enqueue(req)

    def _announce(self, req: Request) -> None:
        """Tell the workers about req's (new) sampling params with the next step."""
        p = req.params
        self._new_requests.append(NewRequestData(req.request_id, p, None if p.prompt_logprobs is None
                                                 else req.prompt_token_ids, req.lora_id, req.mm_features))

    def _enqueue(self, req: Request) -> None:
        """req has tokens to compute: it waits for a slot, or for the resume while paused."""
        if not self.pause.active:
            req.status = RequestStatus.WAITING if req.num_computed_tokens == 0 else RequestStatus.PREEMPTED
            self.waiting.append(req)
        else:
            req.status = RequestStatus.HELD
            self.held.append(req)

    def pause_changed(self) -> None:
        """The engine core changed the pause: once lifted, the held requests are admitted."""
        if not self.pause.active:
            held, self.held = self.held, deque()
            for req in held:
                self._enqueue(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_active(self) -> bool:
        """Requests admitted to run (running or waiting); idle and held ones excluded."""
        return bool(self.running or self.waiting)

    def can_step(self) -> bool:
        return self.pause.state is not PauseState.PAUSED_ALL and self.has_active()

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(new_requests=self._new_requests, finished_req_ids=self._finished_ids)
        self._new_requests, self._finished_ids = [], []
        if self.pause.state is PauseState.PAUSED_ALL:
            return out
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_placeholders and self._may_end(req):
                i += 1  # its sample in flight may be its last: wait for it
                continue
            n = min(req.num_tokens + req.num_placeholders - req.num_computed_tokens, budget)
            assert n > 0, "a running request has nothing to compute"
            while not self.kv.allocate_slots(req, n):
                if self._preempt_idle() or self._preempt_waiting(None):
                    continue
                victim = self.running.pop()  # latest admitted; not yet scheduled this step
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, n))
                budget -= n
                i += 1
        if out.num_preempted:
            return out  # admit nothing while memory is short
        loras = {r.lora_id for r in self.running if r.lora_id} | self.pinned_loras  # the slots in use
        skipped: list[Request] = []  # waiting for a LoRA slot, in queue order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.lora_id and req.lora_id not in self.pinned_loras and (
                    skipped  # one ahead waits for a slot
                    or req.lora_id not in loras and len(loras) >= self.max_loras):
                skipped.append(self.waiting.popleft())
                continue
            if req.num_computed_tokens == 0 and req.params.pooling != "mean":
                computed, num_hit = self.kv.get_computed_blocks(req)
            elif req.num_computed_tokens == 0:  # mean pooling needs every prompt token's hidden state
                computed, num_hit = [], 0
            else:  # a streaming request's next chunk: it kept its blocks
                computed, num_hit = [], req.num_computed_tokens
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, computed):
                if self._preempt_idle() or not self.running and self._preempt_waiting(req):
                    continue
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING and req.num_computed_tokens == 0:
                req.num_cached_tokens = num_hit
                req.scheduled_time = time.monotonic()
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n
            if req.lora_id:
                loras.add(req.lora_id)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _may_end(self, req: Request) -> bool:
        """Whether the sample in flight may end req's chunk (besides a stop token, which only its
        output tells): a pooling request's one output, max_tokens, the context."""
        max_tokens = req.params.max_tokens
        pending = req.num_tokens + req.num_placeholders
        return (req.params.pooling is not None or pending >= self.max_model_len
                or max_tokens is not None and pending - req.chunk_start >= max_tokens)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        """req's next n tokens, counted as computed from now on."""
        s = req.num_computed_tokens
        tokens = req.all_token_ids[s:s + n]
        sample = s + n == req.num_tokens + req.num_placeholders
        banned = req.banned_token_ids if sample else None
        if len(tokens) < n:
            assert n == 1, "only a decode reads a token still in flight"
            tokens = [PLACEHOLDER_TOKEN]
        req.num_computed_tokens = s + n
        if sample:
            req.num_placeholders += 1
        return ScheduledRequest(req.request_id, s, tokens, self.kv.block_ids(req.request_id), sample, banned)

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput, weight_version: int,
                           lora_version: Callable[[int], int | None] | None = None) -> list[EngineCoreOutput]:
        """Append sampled tokens, end chunks and requests. Returns an output for every request
        that received a token this step (finished ones included); `lora_version`: LoRA adapter
        id -> the version its tokens carry."""
        outputs = []
        for sr in out.scheduled:
            rid = sr.request_id
            req = self.requests.get(rid)
            if req is None:  # aborted while the step ran
                continue
            n = len(sr.token_ids)
            prefill = sr.start < req.chunk_start
            if prefill:  # the prompt, or a streaming chunk's new input
                self.num_prefill_tokens += min(n, req.chunk_start - sr.start)
            if rid in result.prompt_logprobs:
                lps, top = result.prompt_logprobs[rid]
                req.prompt_logprobs.extend(lps)
                if top is not None:
                    req.prompt_top_logprobs.extend(top)
            if rid in result.pooled:  # an encode request: done, nothing generated
                req.finish_reason = FinishReason.STOP
                o = self._output(req, [], weight_version)
                o.pooled = result.pooled[rid]
                outputs.append(o)
                self._finish(req, FinishReason.STOP)
                continue
            token = result.sampled.get(rid)
            if token is None:
                continue  # a prefill chunk that did not reach the end
            if req.num_void_samples:  # sampled after the chunk it belonged to ended
                req.num_void_samples -= 1
                continue
            req.num_placeholders -= 1
            ended = req.append_token(token, self.max_model_len)
            o = self._output(req, [token], weight_version)
            if prefill:  # the prompt's first token: when the request arrived here and first ran (tracing)
                o.timings = (req.arrival_time, req.scheduled_time)
            if req.lora_id and lora_version is not None:
                o.lora_version = lora_version(req.lora_id)
            if rid in result.logprobs:
                o.new_logprobs = [result.logprobs[rid]]
                if rid in result.top_logprobs:
                    o.new_top_logprobs = [result.top_logprobs[rid]]
            if result.sampling_masks and rid in result.sampling_masks:
                o.new_sampling_masks = [result.sampling_masks[rid]]
            if result.routed_experts and rid in result.routed_experts:
                o.routed_experts = result.routed_experts[rid]
            outputs.append(o)
            if ended:
                o.resumable = self._end_chunk(req)
        return outputs

    def _output(self, req: Request, tokens: list[int], weight_version: int) -> EngineCoreOutput:
        o = EngineCoreOutput(request_id=req.request_id, new_token_ids=tokens, weight_version=weight_version,
                             finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                             num_cached_tokens=req.num_cached_tokens)
        if req.prompt_logprobs is not None and tokens and req.num_output_tokens == 1:
            o.prompt_logprobs = req.prompt_logprobs
            o.prompt_top_logprobs = req.prompt_top_logprobs
        return o

    # ---- streaming input (the state machine is engine/core/streaming.py) --------------------------
    def _end_chunk(self, req: Request) -> bool:
        """The request's current chunk ended (stop or length); returns whether the request goes on.
        Samples of the chunk still in flight are dropped when they arrive."""
        req.num_void_samples += req.num_placeholders
        req.num_placeholders = 0
        if req.stream is None:
            self._finish(req, req.finish_reason)
            return False
        next_chunk = req.stream.on_chunk_end()
        if next_chunk is not None:  # it keeps running with the queued chunk
            self._start_chunk(req, next_chunk)
        elif req.stream.state is StreamState.CLOSED:
            self._finish(req, req.finish_reason)
        else:  # (preempted while its last sample was in flight, it waits to be recomputed)
            (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
            req.status = RequestStatus.IDLE
            self.idle[req.request_id] = req
        return req.stream.resumable

    def add_stream_input(self, req: Request, chunk: StreamInput) -> EngineCoreOutput | None:
        """Queue or start the next chunk; returns the final output if closing the input ended it."""
        start = req.stream.on_input(chunk)
        if req.stream.state is StreamState.CLOSED:  # closed while awaiting input: done
            self._finish(req, req.finish_reason)
            return self._output(req, [], 0)
        if start is not None:
            del self.idle[req.request_id]
            self._start_chunk(req, start)
            self._enqueue(req)
        return None

    def _start_chunk(self, req: Request, chunk: StreamInput) -> None:
        req.apply_input(chunk)
        # at least one token to compute, for the logits of the chunk's first sample (a dropped
        # sample in flight may have computed the last one already, and the input may be empty)
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        if chunk.sampling_params is not None:
            self._announce(req)

    # ---- a new weight version (engine/core/staleness.py) -------------------------------------------
    def weights_changed(self, old_version: int, new_version: int) -> list[EngineCoreOutput]:
        """The live version moved: requests past their max_weight_staleness finish ("stale") or
        restart, and those waiting for this version are admitted. Returns the outputs to send."""
        outputs = []
        for req in self.versions.stale(list(self.requests.values()), old_version, new_version):
            if req.params.stale_action == "restart":
                self._restart(req)
                outputs.append(EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                                weight_version=new_version, restarted=True))
            else:
                self._finish(req, FinishReason.STALE)
                outputs.append(self._output(req, [], new_version))
        for req in self.versions.release(new_version):
            self._enqueue(req)
        return outputs

    def _restart(self, req: Request) -> None:
        """Discard req's generated tokens and KV: it generates again from its prompt, and the
        workers start it afresh (a seeded request draws from the start of its seed again)."""
        assert req.stream is None, "streaming input cannot restart (check_streaming_params refuses it)"
        self.kv.free(req)
        req.restart()
        if req.status == RequestStatus.RUNNING:  # to the front of the queue, as a preempted request
            self.running.remove(req)
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)
        self._finished_ids.append(req.request_id)  # (the workers drop it, then load it anew)
        self._announce(req)

    # ---- preemption, abort, finish -------------------------------------------------------------
    def preempt_all(self) -> None:
        """Free every request's KV blocks; they recompute from scratch when scheduled again."""
        while self.running:
            self._preempt(self.running.pop())
        while self._preempt_idle():
            pass
        for req in (*self.waiting, *self.held):
            if req.num_computed_tokens:
                self.kv.free(req)
                req.num_computed_tokens = 0

    def _preempt_waiting(self, head: Request | None) -> bool:
        """Free the blocks of one waiting request other than `head` (a streaming request's next
        chunk keeps its blocks while it waits): running requests and the head of the queue come
        first, or memory held by requests that cannot run yet could stall those that can."""
        for req in reversed(self.waiting):
            if req is not head and req.num_computed_tokens:
                self.kv.free(req)
                req.num_computed_tokens = 0
                self.num_preemptions += 1
                return True
        return False

    def _preempt_idle(self) -> bool:
        """Free the blocks of one idle streaming request (it recomputes on its next chunk)."""
        for req in self.idle.values():
            if req.num_computed_tokens:
                self.kv.free(req)
                req.num_computed_tokens = 0
                self.num_preemptions += 1
                return True
        return False

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, FinishReason.ABORT)
                aborted.append(req)
        return aborted

    def _finish(self, req: Request, reason: FinishReason | None) -> None:
        req.finish_reason = reason
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.IDLE:
            del self.idle[req.request_id]
        elif req.status == RequestStatus.HELD:
            self.held.remove(req)
        elif req.status == RequestStatus.AWAITING_WEIGHTS:
            self.versions.awaiting.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.held) + len(self.versions.awaiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), self.num_waiting, self.kv.usage, self.kv.prefix_hit_rate,
                              self.num_preemptions, self.num_prefill_tokens, self.versions.num_stale["finish"],
                              self.versions.num_stale["restart"])
