"""The frontend's half of every request: incremental detokenization, stop strings, n > 1
fan-in, and assembly of RequestOutputs from the core's per-step EngineCoreOutputs.

`process_outputs` is the only function that loops over a step's EngineCoreOutputs: one pass
does detokenization, stop checks and output assembly.
"""
import time
from dataclasses import dataclass, field
from typing import Mapping

from tokenizers.decoders import DecodeStream

from engine.errors import InvalidRequestError, remote_error
from engine.frontend.metrics import FrontendStats
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.frontend.tracing import RequestTracer
from engine.protocol import EngineCoreOutput, FinishReason, SamplingMask
from engine.routed_experts import RoutedExperts
from engine.sampling_params import RequestOutputKind, SamplingParams


class Detokenizer:
    """Text of a growing list of token ids, one token at a time."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""

    def reset(self) -> None:
        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)


@dataclass
class SequenceState:
    """One generated sequence (a child when n > 1)."""

    index: int
    params: SamplingParams
    detok: Detokenizer | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    sampling_masks: list[SamplingMask] | None = None
    weight_versions: list[int] = field(default_factory=list)
    lora_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: object | None = None
    resumable: bool = False  # streaming input: the chunk ended, the request goes on
    sent_tokens: int = 0  # for DELTA outputs: how much was already handed out
    sent_chars: int = 0
    routed: RoutedExperts | None = None  # return_routed_experts: the rows so far, by position
    sent_routed: int = 0

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []
            if self.params.logprobs:
                self.top_logprobs = []
        self.sampling_masks = [] if self.params.return_sampling_mask else None

    def restart(self) -> None:
        """The core discarded this sequence's tokens (stale_action "restart"): so does the frontend."""
        self.text, self.token_ids, self.weight_versions, self.lora_versions = "", [], [], []
        self.logprobs = self.top_logprobs = None
        self.finish_reason = self.stop_reason = None
        self.sent_tokens = self.sent_chars = 0  # (a DELTA stream cannot restart: SamplingParams refuses it)
        if self.routed is not None:  # (the prompt's rows come again with the new first token)
            self.routed = RoutedExperts(self.routed.num_layers, self.routed.top_k)
        self.__post_init__()
        if self.detok is not None:
            self.detok.reset()


