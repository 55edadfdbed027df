"""Continuous batching without phases (vLLM v1): every request has num_computed_tokens and a
target (num_tokens); each step hands out tokens from a budget until requests catch up.
That one rule covers chunked prefill, prefix-cache hits, decode, and recompute after
preemption. Running requests go first, in arrival order; when blocks run out, the most
recently admitted running request is preempted (its blocks freed, recomputed later).
"""
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from engine.kv_cache import KVCacheManager
from engine.protocol import FinishReason, StreamInput
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The requests to run this step and how many tokens each computes."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_hit_rate: float
    num_preemptions: int
    num_prefill_tokens: int  # prompt tokens computed (not served from the cache) so far


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.kv = kv
        self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len = (
            max_num_seqs, max_num_batched_tokens, max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.idle: dict[str, Request] = {}  # streaming-input requests waiting for their next chunk
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        self._next_chunk_after_output: list[tuple[Request, StreamInput]] = []
        self.paused = False  # pause mode "keep": nothing is scheduled, requests keep their state

    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id!r}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_active(self) -> bool:
        """Requests that are running or waiting to run (idle streaming requests excluded)."""
        return bool(self.running or self.waiting)

    def preempt_all(self) -> None:
        """Free every request's KV blocks; they recompute from scratch when scheduled again."""
        while self.running:
            self._preempt(self.running.pop())
        while self._preempt_idle():
            pass
        for req in self.waiting:
            if req.num_computed_tokens:
                self.kv.free(req)
                req.num_computed_tokens = 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            assert n > 0, "a running request has nothing to compute"
            while not self.kv.allocate_slots(req, n):
                if self._preempt_idle():
                    continue
                victim = self.running.pop()  # latest admitted; not yet scheduled this step
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
                i += 1
        if out.num_preempted:
            return out  # admit nothing while memory is short
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed_tokens == 0:
                computed, num_hit = self.kv.get_computed_blocks(req)
            else:  # a streaming request's next chunk: it kept its blocks
                computed, num_hit = [], req.num_computed_tokens
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, computed):
                if self._preempt_idle():
                    continue
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING and req.num_computed_tokens == 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        return out

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

    def update_after_step(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests. Returns the
        requests that received a token this step (finished ones included)."""
        progressed = []
        for req, n in out.scheduled:
            if req.is_finished:  # aborted while the step ran
                continue
            if req.num_computed_tokens < req.chunk_start:  # the prompt, or a streaming chunk's new input
                self.num_prefill_tokens += min(n, req.chunk_start - req.num_computed_tokens)
            req.num_computed_tokens += n
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end
            if req.append_token(token, self.max_model_len):
                if req.input_closed and not req.pending_inputs:
                    self._finish(req, req.finish_reason)
                else:
                    self._end_chunk(req)
            progressed.append(req)
        return progressed

    # ---- streaming input ----------------------------------------------------------------
    def _end_chunk(self, req: Request) -> None:
        """A streaming request finished generating for its current chunk."""
        req.resumable = True
        if req.pending_inputs:
            # the output for this step still reports the ended chunk; the next one starts now
            chunk = req.pending_inputs.popleft()
            self._next_chunk_after_output.append((req, chunk))
            return
        self.running.remove(req)
        req.status = RequestStatus.IDLE
        self.idle[req.request_id] = req

    def add_stream_input(self, req: Request, chunk: StreamInput) -> Optional[Request]:
        """Queue or apply the next chunk; returns req if closing its input finished it."""
        if not chunk.prompt_token_ids:  # only closes the input stream
            if req.pending_inputs:
                req.pending_inputs[-1].final = True
            elif req.status == RequestStatus.IDLE:  # nothing more to do: the request is done
                req.resumable = False
                self._finish(req, req.finish_reason)
                return req
            else:
                req.input_closed = True
            return None
        if req.status != RequestStatus.IDLE:
            req.pending_inputs.append(chunk)
            return None
        del self.idle[req.request_id]
        req.apply_input(chunk)
        req.status = RequestStatus.WAITING if req.num_computed_tokens == 0 else RequestStatus.PREEMPTED
        self.waiting.append(req)
        return None

    def start_pending_chunks(self) -> None:
        """Apply the chunks queued behind chunks that ended this step (after their outputs)."""
        for req, chunk in self._next_chunk_after_output:
            if not req.is_finished:
                req.apply_input(chunk)
        self._next_chunk_after_output.clear()

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, FinishReason.ABORT)
                aborted.append(req)
        return aborted

    def _finish(self, req: Request, reason: Optional[FinishReason]) -> None:
        req.finish_reason = reason
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.IDLE:
            del self.idle[req.request_id]
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        del self.requests[req.request_id]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.kv.prefix_hit_rate,
                              self.num_preemptions, self.num_prefill_tokens)