@dataclass
class RequestState:
    """One request as the caller sees it; `children` holds the core request ids (n of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SequenceState]
    children: dict[str, int]  # core request id -> sequence index
    prompt_logprobs: list | None = None
    prompt_top_logprobs: list | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None  # time.monotonic() when its first token arrived here
    queue: object = None  # the AsyncLLM's per-request queue (None offline)
    arrival_time: float = field(default_factory=time.monotonic)
    pooled: list[float] | None = None  # an encode request's result
    # tracing (engine/frontend/tracing.py): the span's parent; the core's (arrived, first scheduled)
    # and its clock at the first token
    trace_context: object = None
    core_timings: tuple[float, float] | None = None
    first_token_core_time: float = 0.0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None and not s.resumable for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer, tracer: RequestTracer | None = None, routing_shape: tuple[int, int] | None = None):
        """routing_shape: (num_layers, top_k) of an engine that keeps routed experts, else None."""
        self.tokenizer = tokenizer
        self.routing_shape = routing_shape
        self.tracer = tracer  # None: tracing off (one span per ended request when on)
        self.requests: dict[str, RequestState] = {}  # caller's request id -> state
        self.child_to_parent: dict[str, str] = {}
        self.stats = FrontendStats()  # finished requests, for get_metrics()

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], queue=None,
                    trace_headers: Mapping[str, str] | None = None) -> RequestState:
        seqs = [SequenceState(i, params, Detokenizer(self.tokenizer, params.skip_special_tokens)
                              if params.detokenize else None) for i in range(len(child_ids))]
        if params.return_routed_experts and self.routing_shape is not None:
            for seq in seqs:
                seq.routed = RoutedExperts(*self.routing_shape)
        state = RequestState(request_id, prompt, prompt_token_ids, params, seqs,
                             {cid: i for i, cid in enumerate(child_ids)}, queue=queue)
        if self.tracer is not None:
            state.trace_context = self.tracer.parent_context(trace_headers)
        self.requests[request_id] = state
        for cid in child_ids:
            self.child_to_parent[cid] = request_id
        return state

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput], timestamp: float = 0.0
                        ) -> tuple[list[tuple[RequestState, object]], list[str]]:
        """Returns (request outputs to hand out, core request ids to abort: stop strings hit).
        An output is a RequestOutput, or an InvalidRequestError the core raised for the request.
        `timestamp`: the core's clock when it sent these outputs (EngineCoreOutputs.timestamp)."""
        ready: dict[str, RequestState] = {}
        to_abort: list[str] = []
        failed = []
        for o in outputs:
            parent_id = self.child_to_parent.get(o.request_id)
            if parent_id is None:
                continue  # aborted by the caller meanwhile
            state = self.requests[parent_id]
            if o.error is not None:  # the core refused it: fail the whole request
                to_abort.extend(c for c in self.abort(parent_id) if c != o.request_id)
                ready.pop(parent_id, None)
                failed.append((state, remote_error(o.error_type, o.error, default=InvalidRequestError)))
                continue
            seq = state.seqs[state.children[o.request_id]]
            if o.restarted:  # nothing to hand out: its next token starts the sequence again
                seq.restart()
                state.prompt_logprobs = state.prompt_top_logprobs = None  # the new weights' come with it
                continue
            if o.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = o.prompt_logprobs
                if o.prompt_top_logprobs is not None:
                    state.prompt_top_logprobs = [None if t is None else dict(t) for t in o.prompt_top_logprobs]
            if o.pooled is not None:
                state.pooled = o.pooled
            if o.new_token_ids:
                state.num_cached_tokens = max(state.num_cached_tokens, o.num_cached_tokens)
                if state.first_token_time is None:
                    state.first_token_time = time.monotonic()
                    state.first_token_core_time, state.core_timings = timestamp, o.timings
            if o.routed_experts is not None and self.routing_shape is not None:
                if seq.routed is None:  # a streaming-input chunk's params asked for them
                    seq.routed = RoutedExperts(*self.routing_shape)
                seq.routed.place(*o.routed_experts)
            stopped = self._append(seq, o)
            if stopped:
                to_abort.append(o.request_id)
            if seq.finish_reason is not None and not seq.resumable:
                self.child_to_parent.pop(o.request_id, None)
            ready[parent_id] = state
        results = failed
        for state in ready.values():
            out = self.make_output(state)
            if out is not None:
                results.append((state, out))
            if state.finished:
                del self.requests[state.request_id]
                self._observe(state, timestamp)
        return results, to_abort

    def _observe(self, state: RequestState, timestamp: float = 0.0) -> None:
        """A request ended (finished, or aborted: timestamp 0.0): its stats, and its span when tracing."""
        self.stats.observe(state.arrival_time, state.first_token_time, len(state.prompt_token_ids),
                           sum(len(s.token_ids) for s in state.seqs),
                           [s.finish_reason or str(FinishReason.ABORT) for s in state.seqs])
        if self.tracer is not None:
            self.tracer.emit(state, timestamp)

    def _append(self, seq: SequenceState, o: EngineCoreOutput) -> bool:
        """Add one step's tokens; True if a stop string ended the sequence here."""
        params = seq.params
        new_text = []
        for i, t in enumerate(o.new_token_ids):
            seq.token_ids.append(t)
            seq.weight_versions.append(o.weight_version)
            if o.lora_version is not None:
                seq.lora_versions.append(o.lora_version)
            if seq.logprobs is not None and o.new_logprobs is not None:
                seq.logprobs.append(o.new_logprobs[i])
                if seq.top_logprobs is not None and o.new_top_logprobs is not None:
                    seq.top_logprobs.append(dict(o.new_top_logprobs[i]))
            if seq.sampling_masks is not None and o.new_sampling_masks is not None:
                seq.sampling_masks.append(o.new_sampling_masks[i])
            if seq.detok is not None:
                new_text.append(seq.detok.step(t))
        if o.new_token_ids and seq.resumable:  # the next streaming-input chunk is generating
            seq.finish_reason = seq.stop_reason = None
            seq.resumable = False
        if o.finish_reason is not None:
            seq.finish_reason = str(o.finish_reason)
            seq.stop_reason = o.stop_reason
            seq.resumable = o.resumable
        if not new_text:
            return False
        old_len = len(seq.text)
        seq.text += "".join(new_text)
        if params.stop and o.finish_reason in (None, FinishReason.LENGTH, FinishReason.STOP):
            hit = _find_stop(seq.text, params.stop, old_len)
            if hit is not None:
                pos, stop = hit
                seq.text = seq.text[:pos + len(stop)] if params.include_stop_str_in_output else seq.text[:pos]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return o.finish_reason is None
        return False

    def make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for seq in state.seqs:
            if kind == RequestOutputKind.DELTA:
                completions.append(self._delta(seq))
            else:
                completions.append(CompletionOutput(
                    index=seq.index, text=seq.text if seq.finish_reason else _held_back(seq),
                    token_ids=list(seq.token_ids), logprobs=_copy(seq.logprobs),
                    top_logprobs=_copy(seq.top_logprobs), sampling_masks=_copy(seq.sampling_masks),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason, weight_versions=list(seq.weight_versions),
                    lora_versions=list(seq.lora_versions),
                    routed_experts=None if seq.routed is None else seq.routed.view()))
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
                             prompt_logprobs=state.prompt_logprobs, prompt_top_logprobs=state.prompt_top_logprobs,
                             num_cached_tokens=state.num_cached_tokens, first_token_time=state.first_token_time,
                             pooled=state.pooled)

    @staticmethod
    def _delta(seq: SequenceState) -> CompletionOutput:
        a, b = seq.sent_tokens, len(seq.token_ids)
        text = seq.text if seq.finish_reason else _held_back(seq)
        out = CompletionOutput(
            index=seq.index, text=text[seq.sent_chars:], token_ids=seq.token_ids[a:b],
            logprobs=None if seq.logprobs is None else seq.logprobs[a:b],
            top_logprobs=None if seq.top_logprobs is None else seq.top_logprobs[a:b],
            sampling_masks=None if seq.sampling_masks is None else seq.sampling_masks[a:b],
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, weight_versions=seq.weight_versions[a:b],
            lora_versions=seq.lora_versions[a:b])
        seq.sent_tokens, seq.sent_chars = b, max(seq.sent_chars, len(text))
        if seq.routed is not None:  # the rows new since the last delta (recomputed earlier ones are not sent again)
            out.routed_experts = seq.routed.view(min(seq.sent_routed, seq.routed.length))
            seq.sent_routed = seq.routed.length
        return out

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its core request ids (to abort in the core)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        self._observe(state)
        for cid in state.children:
            self.child_to_parent.pop(cid, None)
        return list(state.children)


def _held_back(seq: SequenceState) -> str:
    """Text safe to show while running: a possible stop-string prefix at the end is held back."""
    if not seq.params.stop:
        return seq.text
    hold = max(len(s) for s in seq.params.stop) - 1
    return seq.text[:len(seq.text) - hold] if hold else seq.text


def _find_stop(text: str, stops: list[str], old_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the new part of text."""
    best = None
    for s in stops:
        i = text.find(s, max(0, old_len - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _copy(x):
    return None if x is None else list(x)
